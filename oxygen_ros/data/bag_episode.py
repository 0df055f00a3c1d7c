"""One rosbag2 episode read into time-stamped messages per topic, on one timeline.

Each message has two times: its **record time** (the bag's timestamp: when the recorder received
it, on the recorder's clock) and, when it has one, its **header stamp** (the sim's clock: when the
image was rendered, the joint state sampled, the trajectory should start).

The episode's timeline is the header-stamp clock. A message without a header (``std_msgs/String``)
or with a zero stamp is placed at its record time minus the **clock offset**: per topic whose
header time is used (``header_topics``), the smallest ``record time - header stamp`` (the clocks'
difference plus that stream's shortest latency), and of those the median. Latency is never
negative and a busy recorder only adds to it (a backlog of queued joint states reaches the
recorder up to seconds of sim time late when the sim runs faster than real time), so each
stream's smallest difference is the one closest to the clocks' own, where a median over all
messages would move every string placed by receipt that much too early; the median over streams
keeps one stream's odd message out (a recorder whose ``/clock`` is a tick behind records a joint
state 10 ms before its stamp). So a recorder on wall time and a sim on ``/clock`` still give one
consistent timeline. Without any header-stamped message the offset is 0.

Topics are asked for by relative name; a bag recorded in a namespace (``/r1/joint_states``)
matches ``joint_states`` when exactly one bag topic ends with it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rosbags.highlevel import AnyReader, AnyReaderError
from rosbags.typesys import Stores, get_typestore

_FALLBACK_STORES = {
    "humble": Stores.ROS2_HUMBLE,
    "jazzy": Stores.ROS2_JAZZY,
    "kilted": Stores.ROS2_KILTED,
}


class BagError(ValueError):
    """A bag cannot be read as an episode; the message names the bag and topic."""


@dataclass
class TopicMessages:
    """Every message of one topic, in record order."""

    topic: str
    msgtype: str
    record_ns: np.ndarray
    """int64 record times."""
    header_ns: np.ndarray
    """int64 header stamps; 0 where the message has no header or a zero stamp."""
    messages: list[object]

    def __len__(self) -> int:
        return len(self.messages)


@dataclass
class BagEpisode:
    """The messages of the asked topics, and the clock offset that maps record time onto the
    header-stamp timeline."""

    path: Path
    topics: dict[str, TopicMessages]
    """Keyed by the requested (relative) topic name."""
    clock_offset_ns: int

    def receipt_time_ns(self, name: str) -> np.ndarray:
        """Timeline times at which the messages of ``name`` were received (record time minus
        the clock offset)."""
        return self.topics[name].record_ns - self.clock_offset_ns

    def message_time_ns(self, name: str) -> np.ndarray:
        """Timeline time of each message of ``name``: its header stamp, else its receipt time."""
        stream = self.topics[name]
        return np.where(stream.header_ns != 0, stream.header_ns, self.receipt_time_ns(name))


def resolve_topic(requested: str, available: Sequence[str], bag: Path | str = "bag") -> str:
    """The bag topic that ``requested`` names: ``/requested`` itself, else the one topic that
    ends with ``/requested``; BagError when none or several match."""
    relative = requested.strip("/")
    exact = f"/{relative}"
    if exact in available:
        return exact
    matches = [t for t in available if t.endswith(exact)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise BagError(
            f"{bag}: no topic {requested!r} in the bag (topics: {', '.join(sorted(available))})"
        )
    raise BagError(f"{bag}: topic {requested!r} is ambiguous: {', '.join(sorted(matches))}")


def fallback_typestore() -> object:
    """Message definitions for bags that do not carry their own (older sqlite3 bags): those of
    ``$ROS_DISTRO`` when rosbags knows it, else Jazzy's (no rclpy import here)."""
    distro = os.environ.get("ROS_DISTRO", "")
    return get_typestore(_FALLBACK_STORES.get(distro, Stores.ROS2_JAZZY))


def _header_ns(msg: object) -> int:
    header = getattr(msg, "header", None)
    if header is None:
        return 0
    return int(header.stamp.sec) * 1_000_000_000 + int(header.stamp.nanosec)


def read_bag_episode(
    path: Path | str,
    topics: Sequence[str],
    optional: Sequence[str] = (),
    header_topics: Sequence[str] | None = None,
) -> BagEpisode:
    """Read ``topics`` (each must be in the bag) and ``optional`` topics (read when present, else
    an empty stream) from the rosbag2 at ``path``.

    ``header_topics`` (default: all read topics) are those whose header stamps estimate the
    clock offset (leave out messages whose stamp is not "now", e.g. trajectories' start times).
    """
    path = Path(path)
    try:
        reader_cm = AnyReader([path], default_typestore=fallback_typestore())
        reader = reader_cm.__enter__()
    except (AnyReaderError, FileNotFoundError, OSError) as error:
        raise BagError(f"{path}: cannot open as a rosbag2: {error}") from error
    try:
        available = sorted({c.topic for c in reader.connections})
        wanted = {name: resolve_topic(name, available, path) for name in topics}
        for name in optional:
            try:
                wanted[name] = resolve_topic(name, available, path)
            except BagError:
                wanted.setdefault(name, "")
        by_topic: dict[str, list[tuple[int, int, object]]] = {t: [] for t in wanted.values() if t}
        types: dict[str, str] = {}
        connections = [c for c in reader.connections if c.topic in by_topic]
        for connection, stamp, raw in reader.messages(connections=connections):
            msg = reader.deserialize(raw, connection.msgtype)
            by_topic[connection.topic].append((stamp, _header_ns(msg), msg))
            types[connection.topic] = connection.msgtype
    finally:
        reader_cm.__exit__(None, None, None)

    streams: dict[str, TopicMessages] = {}
    for name, topic in wanted.items():
        records = by_topic.get(topic, [])
        streams[name] = TopicMessages(
            topic=topic,
            msgtype=types.get(topic, ""),
            record_ns=np.array([r[0] for r in records], dtype=np.int64),
            header_ns=np.array([r[1] for r in records], dtype=np.int64),
            messages=[r[2] for r in records],
        )
    offsets = [
        stream.record_ns[stream.header_ns != 0] - stream.header_ns[stream.header_ns != 0]
        for name, stream in streams.items()
        if header_topics is None or name in header_topics
    ]
    floors = [int(o.min()) for o in offsets if o.size]
    offset = int(np.median(floors)) if floors else 0
    return BagEpisode(path=path, topics=streams, clock_offset_ns=offset)
