"""``oxygen-demo --sim``: the pi0.5 trained here drives the simulated arm through the node.

The sim (``oxygen-sim``) and the policy node (``config/sim_policy.yaml`` with the shipped
``models/sim_so101`` checkpoint, its trajectories remapped onto the sim's two controllers) run as
processes in a private ROS graph; this process resets an episode per task, activates the node and
prints a line per second — sim time, the sim's own phase, the node's latest narration and
subtask, chunks — then the sim's verdict. The processes and the ROS plumbing are the closed-loop
benches' (:mod:`oxygen_ros.tools.benches.harness`); its numbers are the benches' to measure.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from oxygen_ros.sim.episode import SUCCESS, TIMEOUT, WRONG_CUBE
from oxygen_ros.tools.benches.closed_loop_ros import (
    ACTIVATE,
    CONFIGURE,
    DEACTIVATE,
    BenchNode,
    episode_wall_limit,
)
from oxygen_ros.tools.benches.harness import Rig, shipped
from oxygen_ros.tools.processes import wait_for

TASKS = ("touch the red cube", "touch the blue cube", "touch the green cube")
SHIPPED_CHECKPOINT = "models/sim_so101"


def run_sim_demo(episodes: int, timeout_s: float, work: Path | None = None) -> int:
    """Run ``episodes`` episodes (the touch tasks in turn, seed = episode number); 0 when every
    episode ended with the sim's verdict (success, timeout or wrong_cube)."""
    work = work or Path(tempfile.mkdtemp(prefix="oxygen_sim_demo_"))
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = shipped(SHIPPED_CHECKPOINT)
    print(f"sim demo: {checkpoint} driving the simulated arm; logs in {work}", flush=True)
    ended = successes = 0
    with Rig(work) as rig:
        rig.start_sim(timeout_s)
        rig.start_policy(shipped("config/sim_policy.yaml"), checkpoint)
        if not rig.bench.transition(CONFIGURE):
            raise RuntimeError(f"the policy node did not configure: see {work}/policy_node.log")
        for index in range(episodes):
            task = TASKS[index % len(TASKS)]
            status = _episode(rig.bench, task, seed=index, timeout_s=timeout_s)
            ended += status in (SUCCESS, TIMEOUT, WRONG_CUBE)
            successes += status == SUCCESS
    print(f"sim demo summary: {successes} of {episodes} episodes succeeded", flush=True)
    return 0 if ended == episodes else 1


def _episode(bench: BenchNode, task: str, seed: int, timeout_s: float) -> str:
    """One episode of ``task``, printed as it runs; the sim's verdict."""
    bench.set_policy_parameters({"task": task})
    rec = bench.start_recording("")
    index = bench.start_episode("", task, seed)
    start_s = bench.now("")
    print(f"episode {index}: {task!r} (layout seed {seed})", flush=True)
    if not bench.transition(ACTIVATE):
        raise RuntimeError("the policy node did not activate")

    deadline = time.monotonic() + episode_wall_limit(timeout_s)
    while not wait_for(lambda: bench.episode_ended("", index), 1.0) and time.monotonic() < deadline:
        with bench.lock:
            phase = rec.sim_subtasks[-1][1] if rec.sim_subtasks else ""
            said = rec.narrations[-1][1] if rec.narrations else ""
            subtask = rec.policy_subtasks[-1][1] if rec.policy_subtasks else ""
            chunks = len(rec.chunks)
        print(
            f"  t={bench.now('') - start_s:4.1f} sim s  sim: {phase!r}  node says: {said!r}"
            f"{f'  subtask: {subtask!r}' if subtask else ''}  chunks: {chunks}",
            flush=True,
        )
    bench.transition(DEACTIVATE)
    bench.stop_recording()
    report = bench.report("")
    status = report.get("status", "lost") if report.get("episode") == index else "lost"
    print(f"  -> {status} after {report.get('elapsed_s', float('nan')):.1f} sim s", flush=True)
    with bench.lock:
        same, decoded = subtasks_matching(rec.policy_subtasks, rec.sim_subtasks)
        said = rec.narrations[-1][1] if rec.narrations else ""
    if said:
        print(f"  node said last: {said!r}", flush=True)
    if decoded:
        print(f"  subtasks decoded: {decoded}, the sim's own words: {same}", flush=True)
    return status


def subtasks_matching(
    decoded: list[tuple[float, str]], sim: list[tuple[float, str]]
) -> tuple[int, int]:
    """(how many of the node's subtasks equal the sim's subtask in force when they arrived, how
    many non-empty ones there were); both lists are (arrival time, text) in arrival order."""
    same = total = 0
    for at, text in decoded:
        if not text.strip():
            continue
        total += 1
        in_force = [words for t, words in sim if t <= at]
        same += bool(in_force) and " ".join(text.split()) == in_force[-1]
    return same, total
