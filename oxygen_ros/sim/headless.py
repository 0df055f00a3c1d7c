"""Expert episodes without ROS: the expert's trajectories go straight into the controllers.

The same :class:`~.episode.Simulation` and :class:`~.expert.ScriptedExpert` as the ROS nodes,
with no transport in between (a trajectory arrives at the control step it was planned), no
cameras and no pacing: for measuring the expert's success rate over many episodes quickly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .episode import ARM_CONTROLLER, GRIPPER_CONTROLLER, RUNNING, Simulation
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
    expert = ScriptedExpert()
    perturbation = ArmPerturbation(perturbation_rad)
    task = sim.reset(task, seed)
    perturbation.reset(sim.episode)
    steps_per_plan = max(1, round(1.0 / (expert_rate_hz * sim.control_dt)))
    step = 0
    while sim.status == RUNNING:
        if step % steps_per_plan == 0:
            planned = expert.plan(sim.privileged_state())
            if planned is not None:
                perturbation.advance(steps_per_plan * sim.control_dt)
                sim.receive(ARM_CONTROLLER, perturbation.apply(planned[0]))
                sim.receive(GRIPPER_CONTROLLER, planned[1])
        sim.control_step()
        step += 1
    return EpisodeResult(task.text, seed, sim.status, sim.elapsed_s, time.perf_counter() - started)
