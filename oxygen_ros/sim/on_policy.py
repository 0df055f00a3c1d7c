"""Episodes a policy drives, labelled by the scripted expert (DAgger, Ross et al. 2011).

Expert demonstrations show only the states the expert visits; a policy trained on them drifts
into states it has never seen (a tip a centimetre beside the cube, a cube held lower than the
expert holds it) and compounds its errors there. Here the policy drives the episode as
``oxygen-bench sim-policy`` drives it, one chunk per frame, and a corrective expert
(:class:`~.expert.ScriptedExpert`: near its spot it re-centres at the height it finds the tip and
goes down from a cone above it) follows the episode from the same privileged state. Two ways to
label (``labels``):

* ``takeover`` (the default): the policy drives, unrecorded, until a time drawn per episode
  (:func:`takeover_time`), then the expert drives from wherever the policy left the arm to the
  end, recorded: a demonstration that starts in the policy's states. Its frames' labels are one
  trajectory, so the action chunks a trainer cuts from them are the expert's own.
* ``per_frame``: the policy drives throughout and every frame is labelled with the expert's plan
  from there (classic DAgger). With chunked actions this teaches hesitation: a chunk cut from
  those labels strings together one-step corrections from the policy's own, slower states (here
  it moved 0.73 rad over 0.9 s against 1.06 in demonstrations), and three stages trained on such
  data placed 1-7 of 60 against the shipped weights' 18.

Frames are the same features as the expert's demonstrations (:class:`~.recording.FrameRecorder`),
so such a dataset joins them in ``oxygen-train --dataset``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .episode import ARM_CONTROLLER, GRIPPER_CONTROLLER, RUNNING, Simulation
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
    joint_state,
)


class ChunkDriver(Protocol):
    """What drives the arm: one decision per frame, sent to the sim's controllers."""

    def start(self, sim: Simulation, noise_seed: int) -> None:
        """A new episode on ``sim``'s current layout."""

    def act(self, sim: Simulation, images: dict[str, np.ndarray], state: np.ndarray) -> None:
        """Decide from this frame (images by camera name, the joint state) and send it."""

    def close(self) -> None:
        """Let go of what the episode held."""


TAKEOVER_WITHIN_S = {"touch": 3.0, "place": 12.0, "two_step": 20.0}  # the policy's share of it
LABELS = ("takeover", "per_frame")


def takeover_time(spec: EpisodeSpec) -> float:
    """When the expert takes over ``spec``'s episode (sim seconds into it): drawn uniformly below
    :data:`TAKEOVER_WITHIN_S` of its kind, from its seed (the same every time)."""
    rng = np.random.default_rng([spec.seed, 0x7A4E])
    return float(rng.uniform(0.0, TAKEOVER_WITHIN_S[spec.kind]))


def record_on_policy_episode(
    sim: Simulation,
    spec: EpisodeSpec,
    driver: ChunkDriver,
    labels: str = "takeover",
    fps: int = FPS,
    camera_px: int = CAMERA_PX,
) -> RecordedEpisode:
    """One episode of ``spec``'s task driven by ``driver`` and labelled by a corrective expert
    as ``labels`` says (see the module). A ``takeover`` episode that ended before the takeover
    has no frames."""
    if labels not in LABELS:
        raise ValueError(f"labels must be one of {LABELS}, got {labels!r}")
    task = episode_task(spec)
    sim.reset(task, spec.seed, spec.timeout_s)
    driver.start(sim, spec.seed)
    expert = ScriptedExpert(corrective=True)
    recorder = FrameRecorder(camera_px)
    takeover_s = takeover_time(spec) if labels == "takeover" else np.inf
    steps_per_frame = steps_per_plan(sim, fps)
    step = 0
    try:
        while sim.status == RUNNING:
            if step % steps_per_frame == 0:
                planned = expert.plan(sim.privileged_state())  # it follows every frame
                if planned is None:
                    raise RuntimeError(f"episode {spec}: the expert planned nothing while running")
                label = expert_label(planned, sim.now_s, fps)
                if sim.now_s - sim.episode_start_s >= takeover_s - 1e-9:
                    recorder.add(sim, label)
                    sim.receive(ARM_CONTROLLER, planned[0])
                    sim.receive(GRIPPER_CONTROLLER, planned[1])
                else:
                    record = labels == "per_frame"
                    images = recorder.add(sim, label) if record else recorder.render(sim)
                    driver.act(sim, images, joint_state(sim))
            sim.control_step()
            step += 1
    finally:
        driver.close()
    return RecordedEpisode(spec, task.text, sim.status, recorder.frames)
