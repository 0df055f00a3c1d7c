"""A LeRobotDataset v3 folder (as ``oxygen_ros.data`` writes it) read for training.

What training needs of each frame: its camera images, state, commanded action, task, the current
subtask and the narration that describes it, and where its episode ends (action chunks never
cross an episode). The dataset's ``narration`` column holds a sentence only on the frame it was
said (the sim says it when the phase changes, and again every few seconds); training supervises,
on every frame, the latest sentence said so far in its episode (``held``), which is what
describes the frame's phase, or only the frames where one was said (``event``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from oxygen_ros.data.lerobot_dataset import read_dataset

from .encoded_images import EncodedImages

IMAGE_PREFIX = "observation.images."
STATE_KEY = "observation.state"
ACTION_KEY = "action"
SUBTASK_KEY = "subtask"
NARRATION_KEY = "narration"
NARRATION_MODES = ("held", "event")


class TrainingDataError(ValueError):
    """A dataset training cannot use; the message names the folder and the feature."""


@dataclasses.dataclass
class TrainingFrames:
    """Every frame of a dataset, in dataset order.

    images: per camera key (``observation.images.<name>``, info.json order) its N frames, decoded
        to uint8 [len, H, W, 3] when indexed (`EncodedImages`).
    states, actions: float32 [N, state dim], [N, action dim].
    episode_end: int64 [N], the index one past the last frame of each frame's episode.
    tasks, subtasks, narrations: one string per frame ("" where there is none).
    """

    root: Path
    fps: int
    images: dict[str, EncodedImages]
    states: np.ndarray
    actions: np.ndarray
    episode_end: np.ndarray
    tasks: list[str]
    subtasks: list[str]
    narrations: list[str]
    state_names: list[str] | None = None
    action_names: list[str] | None = None

    def __len__(self) -> int:
        return len(self.states)

    @property
    def cameras(self) -> tuple[str, ...]:
        return tuple(self.images)

    @property
    def num_episodes(self) -> int:
        return len(np.unique(self.episode_end))

    def texts(self) -> list[str]:
        """Every distinct task, subtask and narration (e.g. to extend a tokenizer's corpus)."""
        return sorted({t for t in (*self.tasks, *self.subtasks, *self.narrations) if t})


def held_narrations(narrations: list[str], episode_end: np.ndarray) -> list[str]:
    """Each frame's latest sentence said at or before it in its episode ("" before the first)."""
    held, current, end = [], "", -1
    for index, sentence in enumerate(narrations):
        if episode_end[index] != end:  # a new episode starts
            current, end = "", episode_end[index]
        current = sentence or current
        held.append(current)
    return held


def _camera_images(feature: dict, column: list, key: str, root: Path) -> EncodedImages:
    if feature["dtype"] == "video":
        raise TrainingDataError(f"{root}: {key!r} is a video feature; training reads images")
    shape = tuple(feature.get("shape") or ())
    if feature["dtype"] != "image" or len(shape) != 3 or shape[-1] != 3:
        raise TrainingDataError(f"{root}: {key!r} is not an (H, W, 3) image feature")
    images = EncodedImages([cell["bytes"] for cell in column], shape)
    try:
        images[:1]  # one frame decoded now: a wrong shape is named here, not mid-training
    except (ValueError, OSError) as exc:
        raise TrainingDataError(f"{root}: {key!r}: {exc}") from None
    return images


def _vector(frames: dict, key: str, root: Path) -> np.ndarray:
    if key not in frames:
        raise TrainingDataError(
            f"{root}: no {key!r} feature (training needs {STATE_KEY!r} and {ACTION_KEY!r}); "
            f"features: {sorted(frames)}"
        )
    values = np.array(frames[key], dtype=np.float32)  # a writable copy
    if values.ndim != 2:
        raise TrainingDataError(f"{root}: {key!r} must be a vector per frame, got {values.shape}")
    if not np.isfinite(values).all():
        rows = np.flatnonzero(~np.isfinite(values).all(axis=1))
        raise TrainingDataError(f"{root}: {key!r} holds non-finite values (rows {rows[:5]})")
    return values


def _strings(frames: dict, key: str, count: int) -> list[str]:
    values = frames.get(key)
    if values is None:
        return [""] * count
    return [v or "" for v in values]


def load_training_frames(root: Path | str, narration: str = "held") -> TrainingFrames:
    """Read a LeRobotDataset v3 folder for training.

    Raises:
        TrainingDataError: no camera, state or action feature, a non-finite value, or an unknown
            narration mode.
    """
    if narration not in NARRATION_MODES:
        raise TrainingDataError(f"narration must be one of {NARRATION_MODES}, got {narration!r}")
    root = Path(root)
    content = read_dataset(root, decode_images=False)
    frames = content.frames
    features = content.info["features"]
    cameras = [k for k, ft in features.items() if k.startswith(IMAGE_PREFIX)]
    if not cameras:
        raise TrainingDataError(
            f"{root}: no camera feature ({IMAGE_PREFIX}<name>); features: {sorted(features)}"
        )
    images = {key: _camera_images(features[key], frames[key], key, root) for key in cameras}
    states = _vector(frames, STATE_KEY, root)
    actions = _vector(frames, ACTION_KEY, root)
    count = len(states)
    episode_index = np.asarray(frames["episode_index"], dtype=np.int64)
    ends = {row["episode_index"]: row["dataset_to_index"] for row in content.episodes}
    episode_end = np.array([ends[int(e)] for e in episode_index], dtype=np.int64)
    task_index = np.asarray(frames["task_index"], dtype=np.int64)
    narrations = _strings(frames, NARRATION_KEY, count)
    if narration == "held":
        narrations = held_narrations(narrations, episode_end)
    return TrainingFrames(
        root=root,
        fps=content.fps,
        images=images,
        states=states,
        actions=actions,
        episode_end=episode_end,
        tasks=[content.tasks[int(i)] for i in task_index],
        subtasks=_strings(frames, SUBTASK_KEY, count),
        narrations=narrations,
        state_names=features[STATE_KEY].get("names"),
        action_names=features[ACTION_KEY].get("names"),
    )


def episodes_with_task(frames: TrainingFrames, pattern: str) -> TrainingFrames:
    """Only the episodes whose task matches ``pattern`` (a regular expression, searched), e.g.
    the place episodes of an on-policy set that holds touch ones too.

    Raises:
        TrainingDataError: a pattern that is not a regular expression, or matches no episode.
    """
    try:
        matcher = re.compile(pattern)
    except re.error as exc:
        raise TrainingDataError(
            f"task pattern {pattern!r} is not a regular expression: {exc}"
        ) from None
    keep = np.array([matcher.search(task) is not None for task in frames.tasks], dtype=bool)
    if not keep.any():
        raise TrainingDataError(
            f"{frames.root}: no episode's task matches {pattern!r}; tasks: "
            f"{sorted(set(frames.tasks))}"
        )
    if keep.all():
        return frames
    # Whole episodes are kept, so a kept frame's episode ends where the kept frames before its
    # old end stop.
    kept_before = np.concatenate([[0], np.cumsum(keep)])
    indices = np.flatnonzero(keep)
    return dataclasses.replace(
        frames,
        images={key: images.take(indices) for key, images in frames.images.items()},
        states=frames.states[indices],
        actions=frames.actions[indices],
        episode_end=kept_before[frames.episode_end[indices]],
        tasks=[frames.tasks[i] for i in indices],
        subtasks=[frames.subtasks[i] for i in indices],
        narrations=[frames.narrations[i] for i in indices],
    )


def concatenate_frames(parts: Sequence[TrainingFrames]) -> TrainingFrames:
    """Several datasets' frames as one (episodes kept apart), for training on all of them.

    Raises:
        TrainingDataError: datasets whose fps, cameras, image sizes or state/action names differ.
    """
    if not parts:
        raise TrainingDataError("no dataset to train on")
    first = parts[0]
    for other in parts[1:]:
        for what, mine, theirs in (
            ("fps", first.fps, other.fps),
            ("cameras", first.cameras, other.cameras),
            ("state names", first.state_names, other.state_names),
            ("action names", first.action_names, other.action_names),
            (
                "image sizes",
                [first.images[k].shape[1:] for k in first.cameras],
                [other.images[k].shape[1:] for k in other.cameras],
            ),
        ):
            if mine != theirs:
                raise TrainingDataError(
                    f"{other.root} and {first.root} differ in {what}: {theirs} vs {mine}"
                )
    if len(parts) == 1:
        return first
    offsets = np.cumsum([0] + [len(part) for part in parts[:-1]])
    return TrainingFrames(
        root=first.root,
        fps=first.fps,
        images={
            k: EncodedImages.concatenate([part.images[k] for part in parts]) for k in first.cameras
        },
        states=np.concatenate([part.states for part in parts]),
        actions=np.concatenate([part.actions for part in parts]),
        episode_end=np.concatenate(
            [part.episode_end + offset for part, offset in zip(parts, offsets, strict=True)]
        ),
        tasks=[t for part in parts for t in part.tasks],
        subtasks=[t for part in parts for t in part.subtasks],
        narrations=[t for part in parts for t in part.narrations],
        state_names=first.state_names,
        action_names=first.action_names,
    )


def dataset_texts(root: Path | str) -> list[str]:
    """Every distinct task, subtask and narration of a dataset, read without decoding images."""
    content = read_dataset(root, decode_images=False)
    texts = set(content.tasks)
    for key in (SUBTASK_KEY, NARRATION_KEY):
        texts.update(t for t in content.frames.get(key) or () if t)
    return sorted(texts)


def action_chunk(actions: np.ndarray, start: int, end: int, horizon: int) -> np.ndarray:
    """``horizon`` rows of ``actions`` from ``start``, never past ``end`` (exclusive): the last
    row of the episode is repeated."""
    rows = np.minimum(np.arange(start, start + horizon), end - 1)
    return actions[rows]


def frame_chunk(
    frames: TrainingFrames, index: int, horizon: int, relative: np.ndarray | None = None
) -> np.ndarray:
    """The raw action chunk the model learns at frame ``index``; the dims where ``relative`` is
    True are taken relative to the frame's state (LeRobot's relative actions: the state at the
    chunk's start is subtracted, and added back at inference)."""
    chunk = action_chunk(frames.actions, index, int(frames.episode_end[index]), horizon)
    if relative is None or not relative.any():
        return chunk
    chunk = chunk.astype(np.float32, copy=True)
    chunk[:, relative] -= frames.states[index, : len(relative)][relative]
    return chunk
