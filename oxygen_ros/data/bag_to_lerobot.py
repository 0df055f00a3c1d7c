"""rosbag2 episodes -> LeRobotDataset v3, driven by a :class:`~.mapping.DatasetMapping`.

One bag is one recorded episode; it gives one dataset episode per contiguous run of kept frames
(normally exactly one, see :mod:`.alignment`). What each feature kind puts in a frame at frame
time ``t`` (all on the bag's timeline, :mod:`.bag_episode`):

* ``image``: the latest ``sensor_msgs/Image`` whose header stamp is ``<= t``, as (H, W, 3) uint8
  RGB (resized when the mapping says so); dropped frame when older than ``max_staleness_s``.
* ``joint_positions``: the latest ``JointState`` (header stamp ``<= t``), positions in the
  mapping's ``names`` order, float32.
* ``trajectory_reference``: per controller topic, the latest ``JointTrajectory`` that has
  *started* by ``t`` (start: its header stamp, or its receipt when the stamp is zero, as
  ros2_control reads it), sampled one frame period later, at ``t + 1/fps``, as
  :mod:`.message_values` says; each joint of ``names`` from the controller that commands it.
  So the action of a frame is where the command in force at the frame asks the joints to be by
  the next frame: the first action of a chunk means what ``oxygen_node`` publishes it as (point
  one ``action_dt`` after the observation's stamp), and a command that spans two frames gives two
  different labels, not one repeated. Starts, not receipts, pick the command: a plan made at the
  frame's instant (the sim's expert plans on the camera's ticks) arrives a few milliseconds after
  it, and choosing by receipt would label the frame with the previous plan, by jitter.
  Each controller topic is a stream of its own for the frame grid.
* ``task``: the latest ``String`` received ``<= t``, else the episode's first one (a latched
  task may arrive after the first frames); becomes ``task_index`` and ``meta/tasks.parquet``,
  not a column. A bag without any task message is an error.
* ``string``, ``mode: latest``: the latest ``String`` received ``<= t``, ``""`` before the first.
  ``mode: event``: the strings received since the previous kept frame, joined by a space, else
  ``""``: each sentence lands on exactly one frame, the first at or after it was said (LeRobot's
  ``language_events`` semantics). The shipped mapping uses ``event`` for narration and
  ``latest`` for the subtask.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from oxygen_ros.data.alignment import (
    NS_PER_S,
    TimedStream,
    align,
    contiguous_runs,
    events_per_frame,
)
from oxygen_ros.data.bag_episode import BagEpisode, BagError, read_bag_episode
from oxygen_ros.data.lerobot_dataset import (
    LeRobotDatasetWriter,
    image_feature,
    string_feature,
    vector_feature,
)
from oxygen_ros.data.mapping import DatasetMapping, FeatureSpec, MappingError
from oxygen_ros.data.message_values import (
    TrajectoryReference,
    image_to_rgb,
    joint_positions,
    sample_reference,
)

HEADER_TIME_KINDS = frozenset({"image", "joint_positions"})
"""Sensor kinds: placed at their header stamp, estimate the clock offset, end the frame grid."""


@dataclass
class EpisodeFrames:
    """The frames of one dataset episode."""

    frames: dict[str, Any]
    tasks: list[str]
    frame_ns: np.ndarray
    """Timeline time of each frame (int64 ns)."""


@dataclass
class BagConversion:
    """What one bag gave."""

    bag: Path
    episodes: list[EpisodeFrames]
    grid_frames: int
    drops: Counter = field(default_factory=Counter)


@dataclass
class ConversionReport:
    """What a conversion wrote and dropped, and how fast it ran."""

    bags: int = 0
    episodes: int = 0
    frames: int = 0
    grid_frames: int = 0
    drops: Counter = field(default_factory=Counter)
    seconds: float = 0.0
    dataset_bytes: int = 0
    failed_bags: dict[str, str] = field(default_factory=dict)

    @property
    def frames_per_second(self) -> float:
        """Frames written per second of conversion."""
        return self.frames / self.seconds if self.seconds > 0 else 0.0

    @property
    def bytes_per_episode(self) -> float:
        """Dataset folder size divided by episodes."""
        return self.dataset_bytes / self.episodes if self.episodes else 0.0


def _stream_name(spec: FeatureSpec, topic: str) -> str:
    return spec.key if spec.kind != "trajectory_reference" else f"{spec.key}[{topic}]"


def _sorted(times: np.ndarray) -> np.ndarray:
    return np.argsort(times, kind="stable")


class _BagStreams:
    """A bag's messages per mapped stream, sorted by timeline time."""

    def __init__(self, episode: BagEpisode, mapping: DatasetMapping) -> None:
        self.episode = episode
        self.order: dict[str, np.ndarray] = {}
        self.times: dict[str, np.ndarray] = {}
        self.streams: list[TimedStream] = []
        for spec in mapping.features:
            for topic in spec.topics:
                if spec.kind in HEADER_TIME_KINDS or spec.kind == "trajectory_reference":
                    times = episode.message_time_ns(topic)  # a trajectory's: its start
                else:
                    times = episode.receipt_time_ns(topic)
                order = _sorted(times)
                name = _stream_name(spec, topic)
                self.order[name], self.times[name] = order, times[order]
                staleness = None if spec.mode == "event" else spec.max_staleness_s
                self.streams.append(
                    TimedStream(
                        name,
                        times[order],
                        spec.required,
                        staleness,
                        bounds_end=spec.kind in HEADER_TIME_KINDS,
                    )
                )

    def message(self, spec: FeatureSpec, topic: str, held: int) -> object:
        """The message at sorted position ``held`` of ``spec``'s stream on ``topic``."""
        order = self.order[_stream_name(spec, topic)]
        return self.episode.topics[topic].messages[int(order[held])]


def _memo(fn: Callable[[int], Any]) -> Callable[[int], Any]:
    cache: dict[int, Any] = {}

    def get(i: int) -> Any:
        if i not in cache:
            cache[i] = fn(i)
        return cache[i]

    return get


def _feature_values(
    spec: FeatureSpec,
    bag: _BagStreams,
    held: dict[str, np.ndarray],
    frame_ns: np.ndarray,
    kept: np.ndarray,
    fps: int,
) -> list[Any]:
    """The value of ``spec`` at every kept frame."""
    frames = np.flatnonzero(kept)
    if spec.kind == "image":
        name = spec.key
        decode = _memo(
            lambda i: image_to_rgb(bag.message(spec, spec.topic, i), spec.topic, spec.resize)
        )
        return [decode(int(held[name][f])) for f in frames]
    if spec.kind == "joint_positions":
        read = _memo(
            lambda i: joint_positions(bag.message(spec, spec.topic, i), spec.names, spec.topic)
        )
        return [read(int(held[spec.key][f])) for f in frames]
    if spec.kind == "trajectory_reference":
        readers = []
        for topic in spec.topics:
            start = bag.times[_stream_name(spec, topic)]
            readers.append(
                _memo(
                    lambda i, topic=topic, start=start: TrajectoryReference.from_message(
                        bag.message(spec, topic, i), int(start[i]), topic
                    )
                )
            )
        next_frame_ns = round(NS_PER_S / fps)
        values = []
        for f in frames:
            refs = [
                None
                if held[_stream_name(spec, t)][f] < 0
                else read(int(held[_stream_name(spec, t)][f]))
                for t, read in zip(spec.topics, readers, strict=False)
            ]
            values.append(
                sample_reference(refs, spec.topics, spec.names, int(frame_ns[f]) + next_frame_ns)
            )
        return values
    if spec.kind in ("task", "string"):
        count = len(bag.times[spec.key])
        if spec.kind == "task" and count == 0:
            raise BagError(
                f"{bag.episode.path}: no message on {spec.topic} (the task, {spec.key!r})"
            )
        text = _memo(lambda i: str(bag.message(spec, spec.topic, i).data))
        if spec.mode == "event":
            events = events_per_frame(bag.times[spec.key], frame_ns[frames])
            return [" ".join(text(i) for i in window) for window in events]
        fallback = 0 if spec.kind == "task" else -1
        out = []
        for f in frames:
            i = int(held[spec.key][f])
            i = fallback if i < 0 else i
            out.append("" if i < 0 else text(i))
        return out
    raise MappingError(f"feature {spec.key!r}: unknown feature kind {spec.kind!r}")


def convert_bag(
    path: Path | str, mapping: DatasetMapping, min_run_frames: int = 1
) -> BagConversion:
    """The dataset episodes of the bag at ``path`` (frames per :mod:`.alignment`)."""
    if mapping.task_feature is None:
        raise MappingError("the mapping has no feature of kind task (LeRobot needs a task)")
    required = [t for f in mapping.features if f.required for t in f.topics]
    optional = [t for f in mapping.features if not f.required for t in f.topics]
    header_topics = [t for f in mapping.features if f.kind in HEADER_TIME_KINDS for t in f.topics]
    episode = read_bag_episode(path, required, optional, header_topics)
    bag = _BagStreams(episode, mapping)
    try:
        alignment = align(bag.streams, mapping.fps)
    except ValueError as error:
        raise BagError(f"{episode.path}: {error}") from error
    runs, short = contiguous_runs(alignment.keep, min_run_frames)
    drops = Counter(alignment.drops)
    if short:
        drops["short_run"] += short
    kept = np.zeros(alignment.frame_ns.size, dtype=bool)
    for run in runs:
        kept[run.start : run.stop] = True
    values = {
        spec.key: _feature_values(spec, bag, alignment.held, alignment.frame_ns, kept, mapping.fps)
        for spec in mapping.features
    }
    task_key = mapping.task_feature.key
    episodes = []
    offset = 0
    for run in runs:
        part = slice(offset, offset + len(run))
        offset += len(run)
        frames = {k: v[part] for k, v in values.items() if k != task_key}
        episodes.append(
            EpisodeFrames(frames, values[task_key][part], alignment.frame_ns[run.start : run.stop])
        )
    return BagConversion(Path(path), episodes, int(alignment.frame_ns.size), drops)


def dataset_features(mapping: DatasetMapping, first: EpisodeFrames) -> dict[str, dict[str, Any]]:
    """info.json features of the mapped keys (image sizes from ``first`` when not resized)."""
    features: dict[str, dict[str, Any]] = {}
    for spec in mapping.features:
        if spec.kind == "image":
            height, width = spec.resize or first.frames[spec.key][0].shape[:2]
            features[spec.key] = image_feature(height, width)
        elif spec.kind in ("joint_positions", "trajectory_reference"):
            features[spec.key] = vector_feature(spec.names)
        elif spec.kind == "string":
            features[spec.key] = string_feature()
    return features


def _folder_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def convert_bags(
    bags: Sequence[Path | str],
    out: Path | str,
    mapping: DatasetMapping,
    *,
    min_run_frames: int = 1,
    skip_bad_bags: bool = False,
    progress: Callable[[BagConversion], None] | None = None,
) -> ConversionReport:
    """Convert ``bags`` (one episode each) into a new LeRobotDataset v3 folder at ``out``.

    A bag that cannot be converted raises (BagError, MappingError, ValueError naming it), or
    with ``skip_bad_bags`` is reported in ``failed_bags`` and left out.
    """
    report = ConversionReport()
    writer: LeRobotDatasetWriter | None = None
    start = time.perf_counter()
    for bag in bags:
        try:
            conversion = convert_bag(bag, mapping, min_run_frames)
        except (BagError, ValueError) as error:
            if not skip_bad_bags:
                raise
            report.failed_bags[str(bag)] = str(error)
            continue
        report.bags += 1
        report.grid_frames += conversion.grid_frames
        report.drops.update(conversion.drops)
        for episode in conversion.episodes:
            if writer is None:
                writer = LeRobotDatasetWriter(
                    out, mapping.fps, dataset_features(mapping, episode), mapping.robot_type
                )
            writer.add_episode(episode.frames, episode.tasks)
            report.episodes += 1
            report.frames += len(episode.tasks)
        if progress is not None:
            progress(conversion)
    if writer is None:
        raise BagError(f"no frame from any of {len(bags)} bag(s); nothing written to {out}")
    writer.finish()
    report.seconds = time.perf_counter() - start
    report.dataset_bytes = _folder_bytes(Path(out))
    return report
