"""``oxygen-bench faults``: faults in the loop on the simulated arm through the policy node, each in
its own episode, each measured.

Faults, injected by the sim itself (``oxygen-sim``'s fault switches, set as parameters while it
runs, :data:`oxygen_ros.sim.node.FAULT_PARAMETERS`):

* a camera stops, both cameras stop, the joint states stop: the sim stops publishing those streams
  for ``--fault-s`` (physics and the controllers run on), then starts again;
* the clock jumps: sim time (the stamps, ``/clock``, the controllers' "now") jumps forward 2 s, back
  2 s, or back 0.3 s (less than ``max_observation_age_s``: the node drops messages stamped that
  little earlier as out of order rather than take them for a restarted clock);
* a server killed (``server_killed``): ``oxygen-bench failover``'s kill scenario, run after the
  sim's faults with its own processes (a sim, two ``oxygen-serve`` and the node with ``engine:
  remote``) and shown in these columns by :func:`.failover.fault_row` (its ``stale``: chunks after
  the kill computed from an observation stamped before it; its full row under ``failover`` in the
  JSON).

Columns:

* ``stale``: commands computed from an observation holding an input older than the node's
  ``max_observation_age_s``, of all the commands the node computed in the episode. The node runs
  in this process (its own ROS context and executor thread, spun as ``oxygen_node`` spins it) so
  the bench sees every observation its engine acts on. Each input is traced back by its content
  (image bytes, joint positions) to the newest message with that content that reached this
  process, apart from the node's own bookkeeping; it is stale when that message had been here
  longer than ``max_observation_age_s`` + 0.25 s (the node takes messages between ticks, up to a
  tick after this process does) or its stamp is older than ``max_observation_age_s`` + 20 ms
  (``/clock``'s step) on the node's clock.
* ``oldest_s``: the oldest input (by its stamp) that any command used.
* ``gap_s``: how long the input was away (the stopped streams' last message to their first one
  after the fault; for a jump, 0).
* ``hold_s``: from the fault's onset (the stopped streams' last message) to the last trajectory
  the arm controller received before the input came back; the controller runs out that trajectory
  (one chunk: 1 s here) and holds its last point. ``-``: trajectories kept coming after the input
  was stale (the node masked the stopped camera and went on with the other one). A clock jump
  holds the arm at once (0): the running trajectory no longer applies (after a jump forward all
  its points are past and the controller holds the last; after a jump back it is not yet due and
  the controller holds where it is).
* ``resume_s``: from the input's return (its first message after the fault; for a jump, the first
  joint state stamped in the new time) to the first trajectory after that which is current: it
  starts within one loop period of its arrival and has not ended (a trajectory stamped before a
  jump back starts seconds later and only creeps the arm towards its first point).
* ``outcome``: the episode's end as the sim scores it (``success`` | ``timeout``); "before the
  fault" when it had already ended (the sim and the node go on, so the fault is still measured).
* ``node``: the policy node's lifecycle state after the episode (``active``: it kept running).

Times are wall-clock seconds as this process received the messages (sim time runs at the wall
clock's pace unless the CPU falls behind: see docs/closed_loop.md).
"""

from __future__ import annotations

import argparse
import bisect
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from oxygen_ros.engine.types import Observation
from oxygen_ros.sim.node import CAMERAS
from oxygen_ros.tools.benches import harness
from oxygen_ros.tools.benches.closed_loop_ros import (
    JOINT_STATES,
    Arrival,
    BenchNode,
    Recording,
    digest,
    positions_digest,
)
from oxygen_ros.tools.benches.harness import InProcessPolicy, Rig, Setup, round_task
from oxygen_ros.tools.processes import wait_for

HELP = "faults in the loop on the simulated arm through the node: stale commands, hold, resume"
STAMP_GRACE_S = 0.02  # /clock comes every 10 ms: the node's clock may lag a stamp by that much
TAKE_GRACE_S = 0.25  # the node takes messages between ticks: up to a tick (~0.1-0.2 s) after us
ARRIVAL_SKEW_S = 0.1  # ... or a moment before us (this process's executor thread is another)
COLUMNS = ["fault", "gap_s", "stale", "oldest_s", "hold_s", "resume_s", "outcome", "node"]


@dataclass(frozen=True)
class Fault:
    """One fault: the sim streams it silences for ``--fault-s``, the clock jump it makes, or
    ``oxygen-bench failover``'s server kill."""

    key: str  # its name in --faults
    label: str  # its name in the table
    silent: tuple[str, ...] = ()
    jump_s: float = 0.0
    failover: bool = False


FAULTS = (
    Fault("scene_camera", "scene camera stops", silent=("scene",)),
    Fault("cameras", "both cameras stop", silent=CAMERAS),
    Fault("joint_states", "joint states stop", silent=(JOINT_STATES,)),
    Fault("clock_forward", "clock jumps +2 s", jump_s=2.0),
    Fault("clock_back", "clock jumps -2 s", jump_s=-2.0),
    Fault("clock_back_small", "clock jumps -0.3 s", jump_s=-0.3),
    Fault("server_killed", "server killed", failover=True),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    harness.add_arguments(parser, timeout_s=10.0, warm_s=1.0)
    parser.add_argument(
        "--faults",
        default="all",
        help=f"comma-separated faults ({','.join(f.key for f in FAULTS)}) or all (default)",
    )
    parser.add_argument(
        "--fault-s", type=float, default=2.0, help="how long a stream stays silent (wall seconds)"
    )


# -- what reaches this process ---------------------------------------------------------------------
def current_trajectory_times(rec: Recording, lead_s: float) -> list[float]:
    """Arrivals of the arm's trajectories that start within ``lead_s`` of their arrival and have
    not ended, on the sim's clock then (the newest input's stamp, advanced by the wall time since
    it came)."""
    inputs = sorted((a for arrivals in rec.inputs.values() for a in arrivals), key=lambda a: a.at)
    times = [a.at for a in inputs]
    current = []
    for trajectory in (t for t in rec.trajectories if t.arm):
        i = bisect.bisect_right(times, trajectory.at) - 1
        if i < 0:
            continue
        now = inputs[i].stamp_ns * 1e-9 + (trajectory.at - inputs[i].at)
        if trajectory.stamp <= now + lead_s and trajectory.end >= now:
            current.append(trajectory.at)
    return current


# -- what the node acts on -------------------------------------------------------------------------
@dataclass(frozen=True)
class Act:
    """One call of the engine's ``act``: when, the node's ROS time then, and each input's
    content digest by stream."""

    at: float
    ros_ns: int
    inputs: dict[str, bytes]


class ActAudit:
    """Records every observation the policy node's engine acts on (wraps its ``act``)."""

    def __init__(self, slot_streams: dict[str, str], ros_now_ns: Callable[[], int]) -> None:
        self._slot_streams = slot_streams
        self._ros_now_ns = ros_now_ns
        self._lock = threading.Lock()
        self.acts: list[Act] = []

    def attach(self, engine: Any) -> None:
        act = engine.act

        def audited(observation: Observation):
            self._record(observation)
            return act(observation)

        engine.act = audited

    def _record(self, observation: Observation) -> None:
        inputs = {
            self._slot_streams[slot]: digest(np.ascontiguousarray(image).tobytes())
            for slot, image in observation.images.items()
        }
        inputs[JOINT_STATES] = positions_digest(observation.state)
        with self._lock:
            self.acts.append(Act(time.monotonic(), self._ros_now_ns(), inputs))

    def between(self, start: float, end: float) -> list[Act]:
        with self._lock:
            return [act for act in self.acts if start <= act.at <= end]


@dataclass(frozen=True)
class InputAge:
    """How old one input of an act was: since its message reached this process (wall s), and its
    stamp on the node's clock (sim s)."""

    wall_s: float
    stamp_s: float

    def stale(self, max_age_s: float) -> bool:
        return self.wall_s > max_age_s + TAKE_GRACE_S or self.stamp_s > max_age_s + STAMP_GRACE_S


def input_ages(act: Act, rec: Recording) -> dict[str, InputAge | None]:
    """Each input of ``act`` by stream: its age, or None when no message with its content is
    known."""
    ages: dict[str, InputAge | None] = {}
    for stream, content in act.inputs.items():
        source = rec.source(stream, content, act.at + ARRIVAL_SKEW_S)
        ages[stream] = (
            None
            if source is None
            else InputAge(act.at - source.at, (act.ros_ns - source.stamp_ns) * 1e-9)
        )
    return ages


# -- one fault ------------------------------------------------------------------------------------
@dataclass
class Window:
    """When a fault ran (monotonic s): asked for, cleared, its onset and the input's return."""

    start: float
    clear: float
    onset: float | None = None
    back: float | None = None


def silent_window(streams: dict[str, list[Arrival]], start: float, clear: float) -> Window:
    """Onset: the latest last message of the silenced streams before they came back; return:
    the first message of any of them after the fault was cleared."""
    window = Window(start, clear)
    lasts, firsts = [], []
    for arrivals in streams.values():
        lasts.append(max((a.at for a in arrivals if a.at < clear), default=None))
        firsts.append(min((a.at for a in arrivals if a.at >= clear), default=None))
    if all(t is not None for t in lasts):
        window.onset = max(lasts)
    returned = [t for t in firsts if t is not None]
    window.back = min(returned) if returned else None
    return window


def jump_window(joints: list[Arrival], start: float, clear: float) -> tuple[Window, float]:
    """Onset and return: the first joint state stamped in the new time (its stamp steps back, or
    forward by more than 0.25 s). Also the measured jump in seconds."""
    window = Window(start, clear)
    for previous, arrival in zip(joints, joints[1:], strict=False):
        step = (arrival.stamp_ns - previous.stamp_ns) * 1e-9
        if arrival.at >= start and (step < 0 or step > 0.25):
            window.onset = window.back = arrival.at
            return window, step
    return window, math.nan


def hold_and_resume(
    trajectories: list[float], window: Window, stale_after_s: float
) -> tuple[float | None, float | None]:
    """(hold s, resume s) of a silenced input from the current trajectories' arrivals: the last
    one before the input came back, from the onset, and the first one after, from the return.
    (None, None) when trajectories kept coming after the input had been away ``stale_after_s``
    (the node went on without it)."""
    onset, back = window.onset, window.back
    if onset is None:
        return None, None
    end = back if back is not None else math.inf
    if any(onset + stale_after_s < t < end for t in trajectories):
        return None, None
    before = max((t for t in trajectories if t < end), default=onset)
    after = min((t for t in trajectories if t >= end), default=None)
    return max(0.0, before - onset), (None if after is None else after - end)


def resume_after_jump(trajectories: list[float], window: Window) -> float | None:
    """The first current trajectory after a clock jump, from its onset (None: never)."""
    if window.onset is None:
        return None
    return next((t - window.onset for t in trajectories if t > window.onset), None)


class FaultRunner:
    """Runs one fault per episode and measures it."""

    def __init__(
        self,
        bench: BenchNode,
        audit: ActAudit,
        policy: InProcessPolicy,
        base: dict[str, Any],
        args: argparse.Namespace,
    ) -> None:
        self.bench, self.audit, self.policy = bench, audit, policy
        self.args = args
        self.max_age_s = float(base["max_observation_age_s"])
        self.period_s = 1.0 / float(base["rate_hz"])
        self.clock_offset_s = 0.0

    def _start(self, fault: Fault) -> None:
        if fault.silent:
            self.bench.set_sim_parameters("", {"fault_silent_streams": ",".join(fault.silent)})
        else:
            self.clock_offset_s += fault.jump_s
            self.bench.set_sim_parameters("", {"fault_clock_offset_s": self.clock_offset_s})

    def _clear(self, fault: Fault) -> None:
        if fault.silent:
            self.bench.set_sim_parameters("", {"fault_silent_streams": ""})

    def _window(
        self, fault: Fault, rec: Recording, start: float, clear: float
    ) -> tuple[Window, float]:
        """The fault's window in what ``rec`` holds (it may be recording)."""
        streams = fault.silent or (JOINT_STATES,)
        with self.bench.lock:
            arrivals = {s: list(rec.inputs.get(s, [])) for s in streams}
        if fault.silent:
            return silent_window(arrivals, start, clear), 0.0
        return jump_window(arrivals[JOINT_STATES], start, clear)

    def run(self, fault: Fault, round_index: int) -> dict[str, Any]:
        args, bench, policy = self.args, self.bench, self.policy
        task, seed = round_task(round_index, args.seed, "touch")
        policy.set_task(task.text)
        counters_before = policy.counters()
        rec = bench.start_recording("")
        index = bench.start_episode("", task.text, seed)
        policy.transition("activate")
        activated = time.monotonic()
        try:
            harness.drive(bench.arm_times, activated, args.warm_s)
            start = time.monotonic()
            self._start(fault)
            time.sleep(args.fault_s)
            clear = time.monotonic()
            self._clear(fault)

            def resumed() -> bool:
                window, _ = self._window(fault, rec, start, clear)
                back = window.back
                return back is not None and any(t > back for t in bench.arm_times())

            wait_for(resumed, 10.0)
            bench.wait_episode_end("", index, args.timeout_s)
            node_state = policy.node.state_label
        finally:
            if fault.silent:
                self._clear(fault)  # the next episode starts with every stream
            if policy.node.state_label == "active":
                policy.transition("deactivate")
            rec = bench.stop_recording()
        ended = time.monotonic()
        window, jump = self._window(fault, rec, start, clear)
        return self._measure(fault, task.text, window, jump, activated, ended, rec, index) | {
            "node": node_state,
            "counters": _difference(policy.counters(), counters_before),
        }

    def _measure(
        self,
        fault: Fault,
        task: str,
        window: Window,
        jump: float,
        activated: float,
        ended: float,
        rec: Recording,
        index: int,
    ) -> dict[str, Any]:
        acts = self.audit.between(activated, ended)
        stale, untraced, oldest = 0, 0, InputAge(-math.inf, -math.inf)
        stale_streams: dict[str, int] = {}
        for act in acts:
            ages = input_ages(act, rec)
            untraced += any(age is None for age in ages.values())
            known = {stream: age for stream, age in ages.items() if age is not None}
            old = [stream for stream, age in known.items() if age.stale(self.max_age_s)]
            stale += bool(old)
            for stream in old:
                stale_streams[stream] = stale_streams.get(stream, 0) + 1
            for age in known.values():
                oldest = InputAge(max(oldest.wall_s, age.wall_s), max(oldest.stamp_s, age.stamp_s))
        current = current_trajectory_times(rec, self.period_s)
        if fault.silent:
            hold, resume = hold_and_resume(current, window, self.max_age_s + TAKE_GRACE_S)
        else:
            hold, resume = 0.0, resume_after_jump(current, window)
        onset = window.onset
        gap = 0.0 if not fault.silent else _minus(window.back, onset)
        return {
            "fault": fault.label,
            "key": fault.key,
            "task": task,
            "gap_s": gap,
            "stale": stale,
            "cmds": len(acts),
            "untraced": untraced,
            "stale_by_stream": stale_streams,
            "oldest_s": oldest.stamp_s if acts else None,
            "oldest_wall_s": oldest.wall_s if acts else None,
            "hold_s": hold,
            "resume_s": resume,
            "outcome": rec.outcome(index, onset),
            "rejected": rec.reports[-1][1].get("rejected", {}) if rec.reports else {},
            "jump_s": jump if not fault.silent else None,
            "onset_after_start_s": _minus(onset, window.start),
            "cmds_while_away": sum(
                1 for a in acts if onset is not None and onset < a.at < (window.back or ended)
            ),
            # trajectories the controller got that start later than they arrive or have ended
            "not_current": sum(activated <= t <= ended for t in rec.arm_times())
            - sum(activated <= t <= ended for t in current),
        }


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _difference(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def _shown(row: dict[str, Any]) -> dict[str, Any]:
    """A row as the table prints it: "-" for what does not apply, stale as "n/cmds"."""
    shown = {key: "-" if value is None else value for key, value in row.items()}
    if "cmds" in row:
        shown["stale"] = f"{row['stale']}/{row['cmds']}"
    return shown


# -- the bench -------------------------------------------------------------------------------------
def slot_streams(base: dict[str, Any]) -> dict[str, str]:
    """The policy's camera slots -> the sim's camera names (from the params file's topics).

    Raises:
        SystemExit: a camera topic that is not one of the sim's.
    """
    streams = {}
    for topic, slot in zip(base["camera_topics"], base["camera_slots"], strict=True):
        name = topic.strip("/").split("/")[1] if topic.strip("/").startswith("camera/") else ""
        if name not in CAMERAS:
            raise SystemExit(f"oxygen-bench faults: camera topic {topic!r} is not the sim's")
        streams[slot] = name
    return streams


def run(args: argparse.Namespace) -> dict[str, Any]:
    faults = harness.selected(args.faults, FAULTS, "faults", "faults")
    setup = harness.prepare(args, "faults")
    print(f"faults: {len(faults)} faults, one episode each; logs in {setup.work}", flush=True)
    started = time.monotonic()
    in_sim = [fault for fault in faults if not fault.failover]
    rows = run_in_sim(in_sim, args, setup) if in_sim else []
    if len(in_sim) < len(faults):
        rows.append(server_killed(args, setup.work / "failover"))
    return harness.report(
        setup,
        args,
        rows,
        COLUMNS,
        started,
        shown=[_shown(row) for row in rows],
        fault_s=args.fault_s,
        max_observation_age_s=float(setup.base["max_observation_age_s"]),
        rate_hz=float(setup.base["rate_hz"]),
    )


def run_in_sim(faults: list[Fault], args: argparse.Namespace, setup: Setup) -> list[dict[str, Any]]:
    """The sim's faults, one episode each: the sim a process, the policy node in this one."""
    with Rig(setup.work, joint_names=setup.base["joint_names"]) as rig:
        rig.start_sim(args.timeout_s)
        policy = rig.start_policy_here(setup.params_file, setup.checkpoint)
        policy.transition("configure")
        audit = ActAudit(slot_streams(setup.base), policy.ros_now_ns)
        audit.attach(policy.engine)
        runner = FaultRunner(rig.bench, audit, policy, setup.base, args)
        return harness.rounds(
            runner.run,
            faults,
            lambda row: (
                f"stale {row['stale']}/{row['cmds']}, hold {row['hold_s']}, "
                f"resume {row['resume_s']}, {row['outcome']}, node {row['node']}"
            ),
        )


def server_killed(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """``oxygen-bench failover``'s kill scenario (its own sim, two ``oxygen-serve`` processes and
    the node with ``engine: remote``, as processes) in this table's columns; its own row is kept
    under ``failover``."""
    from oxygen_ros.tools.benches import failover

    parser = argparse.ArgumentParser()
    failover.add_arguments(parser)
    options = parser.parse_args(["--scenarios", "kill", "--work", str(work)])
    for shared in ("checkpoint", "params_file", "timeout_s", "seed", "warm_s"):
        setattr(options, shared, getattr(args, shared))
    (row,) = failover.run(options)["rows"]
    return {**failover.fault_row(row), "key": "server_killed", "failover": row}
