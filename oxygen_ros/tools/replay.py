"""Play a rosbag2 into the ROS graph with its recorded timing (``oxygen-replay``).

A small stand-in for ``ros2 bag play`` that needs only rclpy and the pure-Python ``rosbags``
reader, so it runs wherever the PyPI ROS wheels do. Messages are published as the raw CDR bytes
stored in the bag (no deserialisation), with the bag's timing scaled by ``--rate``.

By default header stamps are rewritten to the current ROS time, so a live node that drops stale
observations accepts replayed data; ``--keep-stamps`` publishes the bag's stamps unchanged.

``--namespace r1`` plays every bag topic under ``/r1`` (``/camera/base/image_raw`` ->
``/r1/camera/base/image_raw``): the inputs of a node started in namespace ``r1`` with relative
input topics, as the shipped configs have. Several robots are several players, one namespace each.

Sim time: with ``--ros-args -p use_sim_time:=true`` "the current ROS time" is the time on
``/clock``. The player's node is spun in a background thread for the whole run, so its clock
follows ``/clock``, and playing starts only once a first ``/clock`` message has arrived (until
then the time would be 0).
"""

from __future__ import annotations

import argparse
import importlib
import math
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node
from rclpy.publisher import Publisher
from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from rclpy.serialization import deserialize_message, serialize_message
from rclpy.utilities import remove_ros_args
from rosbags.highlevel import AnyReader, AnyReaderError

from oxygen_ros.tools.cli import namespace, namespaced, positive_float

SENSOR_TYPES = frozenset({"sensor_msgs/msg/Image", "sensor_msgs/msg/CompressedImage"})
"""Types published with the sensor-data QoS profile (best effort); others are reliable."""

_CDR_BYTE_ORDER = {b"\x00\x00": ">", b"\x00\x01": "<"}  # plain CDR big / little endian
_STAMP_END = 12  # bytes 4..12: header.stamp (int32 sec, uint32 nanosec) when header comes first
_HEADER_FIELD = ("header", "std_msgs/Header")


def message_class(type_name: str) -> type | None:
    """Import the rclpy message class for ``pkg/msg/Type`` (or ``pkg/Type``); None if absent."""
    parts = type_name.split("/")
    if len(parts) == 2:
        parts = [parts[0], "msg", parts[1]]
    if len(parts) != 3:
        return None
    package, kind, name = parts
    try:
        return getattr(importlib.import_module(f"{package}.{kind}"), name)
    except (ImportError, AttributeError):
        return None


RELIABLE_HISTORY_DEPTH = 100
"""Writer history for reliable topics: a fast (N×) replay publishes in bursts, and a deep
history lets a reliable subscriber catch up instead of having unacknowledged samples overwritten."""


def qos_for(type_name: str) -> QoSProfile:
    """Sensor-data QoS for camera images, reliable with a deep history for everything else."""
    if type_name in SENSOR_TYPES:
        return qos_profile_sensor_data
    return QoSProfile(depth=RELIABLE_HISTORY_DEPTH, reliability=ReliabilityPolicy.RELIABLE)


# ----------------------------------------------------------------------------------------------
# Restamping
# ----------------------------------------------------------------------------------------------

Restamper = Callable[[bytes, int, int], bytes]
"""Returns serialized message bytes with header.stamp set to (sec, nanosec)."""


def _patch_leading_header(raw: bytes, sec: int, nanosec: int) -> bytes:
    """Replace header.stamp of a plain-CDR message whose first field is its header.

    The 4-byte encapsulation header names the byte order; the stamp's two 32-bit fields follow
    it directly (both 4-byte aligned), so no other byte moves.
    """
    order = _CDR_BYTE_ORDER[raw[:2]]
    return raw[:4] + struct.pack(f"{order}iI", sec, nanosec) + raw[_STAMP_END:]


def restamper_for(msg_class: type) -> Restamper | None:
    """A function that rewrites the header stamp of serialized ``msg_class`` messages.

    Messages whose first field is ``std_msgs/Header`` (nearly all stamped messages) get their
    8 stamp bytes patched directly; other messages with a top-level ``header`` go through
    rclpy deserialisation and serialisation. Returns None for messages without a header.
    """
    fields = list(msg_class.get_fields_and_field_types().items())
    if _HEADER_FIELD not in fields:
        return None

    def via_rclpy(raw: bytes, sec: int, nanosec: int) -> bytes:
        msg = deserialize_message(raw, msg_class)
        msg.header.stamp.sec, msg.header.stamp.nanosec = sec, nanosec
        return serialize_message(msg)

    if fields[0] != _HEADER_FIELD:
        return via_rclpy

    def patched(raw: bytes, sec: int, nanosec: int) -> bytes:
        if raw[:2] in _CDR_BYTE_ORDER and len(raw) >= _STAMP_END:
            return _patch_leading_header(raw, sec, nanosec)
        return via_rclpy(raw, sec, nanosec)

    return patched


# ----------------------------------------------------------------------------------------------
# Player
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Output:
    """Where one bag topic goes."""

    publisher: Publisher
    restamp: Restamper | None


class BagPlayer:
    """Publishes a rosbag2's messages on their topics with the recorded timing.

    Publishers are created on construction, so subscribers can discover them before
    :meth:`play` starts. Topics whose message type is not importable are skipped with a
    warning.

    Args:
        node: node that owns the publishers (and whose clock stamps messages).
        bag_path: rosbag2 directory (mcap or sqlite3).
        rate: playback speed factor; 2.0 plays twice as fast.
        loop: start over at the end until stopped.
        topics: bag topics to play; all when None.
        restamp: rewrite header stamps to the current ROS time at publication.
        namespace: play every topic under this namespace (``r1``: ``/r1/joint_states``).
    """

    def __init__(
        self,
        node: Node,
        bag_path: Path | str,
        *,
        rate: float = 1.0,
        loop: bool = False,
        topics: Sequence[str] | None = None,
        restamp: bool = True,
        namespace: str = "",
    ) -> None:
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate must be a positive number, got {rate}")
        self._node = node
        self._path = Path(bag_path)
        self._rate = rate
        self._loop = loop
        self._restamp = restamp
        self._namespace = namespace
        with AnyReader([self._path]) as reader:
            self.duration_s = reader.duration * 1e-9
            self._outputs = self._make_outputs(reader.connections, topics)
        if not self._outputs:
            raise ValueError(f"nothing to play from {self._path} (topics {topics})")

    @property
    def topics(self) -> list[str]:
        """The topics this player publishes (with its namespace)."""
        return sorted(o.publisher.topic_name for o in self._outputs.values())

    def _make_outputs(
        self, connections: Sequence[Any], wanted: Sequence[str] | None
    ) -> dict[str, _Output]:
        """One publisher (and optional restamper) per playable topic."""
        logger = self._node.get_logger()
        available = {c.topic: c.msgtype for c in connections}
        for topic in sorted(set(wanted or ()) - available.keys()):
            logger.warning(f"topic {topic} is not in the bag")
        outputs: dict[str, _Output] = {}
        for topic, type_name in sorted(available.items()):
            if wanted is not None and topic not in wanted:
                continue
            msg_class = message_class(type_name)
            if msg_class is None:
                logger.warning(f"skipping {topic}: message type {type_name} is not importable")
                continue
            publisher = self._node.create_publisher(
                msg_class, namespaced(topic, self._namespace), qos_for(type_name)
            )
            restamp = restamper_for(msg_class) if self._restamp else None
            outputs[topic] = _Output(publisher, restamp)
        return outputs

    def wait_for_subscribers(
        self, timeout_s: float, stop_event: threading.Event | None = None
    ) -> bool:
        """Wait until every topic has a subscriber; False on timeout or stop."""
        deadline = time.monotonic() + timeout_s
        stop_event = stop_event or threading.Event()
        while not all(o.publisher.get_subscription_count() for o in self._outputs.values()):
            if time.monotonic() >= deadline or stop_event.wait(0.02):
                return False
        return True

    def play(self, stop_event: threading.Event | None = None) -> int:
        """Publish the bag (repeatedly when looping) and return the number of messages sent.

        Returns early when ``stop_event`` is set or the node's context shuts down.
        """
        stop_event = stop_event or threading.Event()
        published = 0
        while True:
            count, finished = self._play_once(stop_event)
            published += count
            if not (self._loop and finished and count):
                return published

    def _play_once(self, stop_event: threading.Event) -> tuple[int, bool]:
        """One pass over the bag: (messages published, whether the pass reached the end)."""
        published = 0
        with AnyReader([self._path]) as reader:
            connections = [c for c in reader.connections if c.topic in self._outputs]
            start_wall = time.monotonic()
            start_bag: int | None = None
            for connection, timestamp, raw in reader.messages(connections=connections):
                start_bag = timestamp if start_bag is None else start_bag
                due = start_wall + (timestamp - start_bag) * 1e-9 / self._rate
                if self._wait_until(due, stop_event):
                    return published, False
                self._publish(self._outputs[connection.topic], bytes(raw))
                published += 1
        return published, True

    def _wait_until(self, due: float, stop_event: threading.Event) -> bool:
        """Sleep until monotonic time ``due``; True when playback must stop instead."""
        remaining = due - time.monotonic()
        stopped = stop_event.wait(remaining) if remaining > 0 else stop_event.is_set()
        return stopped or not rclpy.ok(context=self._node.context)

    def _publish(self, output: _Output, raw: bytes) -> None:
        """Publish serialized bytes, restamped to now when configured."""
        if output.restamp is not None:
            sec, nanosec = self._node.get_clock().now().seconds_nanoseconds()
            raw = output.restamp(raw, sec, nanosec)
        output.publisher.publish(raw)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """Command-line interface of ``oxygen-replay``."""
    parser = argparse.ArgumentParser(
        prog="oxygen-replay",
        description="Play a rosbag2 (mcap or sqlite3) into the ROS graph. ROS arguments "
        "(--ros-args ...) may follow.",
        epilog="Sim time: with --ros-args -p use_sim_time:=true the stamps are the time on /clock "
        "(published by a simulator, or another player); playing waits for the first /clock "
        "message.",
    )
    parser.add_argument("bag", type=Path, help="rosbag2 directory")
    parser.add_argument(
        "--rate",
        type=positive_float,
        default=1.0,
        help="playback speed factor (default 1; 4 plays 4x faster)",
    )
    parser.add_argument("--loop", action="store_true", help="repeat until interrupted")
    parser.add_argument("--topics", nargs="+", metavar="TOPIC", help="only these bag topics")
    parser.add_argument(
        "--namespace",
        type=namespace,
        default="",
        metavar="NS",
        help="play every topic under this namespace, e.g. r1: /joint_states -> /r1/joint_states "
        "(the inputs of a node started in namespace r1); default: the bag's names",
    )
    parser.add_argument(
        "--keep-stamps",
        action="store_true",
        help="publish the bag's header stamps instead of the current time",
    )
    parser.add_argument(
        "--wait-for-subscribers",
        type=float,
        default=0.0,
        metavar="SEC",
        help="wait up to SEC seconds for a subscriber on every topic",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``oxygen-replay``; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(remove_ros_args(["oxygen-replay", *argv])[1:])
    context = rclpy.Context()
    rclpy.init(args=["oxygen-replay", *argv], context=context)
    stop = threading.Event()
    previous_handlers = _stop_on_signals(stop)
    node = rclpy.create_node("oxygen_replay", context=context, namespace=args.namespace or None)
    # The node's own callbacks (its clock's /clock subscription under use_sim_time) run here while
    # the main thread plays.
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    spinner = threading.Thread(target=_spin, args=(executor,), daemon=True)
    spinner.start()
    try:
        return _replay(node, args, stop)
    finally:
        _restore_signals(previous_handlers)
        executor.shutdown()
        spinner.join(timeout=5)
        node.destroy_node()
        if context.ok():
            context.shutdown()


def _spin(executor: SingleThreadedExecutor) -> None:
    """Spin until the executor or its context shuts down."""
    try:
        executor.spin()
    except Exception:  # noqa: BLE001 - shutting down; nothing left to serve
        pass


def wait_for_clock(node: Node, stop: threading.Event) -> bool:
    """Under ``use_sim_time`` wait until the node's clock has received /clock (True), or
    ``stop`` is set (False). Returns True at once when the node runs on system time."""
    if not node.get_parameter("use_sim_time").value:
        return True
    clock = node.get_clock()
    print("oxygen-replay: use_sim_time is true: waiting for /clock before playing", file=sys.stderr)
    while clock.now().nanoseconds == 0:
        if stop.wait(0.05):
            return False
    return True


def _replay(node: Node, args: argparse.Namespace, stop: threading.Event) -> int:
    """Play the bag named by ``args`` and print a one-line summary; returns the exit status."""
    try:
        player = BagPlayer(
            node,
            args.bag,
            rate=args.rate,
            loop=args.loop,
            topics=args.topics,
            restamp=not args.keep_stamps,
            namespace=args.namespace,
        )
        if args.wait_for_subscribers > 0:
            player.wait_for_subscribers(args.wait_for_subscribers, stop)
        if not wait_for_clock(node, stop):
            print("oxygen-replay: stopped before /clock arrived; nothing published")
            return 0
        started = time.monotonic()
        published = player.play(stop)
    except (ValueError, OSError, AnyReaderError) as exc:
        print(f"oxygen-replay: cannot play {args.bag}: {exc}", file=sys.stderr)
        return 1
    elapsed = time.monotonic() - started
    print(
        f"oxygen-replay: published {published} messages on {len(player.topics)} topic(s) "
        f"in {elapsed:.2f} s (bag {player.duration_s:.2f} s at {args.rate:g}x) from {args.bag}"
        + (f" under {args.namespace}" if args.namespace else "")
    )
    return 0


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _stop_on_signals(stop: threading.Event) -> dict:
    """Make SIGINT/SIGTERM set ``stop`` (main thread only); returns the handlers replaced."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, lambda *_: stop.set()) for signum in _STOP_SIGNALS}


def _restore_signals(previous: dict) -> None:
    """Reinstall handlers saved by :func:`_stop_on_signals` (those Python can reinstall)."""
    for signum, handler in previous.items():
        if handler is not None:
            signal.signal(signum, handler)


if __name__ == "__main__":
    sys.exit(main())
