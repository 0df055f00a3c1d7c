"""Expert episodes without ROS: the expert's trajectories go straight into the controllers.

The same :class:`~.episode.Simulation` and :class:`~.expert.ScriptedExpert` as the ROS nodes,
with no transport in between (a trajectory arrives at the control step it was planned), no
cameras and no pacing: for measuring the expert's success rate over many episodes quickly.
:func:`drive_expert` is the one loop that runs an episode under the expert; recording
demonstrations (:mod:`.recording`) and rendering grounding scenes (:mod:`.grounding`) look at the
sim from inside it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

from .episode import ARM_CONTROLLER, GRIPPER_CONTROLLER, RUNNING, SUCCESS, Simulation
from .expert import ArmPerturbation, ScriptedExpert
from .tasks import Task


@dataclass(frozen=True)
class EpisodeResult:
    task: str
    seed: int
    status: str
    sim_s: float  # simulated seconds the episode took
    wall_s: float


def run_expert_episode(
    sim: Simulation,
    task: Task | None,
    seed: int,
    expert_rate_hz: float = 10.0,
    perturbation_rad: float = 0.0,
) -> EpisodeResult:
    """One episode of ``task`` (random from ``seed`` when None) driven by a fresh expert, its arm
    trajectories perturbed as :class:`~.expert.ExpertNode` does with ``perturbation_rad``."""
    started = time.perf_counter()
    task = sim.reset(task, seed)
    for _ in drive_expert(sim, expert_rate_hz, perturbation_rad):
        pass
    return EpisodeResult(task.text, seed, sim.status, sim.elapsed_s, time.perf_counter() - started)


def steps_per_plan(sim: Simulation, expert_rate_hz: float) -> int:
    """Control steps between two of the expert's plans."""
    return max(1, round(1.0 / (expert_rate_hz * sim.control_dt)))


def drive_expert(
    sim: Simulation,
    expert_rate_hz: float = 10.0,
    perturbation_rad: float = 0.0,
    settle_s: float = 0.0,
    expert_task: Task | None = None,
    perturbation_seed: int | None = None,
) -> Iterator[tuple[int, tuple | None]]:
    """Run the episode ``sim`` was just reset to under a fresh expert until it ends, then, if it
    succeeded, ``settle_s`` more sim seconds with the expert still heading for its last target.

    Yields ``(step, plan)`` before each control step: ``step`` control steps have run, and
    ``plan`` is the expert's clean (arm, gripper) plan sent at this step (the arm's with the DART
    drift of ``perturbation_rad`` applied), or None between plans. Stop iterating to leave the
    episode where it is. ``expert_task``: the task the expert carries out instead of the
    episode's (an off-course reach, as a policy heading for the wrong cube makes); the episode
    is still scored on its own task. ``perturbation_seed``: the drift's seed (None: the episode's
    index, as the expert node seeds it)."""
    if not (math.isfinite(settle_s) and settle_s >= 0):
        raise ValueError(f"settle_s must be >= 0 s, got {settle_s}")
    expert = ScriptedExpert()
    perturbation = ArmPerturbation(perturbation_rad)
    perturbation.reset(sim.episode if perturbation_seed is None else perturbation_seed)
    between = steps_per_plan(sim, expert_rate_hz)

    def settling() -> bool:  # succeeded less than settle_s ago (half a step of float slack)
        since_s = sim.now_s - sim.episode_end_s
        return sim.status == SUCCESS and since_s < settle_s - sim.control_dt / 2

    step = 0
    while sim.status == RUNNING or settling():
        planned = None
        if step % between == 0:
            # the scene is scored already; the expert plans on as if the episode still ran
            state = dataclasses.replace(sim.privileged_state(), status=RUNNING)
            if expert_task is not None:
                state = dataclasses.replace(state, task=expert_task)
            planned = expert.plan(state)
            if planned is not None:
                perturbation.advance(between * sim.control_dt)
                sim.receive(ARM_CONTROLLER, perturbation.apply(planned[0]))
                sim.receive(GRIPPER_CONTROLLER, planned[1])
        yield step, planned
        sim.control_step()
        step += 1
