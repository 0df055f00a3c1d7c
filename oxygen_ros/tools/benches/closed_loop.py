"""``oxygen-bench closed-loop``: episodes on the simulated arm through the real policy node over
DDS, per setting: success (Wilson 95 % CI), time to success, jerk and chunk-switch jump of the
executed trajectory, controller rejections, late chunks, and the words judged against the sim.

The sim (``oxygen-sim``) and the policy node (``config/sim_policy.yaml``, its two trajectory
outputs remapped onto the sim's controllers) run as processes in a private ROS graph (a random
ROS_DOMAIN_ID, localhost discovery). Episodes start through ``sim/reset``; the settings take turns
episode by episode (round r runs every setting once on the same task and layout seed r, so drift
of the machine hits them alike). Between a policy node's episodes it is deactivated; a setting
with other configure-time parameters (checkpoint, chunk_continuity, subtask_conditioning)
reconfigures it (deactivate, cleanup, set, configure, activate), cheaper than a restart. The
expert setting runs ``oxygen-sim --expert`` in namespace /expert for its episode while the policy
node stays inactive.

Settings: ``expert`` (the scripted expert through the same controller topics: the ceiling),
``random`` (the checkpoint's weights shuffled: the floor), ``none/dD``, ``identity/dD``,
``trained/dD`` (chunk_continuity none, guided identity RTC on the checkpoint told it has no
training-time RTC, and training-time RTC when the checkpoint declares it) under an injected
inference delay of D controller steps (the node's ``inject_inference_delay_ms``), ``flat`` vs
``same_frame`` (the place task with subtask_conditioning none vs same_frame), ``contention`` (a
busy process competes for the CPU, overrun_policy adapt) and ``ask`` (an Ask goal "which cube
are you going for?" during the episode: does the answer name the target colour?).

Tasks (``--tasks``): touch, place, both (by round) or two_step (a place, then a touch or another
place, by round; the sim's timeout is 30 s for them unless ``--timeout-s`` says otherwise, and
it is the sim's for every setting's episode, flat/same_frame's place included). A two-step
episode's texts are judged against the step the sim was in, the Ask answer against the cube of
the step in force when it came.

Metrics: see :mod:`.closed_loop_metrics`. Chunks late: ActionChunk messages with deadline_met
false (published after the loop's period). Chunk rate: chunks per sim second over the episode.
Time to success counts from the sim's reset, so a policy's includes the node's activation.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

from oxygen_ros.sim.tasks import Task
from oxygen_ros.tools.benches import closed_loop_metrics as m
from oxygen_ros.tools.benches import harness
from oxygen_ros.tools.benches.closed_loop_ros import (
    ACTIVATE,
    CLEANUP,
    CONFIGURE,
    DEACTIVATE,
    EXPERT_NAMESPACE,
    STATE_ACTIVE,
    STATE_INACTIVE,
    Recording,
    episode_wall_limit,
)
from oxygen_ros.tools.benches.closed_loop_settings import (
    ASK_QUESTION,
    EXPERT,
    PLACE_TASK,
    RANDOM,
    TOUCH_TASK,
    TRAINED,
    Setting,
    all_settings,
    declares_trained_rtc,
    parse_delays,
    random_variant,
    select,
)
from oxygen_ros.tools.benches.harness import Rig, Setup, round_task
from oxygen_ros.tools.processes import wait_for

HELP = "episodes on the simulated arm through the real node over DDS, per setting"
DEFAULT_TIMEOUT_S = 20.0  # sim seconds per episode
TWO_STEP_TIMEOUT_S = 30.0  # --tasks two_step: the expert needs ~7-10 sim s for both steps
COLUMNS = [
    "setting",
    "n",
    "success",
    "ci_low",
    "ci_high",
    "t_success_s",
    "jerk_rms",
    "switch_jump_rad",
    "rejected",
    "late",
    "chunks",
    "rate_hz",
    "narr_ok",
    "subtask_ok",
    "asked",
    "ask_ok",
    "narr_place_ok",
    "subtask_place_ok",
    "ask_place_ok",
    "wall_s",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = f"{__doc__}\n{m.__doc__}"
    harness.add_arguments(
        parser, timeout_s=DEFAULT_TIMEOUT_S, two_step_timeout_s=TWO_STEP_TIMEOUT_S
    )
    parser.add_argument("--episodes", type=int, default=50, help="episodes per setting")
    parser.add_argument(
        "--settings",
        default="all",
        help="comma-separated settings or families (expert,random,none,identity,trained,flat,"
        "same_frame,contention,ask; none/d3 picks one delay); default all",
    )
    parser.add_argument(
        "--tasks",
        default="touch",
        choices=["touch", "place", "both", "two_step"],
        help="the task of every setting but flat/same_frame (always place); both: by round; "
        "two_step: a place, then a touch (even rounds) or another place (odd rounds)",
    )
    parser.add_argument(
        "--delays",
        default="0,3,5",
        help="injected inference delays, controller steps (action_dt) or NNms (default 0,3,5: "
        "30 %% and half of the 10-step chunk)",
    )
    parser.add_argument(
        "--ask-after-s",
        type=float,
        default=0.5,
        help="ask setting: seconds into the episode (default 0.5: the shipped policy touches at "
        "0.7-1.5 s; an episode that ends first is not asked, and not judged)",
    )


def setting_task_kind(setting: Setting, tasks: str, round_index: int) -> str:
    if setting.task_kind != "any":
        return setting.task_kind
    if tasks == "both":
        return TOUCH_TASK if round_index % 2 == 0 else PLACE_TASK
    return tasks


class EpisodeRunner:
    """Runs one episode of a setting and measures it."""

    def __init__(
        self, rig: Rig, setup: Setup, checkpoints: dict[str, Path], args: argparse.Namespace
    ) -> None:
        self.rig, self.bench, self.work, self.base = rig, rig.bench, setup.work, setup.base
        self.checkpoints, self.args = checkpoints, args
        self.signature: tuple | None = None
        self.reconfigures = 0

    # -- the policy node --------------------------------------------------------------------------
    def _configure(self, setting: Setting) -> None:
        if self.signature == setting.signature():
            return
        bench = self.bench
        state = bench.policy_state()
        if state == STATE_ACTIVE:
            bench.transition(DEACTIVATE)
            state = STATE_INACTIVE
        if state == STATE_INACTIVE:
            bench.transition(CLEANUP)
        values = {
            "checkpoint_dir": str(self.checkpoints[setting.checkpoint]),
            "chunk_continuity": self.base.get("chunk_continuity", "none"),
            "rtc_mode": self.base.get("rtc_mode", "auto"),
            "rtc_guidance": self.base.get("rtc_guidance", "identity"),
            "subtask_conditioning": self.base.get("subtask_conditioning", "none"),
            **setting.configure,
        }
        bench.set_policy_parameters(values)
        if not bench.transition(CONFIGURE):
            raise RuntimeError(f"configure failed for {setting.name}: see {self.work}")
        self.signature = setting.signature()
        self.reconfigures += 1

    def _run_policy(self, setting: Setting, task: Task, seed: int) -> tuple[Recording, dict]:
        bench = self.bench
        self._configure(setting)
        bench.set_policy_parameters(
            {
                "task": task.text,
                "inject_inference_delay_ms": 0.0,
                "overrun_policy": self.base.get("overrun_policy", "adapt"),
                **setting.runtime,
            }
        )
        rec = bench.start_recording("")
        index = bench.start_episode("", task.text, seed)
        rec.start_sim = bench.now("")
        busy = self.rig.start_busy() if setting.contention else None
        extra: dict[str, Any] = {}
        try:
            if not bench.transition(ACTIVATE):
                raise RuntimeError(f"activate failed for {setting.name}")
            answer = self._wait_episode("", index, setting.ask)
            rec.end_sim = bench.now("")
            if answer is not None:
                extra["answer"] = answer
            bench.transition(DEACTIVATE)
        finally:
            if busy is not None:
                busy.stop()
        rec = bench.stop_recording()
        return rec, {**extra, "episode": index}

    def _wait_episode(self, ns: str, index: int, ask: bool) -> tuple[float, str] | None:
        """Wait for the episode's end (asking the question on the way when ``ask``); the answer
        and when it came (monotonic s; NaN and "" when the node refused the goal or no answer
        came), None when nothing was asked (``ask`` off, or the episode ended first)."""
        bench, started = self.bench, time.monotonic()
        limit = episode_wall_limit(self.args.timeout_s)
        pending, answered = None, math.nan
        while not bench.episode_ended(ns, index) and time.monotonic() - started < limit:
            if ask and pending is None and time.monotonic() - started >= self.args.ask_after_s:
                pending = bench.ask(ASK_QUESTION) or False
            if pending and math.isnan(answered) and pending.done():
                answered = time.monotonic()
            time.sleep(0.05)
        if pending is None:
            return None
        if not pending:
            return (math.nan, "")
        if not wait_for(pending.done, 20.0):
            return (math.nan, "")
        answered = time.monotonic() if math.isnan(answered) else answered
        return answered, pending.result().result.text

    # -- the expert -------------------------------------------------------------------------------
    def _run_expert(self, task: Task, seed: int) -> tuple[Recording, dict]:
        bench = self.bench
        bench.forget_reports(EXPERT_NAMESPACE)
        sim = self.rig.sim(self.args.timeout_s, EXPERT_NAMESPACE, expert=True)
        try:
            rec = bench.start_recording(EXPERT_NAMESPACE)
            index = bench.start_episode(EXPERT_NAMESPACE, task.text, seed)
            rec.start_sim = bench.now(EXPERT_NAMESPACE)
            self._wait_episode(EXPERT_NAMESPACE, index, ask=False)
            rec.end_sim = bench.now(EXPERT_NAMESPACE)
            rec = bench.stop_recording()
        finally:
            sim.stop()
        return rec, {"episode": index}

    def lost(self) -> None:
        """After a failed episode: stop recording, reconfigure the node before the next one."""
        self.bench.stop_recording()
        self.signature = None

    def run(self, setting: Setting, task: Task, seed: int, round_index: int) -> dict[str, Any]:
        started = time.monotonic()
        if setting.driver == EXPERT:
            rec, extra = self._run_expert(task, seed)
        else:
            rec, extra = self._run_policy(setting, task, seed)
        result = measure(rec, task, extra["episode"], extra.get("answer"))
        result.update(setting=setting.name, round=round_index, task=task.text, seed=seed)
        result["wall_s"] = time.monotonic() - started
        return result


def measure(
    rec: Recording, task: Task, index: int, answer: tuple[float, str] | None = None
) -> dict[str, Any]:
    """One episode's numbers from its recording (and the Ask answer with its arrival time)."""
    reports = rec.reports_of(index)
    final = reports[-1][1] if reports else {}
    success_at = next((t for t, r in reports if r.get("status") == "success"), None)
    start, end = rec.start_sim, rec.end_sim
    joints = [
        (t, q)
        for t, q in zip(rec.joint_times, rec.joint_positions, strict=True)
        if start < t <= end
    ]
    switches = [(p, a) for p, a in zip(rec.plans, rec.arrivals, strict=True) if start <= a <= end]
    jumps = m.switch_jumps([p for p, _ in switches], [a for _, a in switches])
    chunk_stamps = [c.stamp for c in rec.chunks]
    span = (max(chunk_stamps) - min(chunk_stamps)) if len(chunk_stamps) > 1 else 0.0

    def judged(t: float, text: str) -> tuple[str, bool, bool | None]:
        """The text, whether its cube and phase are right, whether its place is (None: unsaid)."""
        start = t - m.JUDGE_TOLERANCE_S
        phases = m.sim_phases(task, rec.sim_subtasks, success_at, start, t)
        places = m.sim_places(rec.sim_subtasks, start, t)
        return text, m.judge_text(task, text, phases), m.judge_place(text, places)

    narrations = [m.strip_kind(raw) + (t,) for t, raw in rec.narrations]
    narr = [judged(t, text) for kind, text, t in narrations if kind in ("narration", "")]
    subs = [judged(t, text) for t, text in rec.policy_subtasks if text]
    out = {
        "status": final.get("status", "lost"),
        "success": final.get("status") == "success",
        "elapsed_s": final.get("elapsed_s", math.nan),
        "rejected": int(sum(final.get("rejected", {}).values())),
        "rejected_by_reason": final.get("rejected", {}),
        "jerk_rms": m.rms_jerk([t for t, _ in joints], [q for _, q in joints])
        if joints
        else math.nan,
        "switch_jump_rad": m.mean_or_nan(jumps),
        "switches": len(jumps),
        "chunks": len(rec.chunks),
        "chunks_late": sum(not c.on_time for c in rec.chunks),
        "chunk_rate_hz": (len(chunk_stamps) - 1) / span if span > 0 else math.nan,
        "narrations": len(narr),
        "narrations_right": sum(right for _, right, _ in narr),
        "narrations_placed": sum(place is not None for *_, place in narr),
        "narrations_place_right": sum(place is True for *_, place in narr),
        "subtasks": len(subs),
        "subtasks_right": sum(right for _, right, _ in subs),
        "subtasks_placed": sum(place is not None for *_, place in subs),
        "subtasks_place_right": sum(place is True for *_, place in subs),
        "texts": {"narration": narr, "subtask": subs},  # (text, cube and phase right, place right)
    }
    if answer is not None:
        at, text = answer
        out["answer"] = text
        target = m.step_at(task, rec.sim_subtasks, at).cube  # two-step: the step's cube then
        out["answer_names_target"] = m.names_colour(text, target)
        if m.said_place(text):  # the trained answer says none: judged only when it does
            places = m.sim_places(rec.sim_subtasks, at - m.JUDGE_TOLERANCE_S, at)
            out["answer_place_right"] = bool(m.judge_place(text, places))
    return out


def summarise(settings: list[Setting], episodes: list[dict]) -> list[dict[str, Any]]:
    rows = []
    for setting in settings:
        ran = [e for e in episodes if e["setting"] == setting.name]
        mine = [e for e in ran if e["status"] != "error"]
        if not mine:
            continue

        def share(right: str, of: str | None = None, among: list[dict] = mine) -> float:
            """``right`` summed over the episodes, over their ``of`` summed (None: their count)."""
            total = len(among) if of is None else sum(e[of] for e in among)
            return m.fraction_or_nan(sum(e[right] for e in among), total)

        n, wins = len(mine), sum(e["success"] for e in mine)
        low, high = m.wilson_interval(wins, n)
        # an episode over before the question went out is not judged
        asked = [e for e in mine if "answer_names_target" in e]
        placed = [e for e in mine if "answer_place_right" in e]
        rows.append(
            {
                "setting": setting.name,
                "continuity": setting.continuity,
                "delay_steps": setting.delay_steps,
                "n": n,
                "success": wins / n,
                "ci_low": low,
                "ci_high": high,
                "t_success_s": m.median_or_nan([e["elapsed_s"] for e in mine if e["success"]]),
                "jerk_rms": m.mean_or_nan([e["jerk_rms"] for e in mine]),
                "switch_jump_rad": m.mean_or_nan([e["switch_jump_rad"] for e in mine]),
                "rejected": sum(e["rejected"] for e in mine),
                "late": sum(e["chunks_late"] for e in mine),
                "chunks": sum(e["chunks"] for e in mine),
                "rate_hz": m.median_or_nan([e["chunk_rate_hz"] for e in mine]),
                "narr_ok": share("narrations_right", "narrations"),
                "subtask_ok": share("subtasks_right", "subtasks"),
                "asked": len(asked),
                "ask_ok": share("answer_names_target", among=asked),
                "narr_place_ok": share("narrations_place_right", "narrations_placed"),
                "subtask_place_ok": share("subtasks_place_right", "subtasks_placed"),
                "ask_place_ok": share("answer_place_right", among=placed),
                "wall_s": m.mean_or_nan([e["wall_s"] for e in mine]),
                "errors": len(ran) - len(mine),
            }
        )
    return rows


def _ordered(settings: list[Setting], round_index: int) -> list[Setting]:
    """A round's order: the expert first, then the policy settings grouped by what configure
    needs (fewest reconfigures), the groups' order reversed every other round."""
    expert = [s for s in settings if s.driver == EXPERT]
    policy = sorted((s for s in settings if s.driver != EXPERT), key=lambda s: repr(s.signature()))
    return expert + (policy[::-1] if round_index % 2 else policy)


def _checkpoints(checkpoint: Path, settings: list[Setting], work: Path) -> dict[str, Path]:
    needed = {s.checkpoint for s in settings if s.driver != EXPERT}
    paths = {TRAINED: checkpoint}
    if RANDOM in needed:
        paths[RANDOM] = random_variant(checkpoint, work / "checkpoint_random")
    return paths


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.timeout_s = harness.episode_timeout_s(args, args.tasks)  # the sim's, every episode
    setup = harness.prepare(args, "closed-loop")
    delays = parse_delays(args.delays, float(setup.base.get("action_dt", 0.1)))
    try:
        settings = select(
            all_settings(delays, declares_trained_rtc(setup.checkpoint)), args.settings
        )
    except ValueError as exc:
        raise setup.fail(str(exc)) from exc
    checkpoints = _checkpoints(setup.checkpoint, settings, setup.work)
    print(f"closed-loop: {len(settings)} settings x {args.episodes} episodes; logs in {setup.work}")
    episodes: list[dict] = []
    started = time.monotonic()
    with Rig(setup.work, namespaces=("", EXPERT_NAMESPACE)) as rig:
        if any(s.driver != EXPERT for s in settings):
            rig.start_sim(args.timeout_s)
            rig.start_policy(setup.params_file, checkpoints[TRAINED])
        runner = EpisodeRunner(rig, setup, checkpoints, args)
        for round_index in range(args.episodes):
            for setting in _ordered(settings, round_index):
                kind = setting_task_kind(setting, args.tasks, round_index)
                task, seed = round_task(round_index, args.seed, kind)
                try:
                    result = runner.run(setting, task, seed, round_index)
                except (RuntimeError, TimeoutError) as exc:  # one lost episode, not the whole run
                    runner.lost()
                    result = {"setting": setting.name, "round": round_index, "task": task.text}
                    result.update(status="error", error=str(exc), elapsed_s=math.nan, wall_s=0.0)
                episodes.append(result)
                print(
                    f"[{round_index + 1}/{args.episodes}] {setting.name:>14}: "
                    f"{result['status']:>7} "
                    f"{result['elapsed_s']:5.1f} sim s, {result['wall_s']:5.1f} wall s, "
                    f"{task.text!r}",
                    flush=True,
                )
    return harness.report(
        setup,
        args,
        summarise(settings, episodes),
        COLUMNS,
        started,
        episodes_per_setting=args.episodes,
        timeout_s=args.timeout_s,
        delays=[{"steps": s, "ms": ms} for s, ms in delays],
        reconfigures=runner.reconfigures,
        episodes=episodes,
    )
