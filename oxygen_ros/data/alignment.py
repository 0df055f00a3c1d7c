"""Sampling every stream of an episode at a fixed fps on one timeline.

The rules (all times on the episode's timeline, see :mod:`.bag_episode`; integer nanoseconds):

* **Frame grid.** ``t_k = t_0 + round(k * 1e9 / fps)`` for ``k = 0, 1, ...`` while
  ``t_k <= t_end``, where ``t_0`` is the first time every *required* stream has a message (the
  latest of their first message times) and ``t_end`` is the last message time of the
  shortest-lived required *sensor* stream (the earliest of their last message times). Streams
  that hold their value on their own (commands: a trajectory holds its last point; strings) do
  not end the episode: a gripper commanded twice in an episode does not cut it short.
* **Zero-order hold.** A stream's value at ``t_k`` is its latest message at or before ``t_k``
  (ties: the last one recorded). A non-required stream with no message yet has none (strings
  become ``""``).
* **Staleness.** A stream with a limit ``max_staleness_s`` whose held message is older than the
  limit at ``t_k`` (``t_k - t_msg > max_staleness``) makes the frame dropped; drops are counted
  per reason ``stale:<feature>`` (the first stale feature in mapping order names the reason).
* **Events.** An ``event`` stream's messages go to the first kept frame at or after them: frame
  ``k`` gets the messages in ``(t_prev_kept, t_k]`` (frame 0: everything up to ``t_0``).
* **Episodes.** Kept frames form contiguous runs; each run becomes one dataset episode with
  ``timestamp = frame_index / fps``, so LeRobot's index-based ``delta_timestamps`` stay true.
  Runs shorter than a minimum length are dropped too (reason ``short_run``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

NS_PER_S = 1_000_000_000


class AlignmentError(ValueError):
    """No frame can be made (a required stream is empty, or they never overlap)."""


@dataclass(frozen=True)
class TimedStream:
    """Message times of one feature's stream and how it is sampled."""

    name: str
    times_ns: np.ndarray
    """int64 timeline times, sorted ascending."""
    required: bool = True
    max_staleness_s: float | None = None
    bounds_end: bool = True
    """Whether the stream's last message can end the frame grid (sensor streams)."""


@dataclass
class Alignment:
    """The frame grid and, per stream, the index of the message held at each frame."""

    frame_ns: np.ndarray
    held: dict[str, np.ndarray]
    """Per stream: index into its times of the message held at each frame (-1: none yet)."""
    keep: np.ndarray
    """bool per frame: not dropped."""
    drops: Counter = field(default_factory=Counter)


def frame_grid(streams: Sequence[TimedStream], fps: int) -> np.ndarray:
    """Frame times (int64 ns) of the episode; AlignmentError when none can be made."""
    required = [s for s in streams if s.required]
    if not required:
        raise AlignmentError("no required stream: nothing sets the frames")
    for stream in required:
        if stream.times_ns.size == 0:
            raise AlignmentError(f"required stream {stream.name!r} has no message")
    start = max(int(s.times_ns[0]) for s in required)
    ending = [s for s in required if s.bounds_end]
    if not ending:
        raise AlignmentError("no required sensor stream: nothing ends the frames")
    end = min(int(s.times_ns[-1]) for s in ending)
    if end < start:
        raise AlignmentError(
            f"required streams never overlap: the last message of one comes at {end} ns, before "
            f"every required stream has started at {start} ns"
        )
    count = (end - start) * fps // NS_PER_S + 1
    frames = start + (np.arange(count, dtype=np.int64) * NS_PER_S + fps // 2) // fps
    return frames[frames <= end]


def latest_at_or_before(times_ns: np.ndarray, frame_ns: np.ndarray) -> np.ndarray:
    """Per frame, the index of the last time ``<=`` the frame time (-1 when none)."""
    return np.searchsorted(times_ns, frame_ns, side="right").astype(np.int64) - 1


def align(streams: Sequence[TimedStream], fps: int) -> Alignment:
    """The frame grid, held messages and staleness drops of ``streams`` at ``fps``."""
    frames = frame_grid(streams, fps)
    held = {s.name: latest_at_or_before(s.times_ns, frames) for s in streams}
    keep = np.ones(frames.size, dtype=bool)
    drops: Counter = Counter()
    for stream in streams:
        if stream.max_staleness_s is None:
            continue
        index = held[stream.name]
        has = index >= 0
        age = np.zeros(frames.size, dtype=np.int64)
        age[has] = frames[has] - stream.times_ns[index[has]]
        stale = has & (age > round(stream.max_staleness_s * NS_PER_S)) & keep
        drops[f"stale:{stream.name}"] += int(stale.sum())
        keep &= ~stale
    return Alignment(frame_ns=frames, held=held, keep=keep, drops=+drops)


def events_per_frame(times_ns: np.ndarray, frame_ns: np.ndarray) -> list[range]:
    """For frames ``frame_ns`` (the kept ones, ascending), the message indices that fall in
    ``(previous frame, this frame]`` (the first frame takes everything up to it)."""
    ends = np.searchsorted(times_ns, frame_ns, side="right")
    starts = np.concatenate(([0], ends[:-1]))
    return [range(int(a), int(b)) for a, b in zip(starts, ends, strict=False)]


def contiguous_runs(keep: np.ndarray, min_length: int = 1) -> tuple[list[range], int]:
    """Runs of consecutive kept frames at least ``min_length`` long, and how many kept frames
    were in shorter runs."""
    runs: list[range] = []
    short = 0
    start = None
    for i, kept in enumerate([*keep.tolist(), False]):
        if kept and start is None:
            start = i
        elif not kept and start is not None:
            if i - start >= min_length:
                runs.append(range(start, i))
            else:
                short += i - start
            start = None
    return runs, short
