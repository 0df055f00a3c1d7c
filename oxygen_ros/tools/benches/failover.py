"""``oxygen-bench failover``: the simulated arm driven by the policy node with ``engine: remote``
over two ``oxygen-serve`` processes; mid-episode the serving one dies, and the node moves on to
the other.

The sim (``oxygen-sim``), two servers of the checkpoint and the policy node (``config/sim_policy
.yaml`` with ``engine: remote`` and ``server_uris`` naming both, its trajectories remapped onto the
sim's controllers) run as processes in a private ROS graph, as ``closed-loop`` runs them. Each
scenario is one episode (the touch task of closed-loop's round r): ``--warm-s`` wall seconds after
the first trajectory, the server the node uses (the one its log last says it connected to) is

* ``kill``: sent SIGKILL (a process or box that dies: the socket closes, no close frame). The node
  sees the connection drop and moves on at once.
* ``hang``: sent SIGSTOP (a server that stops answering, its socket still open). The node moves on
  after ``server_switch_after_misses`` (3) ticks in a row without a reply in time.
* ``failback``: the first server (the node's preferred one) killed, then once the node has a chunk
  from the other started again on its port; the node goes back to it by itself once its
  ``/healthz`` is ready (``server_failback_probe_s``). Needs time after the restart: use the
  default 20 s episodes.

Afterwards the killed server is started again on its port (the hung one continued), so each
scenario starts with two servers, each ready by its ``/healthz`` (oxygen-serve pays torch's
first-call costs, 0.3-1 s here, before it says so: a cold server would look hung to the node).

Columns:

* ``period_s``: the median wall seconds between chunks before the fault (the loop's pace then);
* ``no_chunk_s``: wall seconds from the last chunk before the fault to the first one after it
  (the time the arm had no fresh chunk), as this process received them;
* ``switch_s``: from the fault to the node's log line saying it connected to the other server;
* ``first_chunk_s``: from the fault to the first chunk after it;
* ``cmds_in_gap``: trajectories (arm and gripper) that reached the controllers stamped after the
  last chunk before the fault and before the first chunk after it: none may come from the node
  while it has no server;
* ``stale_after``: chunks after the fault computed from an observation stamped before the fault
  (sim time), of the chunks after it;
* ``horizon_s``: the last trajectory's span before the fault (sim seconds): the arm runs it out,
  then its controller holds the last point;
* ``held_s``: sim seconds from that trajectory's end to the first new trajectory's arrival (0:
  the new one came before the old one ran out);
* ``moved_rad``: the most any arm joint moved while it held (after the horizon, before the new
  trajectory): the arm stays where the last good chunk left it;
* ``outcome``: the episode's end as the sim scores it (``success`` | ``timeout``; "before the
  fault" when it ended earlier), ``end_s``: wall seconds from the fault to that end, and
  ``chunks_after``: the chunks the episode got after the fault; ``node``: the policy node's
  lifecycle state after the episode; ``switches``: the node's switches during the episode (its
  log): 1 is the fault's, more are a loaded machine's deadline misses moving it on again.
* failback only (:func:`failback`): ``back_s`` from the restarted server's readiness (its log's
  ``oxygen-serve ready`` line: warmed up, ``/healthz`` 200) to the node's log line saying it
  moved back; ``back_gap_s`` the chunks' gap around the move; ``stale_back`` the chunks after
  it stamped no later than the newest before it, of ``chunks_back``.

:func:`fault_row` turns a row into ``oxygen-bench faults``' columns (that bench runs the ``kill``
scenario through :func:`run` for its table).
"""

from __future__ import annotations

import argparse
import math
import re
import signal
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from oxygen_ros.tools.benches import harness
from oxygen_ros.tools.benches.closed_loop_ros import (
    ACTIVATE,
    CONFIGURE,
    DEACTIVATE,
    STATE_ACTIVE,
    BenchNode,
    Received,
    Recording,
)
from oxygen_ros.tools.benches.harness import Rig, Servers, round_task
from oxygen_ros.tools.processes import LoggedProcess, wait_for

HELP = "the sim arm through the node over two oxygen-serve processes: one dies mid-episode"
LOG_FORMAT = "[{severity}] [{time}] [{name}]: {message}"  # the node's log, for the switch time
COLUMNS = [
    "fault",
    "period_s",
    "no_chunk_s",
    "switch_s",
    "first_chunk_s",
    "cmds_in_gap",
    "stale_after",
    "horizon_s",
    "held_s",
    "moved_rad",
    "outcome",
    "end_s",
    "chunks_after",
    "node",
    "switches",
]


@dataclass(frozen=True)
class Scenario:
    key: str  # its name in --scenarios
    label: str  # its name in the table
    signum: int  # what the serving server is sent
    failback: bool = False  # restarted mid-episode: the node is to come back to it


SCENARIOS = (
    Scenario("kill", "server killed", signal.SIGKILL),
    Scenario("hang", "server hung", signal.SIGSTOP),
    Scenario("failback", "killed, restarted", signal.SIGKILL, failback=True),
)
FAILBACK_COLUMNS = ["back_s", "back_gap_s", "stale_back", "chunks_back"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    harness.add_arguments(parser, timeout_s=20.0, warm_s=0.5)
    parser.add_argument(
        "--scenarios", default="all", help="kill, hang, failback (comma-separated) or all (default)"
    )
    parser.add_argument(
        "--server-timeout-ms",
        type=float,
        default=0.0,
        help="the node's server_timeout_ms (default 0: one tick period)",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="episodes per scenario (scenarios take turns)"
    )


# -- the node's log ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Connection:
    """A connection the node's log reports: when (wall, epoch s), to which server, and whether it
    moved on from another one."""

    wall: float
    uri: str
    moved: bool


CONNECTED = re.compile(
    r"\[(\d+\.\d+)\] \[[^\]]*\]: connected to oxygen-serve at (\S+)( \(moved on from)?"
)


def connections(log_text: str) -> list[Connection]:
    """Every connection the node's log reports, in order."""
    return [
        Connection(float(m.group(1)), m.group(2), m.group(3) is not None)
        for m in CONNECTED.finditer(log_text)
    ]


def switch_time(log_text: str, after_wall: float, uri: str) -> float | None:
    """The wall time of the node's first switch to ``uri`` after ``after_wall`` (None: none)."""
    return next(
        (
            c.wall
            for c in connections(log_text)
            if c.moved and c.uri == uri and c.wall >= after_wall
        ),
        None,
    )


# -- the measurement -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Fault:
    """When the serving server was hit: this process's monotonic and wall clocks, and sim time."""

    at: float
    wall: float
    sim: float


def measure(
    scenario: Scenario,
    fault: Fault,
    chunks: Sequence[Received],
    trajectories: Sequence[Received],
    rec: Recording,
    index: int,
    switched_wall: float | None,
) -> dict[str, Any]:
    """One scenario's row (see the module docstring); ``rec`` gives the arm's joint states and the
    sim's episode reports."""
    before = [c for c in chunks if c.at < fault.at]
    after = [c for c in chunks if c.at >= fault.at]
    gaps = [b.at - a.at for a, b in zip(before, before[1:], strict=False)]
    last, first = (before[-1] if before else None), (after[0] if after else None)
    last_stamp = last.stamp if last else -math.inf
    first_stamp = first.stamp if first else math.inf
    in_gap = [t for t in trajectories if last_stamp < t.stamp < first_stamp]
    old = [t for t in trajectories if t.stamp == last_stamp]  # the last good chunk's
    horizon_end = max((t.end for t in old), default=math.nan)
    horizon = horizon_end - last_stamp if old else math.nan
    new_arrival = min((t.sim_at for t in trajectories if t.stamp == first_stamp), default=math.nan)
    held = max(0.0, new_arrival - horizon_end) if old and first else math.nan
    return {
        "fault": scenario.label,
        "key": scenario.key,
        "no_chunk_s": first.at - last.at if last and first else None,
        "period_s": statistics.median(gaps) if gaps else None,
        "switch_s": switched_wall - fault.wall if switched_wall is not None else None,
        "first_chunk_s": first.at - fault.at if first else None,
        "cmds_in_gap": len(in_gap),
        "stale_after": f"{sum(c.stamp < fault.sim for c in after)}/{len(after)}",
        "horizon_s": horizon,
        "held_s": held,
        "moved_rad": _moved(rec, horizon_end, new_arrival) if held and held > 0 else 0.0,
        "outcome": rec.outcome(index, fault.at),
        "end_s": rec.ended_at(index) - fault.at,
        "chunks_after": len(after),
        "chunks_before": len(before),
    }


def _moved(rec: Recording, start: float, end: float) -> float:
    """The most any arm joint moved from sim time ``start`` until (not at) ``end``."""
    held = [
        q for t, q in zip(rec.joint_times, rec.joint_positions, strict=True) if start <= t < end
    ]
    if len(held) < 2:
        return 0.0
    return max(abs(a - b) for q in held for a, b in zip(q, held[0], strict=True))


def fault_row(row: dict[str, Any]) -> dict[str, Any]:
    """A row in ``oxygen-bench faults``' columns: the gap is the time without a fresh chunk,
    stale the chunks after the fault from an observation older than it, hold the wait from the
    fault to the last trajectory before the gap (the arm runs it out), resume the fault to the
    first chunk from the other server."""
    return {
        "fault": row["fault"],
        "gap_s": row["no_chunk_s"],
        "stale": row["stale_after"],
        "hold_s": 0.0,
        "resume_s": row["first_chunk_s"],
        "outcome": row["outcome"],
        "node": row["node"],
    }


READY = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*oxygen-serve ready", re.M)


def ready_time(serve_log: str) -> Fault:
    """When a server last said it was ready (its log line; this process's clocks)."""
    stamps = READY.findall(serve_log)
    if not stamps:
        raise RuntimeError("the restarted server's log has no 'oxygen-serve ready' line")
    wall = datetime.strptime(stamps[-1], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time
    return Fault(time.monotonic() - (time.time() - wall), wall, math.nan)


def failback(chunks: Sequence[Received], ready: Fault, back_wall: float | None) -> dict[str, Any]:
    """The move back to the first server, restarted and ready at ``ready``, that the node's log
    says happened at ``back_wall`` (None: never): ``back_s`` from ready to back; ``back_gap_s``
    the chunks' gap around it; ``chunks_back`` the chunks after it; ``stale_back`` those stamped
    no later than the newest chunk before it (an observation the backup had answered, or older)."""
    if back_wall is None:
        return {"back_s": None, "back_gap_s": None, "chunks_back": 0, "stale_back": None}
    back = ready.at + (back_wall - ready.wall)  # on this process's monotonic clock
    before = [c for c in chunks if c.at < back]
    after = [c for c in chunks if c.at >= back]
    newest = max((c.stamp for c in before), default=-math.inf)
    return {
        "back_s": back_wall - ready.wall,
        "back_gap_s": after[0].at - before[-1].at if before and after else None,
        "chunks_back": len(after),
        "stale_back": f"{sum(c.stamp <= newest for c in after)}/{len(after)}",
    }


# -- the bench -------------------------------------------------------------------------------------
class FailoverRunner:
    def __init__(
        self, bench: BenchNode, servers: Servers, policy: LoggedProcess, args: argparse.Namespace
    ) -> None:
        self.bench, self.servers, self.policy, self.args = bench, servers, policy, args

    def run(self, scenario: Scenario, round_index: int) -> dict[str, Any]:
        bench, args, servers = self.bench, self.args, self.servers
        task, seed = round_task(round_index, args.seed, "touch")
        bench.set_policy_parameters({"task": task.text})
        rec = bench.start_recording("")
        index = bench.start_episode("", task.text, seed)
        activated, activated_wall = time.monotonic(), time.time()
        hit, back = None, {}
        try:
            if not bench.transition(ACTIVATE):
                raise RuntimeError(f"activate failed: see {self.policy.log_path}")
            harness.drive(bench.arm_times, activated, args.warm_s)
            serving = connections(self.policy.log_text())[-1].uri
            if scenario.failback and serving != servers.uris[0]:
                raise RuntimeError(f"failback: the node is on {serving}, not the first server")
            hit = servers.by_uri(serving)
            fault = Fault(time.monotonic(), time.time(), bench.now(""))
            hit.process.send_signal(scenario.signum)
            other = next(uri for uri in servers.uris if uri != hit.uri)
            wait_for(lambda: any(t > fault.at for t in bench.chunk_times()), 60.0)
            if scenario.failback:  # restart it; the node is to come back by itself
                servers.restore(hit, 120.0)
                ready, hit = ready_time(servers.processes[0].log_text()), None
                wait_for(lambda: self._back(fault.wall) is not None, 30.0)
                wait_for(lambda: any(t > ready.at + 1.0 for t in bench.chunk_times()), 30.0)
            bench.wait_episode_end("", index, args.timeout_s)
            node = "active" if bench.policy_state() == STATE_ACTIVE else "not active"
            ended_wall = time.time()
            server = bench.fresh_server()
            bench.transition(DEACTIVATE)
        finally:
            rec = bench.stop_recording()
            if hit is not None:
                servers.restore(hit, 120.0)
        chunks = [c for c in rec.chunks if c.at >= activated]
        if scenario.failback:
            back = failback(chunks, ready, self._back(fault.wall))
        log = self.policy.log_text()
        row = measure(
            scenario,
            fault,
            chunks,
            [t for t in rec.trajectories if t.at >= activated],
            rec,
            index,
            switch_time(log, fault.wall, other),
        )
        moved = [c for c in connections(log) if c.moved and activated_wall <= c.wall <= ended_wall]
        return (
            row
            | back
            | {
                "node": node,
                "switches": len(moved),
                "task": task.text,
                "from": serving,
                "to": server.get("server_uri", ""),
                "last_switch": server.get("server_last_switch", ""),
                "failbacks": server.get("server_failbacks", ""),
            }
        )

    def _back(self, after_wall: float) -> float | None:
        """When the node's log says it moved back to the first server after ``after_wall``."""
        return switch_time(self.policy.log_text(), after_wall, self.servers.uris[0])


def run(args: argparse.Namespace) -> dict[str, Any]:
    scenarios = harness.selected(args.scenarios, SCENARIOS, "scenarios", "failover")
    setup = harness.prepare(args, "failover")
    print(
        f"failover: {len(scenarios)} scenarios x {args.repeats} episodes; logs in {setup.work}",
        flush=True,
    )
    started = time.monotonic()
    with Rig(setup.work, env={"RCUTILS_CONSOLE_OUTPUT_FORMAT": LOG_FORMAT}) as rig:
        servers = rig.start_servers(setup.checkpoint, harness.serve_args(setup.base))
        rig.start_sim(args.timeout_s)
        servers.wait_ready(120.0)
        parameters = harness.remote_parameters(setup.base, servers.uris, args.server_timeout_ms)
        policy = rig.start_policy(rig.write_parameters("failover_policy.yaml", parameters))
        if not rig.bench.transition(CONFIGURE):
            raise setup.fail(f"configure failed: {policy.log_text()[-3000:]}")
        runner = FailoverRunner(rig.bench, servers, policy, args)
        turns = [s for _ in range(args.repeats) for s in scenarios]
        rows = harness.rounds(
            runner.run,
            turns,
            lambda row: (
                f"no chunk for {row['no_chunk_s']} s, gap commands {row['cmds_in_gap']}, "
                f"back {row.get('back_s', '-')} s, {row['outcome']}, node {row['node']}"
            ),
        )
    columns = COLUMNS + (FAILBACK_COLUMNS if any(s.failback for s in scenarios) else [])
    return harness.report(
        setup,
        args,
        rows,
        columns,
        started,
        server_timeout_ms=args.server_timeout_ms,
        rate_hz=float(setup.base["rate_hz"]),
    )
