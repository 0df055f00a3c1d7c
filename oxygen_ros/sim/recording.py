"""Expert demonstrations written straight into a LeRobotDataset, without ROS.

The bag path (``oxygen-collect`` -> rosbag2 -> ``oxygen-bag-to-lerobot``) records what the ROS
graph carried; this path records the same features from the same :class:`~.episode.Simulation`
and :class:`~.expert.ScriptedExpert` in one process, fast enough for thousands of episodes. Per
frame (every ``1 / fps`` of sim time, at the instant the expert plans):

* ``observation.images.scene`` / ``.wrist``: both cameras rendered before the plan is sent;
* ``observation.state``: the five arm joints and the gripper opening at that instant;
* ``action``: the expert's *clean* arm plan (before any DART perturbation) and its gripper plan,
  both made at the frame, sampled one frame period later as the converter samples the command in
  force at a frame (:class:`~oxygen_ros.data.message_values.TrajectoryReference`): where the
  command asks the joints to be by the next frame, what the node's first chunk point means;
* ``task``, ``subtask`` (the phase's, latest), ``narration``: said when the phase's sentence
  changes and again every ``narration_period_s`` while the episode runs, as the sim node says it
  (each sentence on the frame at which it was said: LeRobot's event semantics).

An episode is written only if the expert succeeded (a failed demonstration would teach failure).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from oxygen_ros.data.lerobot_dataset import (
    LeRobotDatasetWriter,
    image_feature,
    string_feature,
    vector_feature,
)
from oxygen_ros.data.message_values import TrajectoryReference

from .episode import RUNNING, SUCCESS, Simulation
from .headless import drive_expert, steps_per_plan
from .scene import ARM_JOINTS, GRIPPER_JOINT
from .tasks import Task, random_task

FPS = 10
CAMERA_PX = 128  # the sim node's default image size
CAMERAS = {"observation.images.scene": "scene", "observation.images.wrist": "wrist"}
JOINT_NAMES = (*ARM_JOINTS, GRIPPER_JOINT)
NARRATION_PERIOD_S = 2.0  # the sim node's default narration_period_s
ROBOT_TYPE = "so101_sim"


@dataclasses.dataclass(frozen=True)
class EpisodeSpec:
    """One demonstration to record: a task kind ('touch' / 'place' / 'two_step'), a layout
    seed, the standard deviation of the DART drift on the executed arm plan (0: the clean
    expert), how long the recording goes on past a success (``settle_s``: the expert keeps
    heading for its goal, the frames keep the labels the scene had just before it counted as a
    success) and the episode's timeout (None: the sim's)."""

    kind: str
    seed: int
    perturbation_rad: float = 0.0
    settle_s: float = 0.0
    timeout_s: float | None = None


@dataclasses.dataclass
class RecordedEpisode:
    spec: EpisodeSpec
    task: str
    status: str
    frames: dict[str, list]  # feature key -> one value per frame

    def __len__(self) -> int:
        return len(self.frames["action"])


def dataset_features(camera_px: int = CAMERA_PX) -> dict[str, dict]:
    """The info.json features, in the column order of ``config/sim_dataset.yaml``."""
    return {
        **{key: image_feature(camera_px, camera_px) for key in CAMERAS},
        "observation.state": vector_feature(JOINT_NAMES),
        "action": vector_feature(JOINT_NAMES),
        "subtask": string_feature(),
        "narration": string_feature(),
    }


def _seconds_to_ns(seconds: float) -> int:
    return int(round(seconds * 1e9))


def record_episode(
    sim: Simulation,
    spec: EpisodeSpec,
    fps: int = FPS,
    camera_px: int = CAMERA_PX,
    narration_period_s: float = NARRATION_PERIOD_S,
) -> RecordedEpisode:
    """Run one expert episode of ``spec`` and return its frames (whatever its outcome)."""
    task = episode_task(spec)
    sim.reset(task, spec.seed, spec.timeout_s)
    steps_per_frame = steps_per_plan(sim, fps)
    frames: dict[str, list] = {key: [] for key in dataset_features(camera_px)}
    said, said_at = "", -np.inf
    phase = sim.phase
    for step, planned in drive_expert(sim, fps, spec.perturbation_rad, spec.settle_s):
        if step % steps_per_frame:
            continue
        if planned is None:
            raise RuntimeError(f"episode {spec}: the expert planned nothing while running")
        # the plan only reached the controllers: the world is still as the frame sees it
        now = sim.now_s
        for key, camera in CAMERAS.items():
            frames[key].append(sim.world.render(camera, camera_px, camera_px))
        state = np.append(sim.world.arm_positions(), sim.world.gripper_opening())
        frames["observation.state"].append(state.astype(np.float32))
        frames["action"].append(_reference(*planned, now, now + 1.0 / fps))
        if sim.status == RUNNING:  # settling frames keep the labels of the last running one
            phase = sim.phase
        frames["subtask"].append(phase.subtask)
        narrate = phase.narration != said or now - said_at >= narration_period_s - 1e-9
        frames["narration"].append(phase.narration if narrate else "")
        if narrate:
            said, said_at = phase.narration, now
    return RecordedEpisode(spec, task.text, sim.status, frames)


def episode_task(spec: EpisodeSpec) -> Task:
    """The task of ``spec``'s kind drawn from its seed, as ``oxygen-collect --kind`` draws it
    (a stream apart from the layout's stream of the same seed)."""
    return random_task(np.random.default_rng([spec.seed, 7]), spec.kind)


def _reference(arm_plan, gripper_plan, start_s: float, at_s: float) -> np.ndarray:
    """Both plans (started at ``start_s``, unless stamped) sampled at ``at_s``, in
    :data:`JOINT_NAMES` order."""
    start_ns, at_ns = _seconds_to_ns(start_s), _seconds_to_ns(at_s)
    values: dict[str, float] = {}
    for topic, plan in (("arm", arm_plan), ("gripper", gripper_plan)):
        reference = TrajectoryReference.from_message(plan, start_ns, topic)
        values.update(zip(reference.joint_names, reference.sample(at_ns), strict=True))
    return np.array([values[name] for name in JOINT_NAMES], dtype=np.float32)


@dataclasses.dataclass
class RecordingReport:
    episodes: int = 0
    frames: int = 0
    failed: list[EpisodeSpec] = dataclasses.field(default_factory=list)


def write_demonstrations(
    out: Path | str,
    specs: Iterable[EpisodeSpec],
    sim: Simulation | None = None,
    progress=None,
) -> RecordingReport:
    """Record every spec and write the successful episodes as a new LeRobotDataset at ``out``.

    Raises:
        ValueError: no episode succeeded (nothing to write).
    """
    own_sim = sim is None
    sim = sim or Simulation()
    writer = LeRobotDatasetWriter(out, FPS, dataset_features(), ROBOT_TYPE)
    report = RecordingReport()
    try:
        for spec in specs:
            episode = record_episode(sim, spec)
            if episode.status == SUCCESS:
                frames = {key: _stacked(values) for key, values in episode.frames.items()}
                writer.add_episode(frames, [episode.task] * len(episode))
                report.episodes += 1
                report.frames += len(episode)
            else:
                report.failed.append(spec)
            if progress is not None:
                progress(report)
    finally:
        if own_sim:
            sim.world.close()
    if report.episodes == 0:
        raise ValueError(f"no successful episode to write into {out}")
    writer.finish()
    return report


def _stacked(values: Sequence) -> np.ndarray | list[str]:
    return list(values) if isinstance(values[0], str) else np.stack(values)


def demonstration_specs(
    kind: str,
    seed0: int,
    count: int,
    perturbed_share: float,
    perturbation_rad: float,
    settle_s: float = 0.0,
    timeout_s: float | None = None,
) -> list[EpisodeSpec]:
    """``count`` episodes of ``kind`` on seeds ``seed0 ...``; every 1/``perturbed_share``-th one
    (evenly spread) with DART drift ``perturbation_rad``; each recorded ``settle_s`` past its
    success, timing out after ``timeout_s`` (None: the sim's timeout)."""
    if not 0.0 <= perturbed_share <= 1.0:
        raise ValueError(f"perturbed_share must be in [0, 1], got {perturbed_share}")
    perturbed = np.floor((np.arange(count) + 1) * perturbed_share) > np.floor(
        np.arange(count) * perturbed_share
    )
    return [
        EpisodeSpec(kind, seed0 + i, perturbation_rad if perturbed[i] else 0.0, settle_s, timeout_s)
        for i in range(count)
    ]
