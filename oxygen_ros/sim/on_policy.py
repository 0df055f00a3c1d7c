"""Episodes driven by a policy and labelled by the scripted expert (DAgger, Ross et al. 2011).

Expert demonstrations show only the states the expert visits; a policy trained on them drifts
into states it has never seen (a tip a centimetre beside the cube, a cube held lower than the
expert holds it) and compounds its errors there. Here the policy drives the episode as
``oxygen-bench sim-policy`` drives it, one chunk per frame, while the expert plans from the same
privileged state every frame as if it were in control: its plan is the frame's action label, so
the dataset shows the way back from where the policy really goes. The expert is corrective
(:class:`~.expert.ScriptedExpert`): near its spot it re-centres at the height it finds the tip,
where its own demonstrations climb back to the hover height first. Labels that send a policy
lowering a cube 1.5 cm beside the pad's centre back up 6 cm teach it to hover, not to place.
Frames are the same features as the expert's demonstrations (:class:`~.recording.FrameRecorder`),
so such a dataset joins them in ``oxygen-train --dataset``; failed episodes are kept too (their
labels are the corrections).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .episode import RUNNING, Simulation
from .expert import ScriptedExpert
from .headless import steps_per_plan
from .recording import (
    CAMERA_PX,
    FPS,
    EpisodeSpec,
    FrameRecorder,
    RecordedEpisode,
    episode_task,
    expert_label,
)


class ChunkDriver(Protocol):
    """What drives the arm: one decision per frame, sent to the sim's controllers."""

    def start(self, sim: Simulation, noise_seed: int) -> None:
        """A new episode on ``sim``'s current layout."""

    def act(self, sim: Simulation, images: dict[str, np.ndarray], state: np.ndarray) -> None:
        """Decide from this frame (images by camera name, the joint state) and send it."""

    def close(self) -> None:
        """Let go of what the episode held."""


def record_on_policy_episode(
    sim: Simulation,
    spec: EpisodeSpec,
    driver: ChunkDriver,
    fps: int = FPS,
    camera_px: int = CAMERA_PX,
) -> RecordedEpisode:
    """One episode of ``spec``'s task driven by ``driver``, each frame labelled with the plan a
    corrective expert makes from that frame's state (whatever the episode's outcome)."""
    task = episode_task(spec)
    sim.reset(task, spec.seed, spec.timeout_s)
    driver.start(sim, spec.seed)
    expert = ScriptedExpert(corrective=True)
    recorder = FrameRecorder(camera_px)
    steps_per_frame = steps_per_plan(sim, fps)
    step = 0
    try:
        while sim.status == RUNNING:
            if step % steps_per_frame == 0:
                planned = expert.plan(sim.privileged_state())
                if planned is None:
                    raise RuntimeError(f"episode {spec}: the expert planned nothing while running")
                images = recorder.add(sim, expert_label(planned, sim.now_s, fps))
                driver.act(sim, images, recorder.frames["observation.state"][-1])
            sim.control_step()
            step += 1
    finally:
        driver.close()
    return RecordedEpisode(spec, task.text, sim.status, recorder.frames)
