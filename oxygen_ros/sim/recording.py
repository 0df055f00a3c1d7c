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
from collections.abc import Callable, Iterable, Sequence
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


def joint_state(sim: Simulation) -> np.ndarray:
    """The frame's ``observation.state``: the arm's joint positions, then the gripper's opening."""
    return np.append(sim.world.arm_positions(), sim.world.gripper_opening()).astype(np.float32)


class FrameRecorder:
    """One episode's frames as the dataset stores them, added one frame at a time: both cameras,
    the joint state, the action label, the phase's subtask and the narration as the sim node says
    it (on a change of sentence and every ``narration_period_s``)."""

    def __init__(
        self, camera_px: int = CAMERA_PX, narration_period_s: float = NARRATION_PERIOD_S
    ) -> None:
        self.camera_px = camera_px
        self.narration_period_s = narration_period_s
        self.frames: dict[str, list] = {key: [] for key in dataset_features(camera_px)}
        self._said, self._said_at = "", -np.inf
        self._phase = None

    def render(self, sim: Simulation) -> dict[str, np.ndarray]:
        """Both cameras' present images, by camera name."""
        px = self.camera_px
        return {camera: sim.world.render(camera, px, px) for camera in CAMERAS.values()}

    def add(self, sim: Simulation, action: np.ndarray) -> dict[str, np.ndarray]:
        """Record the sim's present frame with ``action`` as its label; returns the rendered
        images (by camera name) for whoever acts on this frame. After the episode has ended
        (settling frames) the labels stay those of the last running frame."""
        now = sim.now_s
        images = self.render(sim)
        for key, camera in CAMERAS.items():
            self.frames[key].append(images[camera])
        self.frames["observation.state"].append(joint_state(sim))
        self.frames["action"].append(np.asarray(action, dtype=np.float32))
        if sim.status == RUNNING or self._phase is None:
            self._phase = sim.phase
        self.frames["subtask"].append(self._phase.subtask)
        narrate = (
            self._phase.narration != self._said
            or now - self._said_at >= self.narration_period_s - 1e-9
        )
        self.frames["narration"].append(self._phase.narration if narrate else "")
        if narrate:
            self._said, self._said_at = self._phase.narration, now
        return images


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
    recorder = FrameRecorder(camera_px, narration_period_s)
    for step, planned in drive_expert(sim, fps, spec.perturbation_rad, spec.settle_s):
        if step % steps_per_frame:
            continue
        if planned is None:
            raise RuntimeError(f"episode {spec}: the expert planned nothing while running")
        # the plan only reached the controllers: the world is still as the frame sees it
        recorder.add(sim, expert_label(planned, sim.now_s, fps))
    return RecordedEpisode(spec, task.text, sim.status, recorder.frames)


def episode_task(spec: EpisodeSpec) -> Task:
    """The task of ``spec``'s kind drawn from its seed, as ``oxygen-collect --kind`` draws it
    (a stream apart from the layout's stream of the same seed)."""
    return random_task(np.random.default_rng([spec.seed, 7]), spec.kind)


def expert_label(planned: tuple, now_s: float, fps: int = FPS) -> np.ndarray:
    """The action label of the expert's (arm, gripper) plan made at ``now_s``: where it asks the
    joints to be one frame period later."""
    return _reference(*planned, now_s, now_s + 1.0 / fps)


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
    episodes: int = 0  # written
    frames: int = 0  # written
    failed: list[EpisodeSpec] = dataclasses.field(default_factory=list)  # did not succeed
    unrecorded: int = 0  # succeeded with no frame recorded (a takeover after the policy finished)


def write_demonstrations(
    out: Path | str,
    specs: Iterable[EpisodeSpec],
    sim: Simulation | None = None,
    progress: Callable[[RecordingReport], None] | None = None,
    record: Callable[[Simulation, EpisodeSpec], RecordedEpisode] = record_episode,
    keep_failures: bool = False,
) -> RecordingReport:
    """Record every spec with ``record`` (default: the expert drives) and write the successful
    episodes, or with ``keep_failures`` every episode, as a new LeRobotDataset at ``out``.

    Raises:
        ValueError: no episode to write.
    """
    own_sim = sim is None
    sim = sim or Simulation()
    writer = LeRobotDatasetWriter(out, FPS, dataset_features(), ROBOT_TYPE)
    report = RecordingReport()
    try:
        for spec in specs:
            episode = record(sim, spec)
            if episode.status != SUCCESS:
                report.failed.append(spec)
            elif not len(episode):
                report.unrecorded += 1
            if (episode.status == SUCCESS or keep_failures) and len(episode):
                frames = {key: _stacked(values) for key, values in episode.frames.items()}
                writer.add_episode(frames, [episode.task] * len(episode))
                report.episodes += 1
                report.frames += len(episode)
            if progress is not None:
                progress(report)
    finally:
        if own_sim:
            sim.world.close()
    if report.episodes == 0:
        raise ValueError(
            f"no episode to write into {out}: {len(report.failed)} failed, "
            f"{report.unrecorded} succeeded with no frame recorded"
        )
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
