"""Record ROS 2 topics into a rosbag2 (``oxygen-record``), without rosbag2_py.

:class:`BagRecorder` subscribes a node to a list of topics and writes every message, as the
CDR bytes that arrived (a raw subscription: no deserialisation), into a new rosbag2 (mcap)
through the pure-Python ``rosbags`` writer. Each message is stamped with its receive time on the
node's clock (ROS time: ``/clock`` when the node has ``use_sim_time``), as ``ros2 bag record``
does; header stamps inside the messages are left as they are.

Topics are resolved in the node's namespace (``joint_states`` on a node in ``/r1`` records
``/r1/joint_states``). A topic is subscribed as soon as it has a publisher, with the publisher's
type, found in the graph: the constructor subscribes to the topics already published and a timer
on the node polls the graph for the rest every :data:`DISCOVERY_PERIOD_S` (so an episode's topics
may come up in any order). The subscription's QoS is chosen the way rosbag2 adapts it to the
publishers it sees, so that it matches every one of them:

* reliable only when every publisher is reliable, else best effort (a reliable subscription does
  not match a best-effort publisher; a best-effort one matches both);
* transient-local only when every publisher is transient-local, else volatile: a latched topic
  (``sim/task`` published once before recording starts) delivers its stored messages;
* history keep-last with depth :data:`SUBSCRIPTION_DEPTH` (at least the publishers' depth).

The publishers' QoS profiles are written into the bag's metadata as the topic's offered QoS, so a
player can publish a latched topic latched again. Message definitions come from the ``rosbags``
type store of the ROS distribution in use; a type it does not know (a package's own messages)
is loaded from the ``.msg`` files its package installs (``share/<pkg>/msg``).

Subscription callbacks may run concurrently (a multi-threaded executor): writes to the bag and
the counts are serialised by one lock. :meth:`BagRecorder.close` finishes the bag and returns the
number of messages written per topic.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import rclpy
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup, ReentrantCallbackGroup
from rclpy.duration import Duration
from rclpy.executors import MultiThreadedExecutor
from rclpy.node import Node
from rclpy.qos import (
    DurabilityPolicy,
    HistoryPolicy,
    QoSProfile,
    ReliabilityPolicy,
)
from rosbags.interfaces import (
    Qos,
    QosDurability,
    QosHistory,
    QosLiveliness,
    QosReliability,
    QosTime,
)
from rosbags.rosbag2 import StoragePlugin, Writer
from rosbags.typesys import get_types_from_msg

from oxygen_ros.tools.make_bag import message_store

if TYPE_CHECKING:
    from rclpy.topic_endpoint_info import TopicEndpointInfo
    from rosbags.interfaces import Connection
    from rosbags.typesys.store import Typestore

DISCOVERY_PERIOD_S = 0.1
"""How often the graph is polled for publishers of topics not subscribed yet."""

SUBSCRIPTION_DEPTH = 100
"""Keep-last depth of each subscription (deep enough for bursts of a fast publisher)."""

_INT32_MAX = 2**31 - 1
_NS_PER_S = 1_000_000_000


class RecorderError(RuntimeError):
    """A topic cannot be recorded (unknown message type, no message definition)."""


def message_class(type_name: str) -> type:
    """The rclpy message class of ``pkg/msg/Type``; RecorderError if it cannot be imported."""
    package, _, name = type_name.partition("/msg/")
    try:
        return getattr(importlib.import_module(f"{package}.msg"), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise RecorderError(f"cannot import message type {type_name}: {error}") from error


def subscription_qos(publishers: Sequence[TopicEndpointInfo]) -> QoSProfile:
    """A QoS that matches every publisher in ``publishers`` (see the module docstring)."""
    profiles = [info.qos_profile for info in publishers]
    reliable = all(p.reliability == ReliabilityPolicy.RELIABLE for p in profiles)
    latched = all(p.durability == DurabilityPolicy.TRANSIENT_LOCAL for p in profiles)
    depth = max([SUBSCRIPTION_DEPTH, *(p.depth for p in profiles)])
    return QoSProfile(
        history=HistoryPolicy.KEEP_LAST,
        depth=depth,
        reliability=ReliabilityPolicy.RELIABLE if reliable else ReliabilityPolicy.BEST_EFFORT,
        durability=DurabilityPolicy.TRANSIENT_LOCAL if latched else DurabilityPolicy.VOLATILE,
    )


def _qos_time(duration: Duration) -> QosTime:
    sec, nsec = divmod(duration.nanoseconds, _NS_PER_S)
    if sec > _INT32_MAX:  # rmw's "infinite"
        return QosTime(sec=_INT32_MAX, nsec=_NS_PER_S - 1)
    return QosTime(sec=sec, nsec=nsec)


def offered_qos(info: TopicEndpointInfo) -> Qos:
    """A publisher's QoS as rosbag2 metadata stores it (``offered_qos_profiles``)."""
    p = info.qos_profile
    return Qos(
        history=QosHistory(int(p.history)),
        depth=p.depth,
        reliability=QosReliability(int(p.reliability)),
        durability=QosDurability(int(p.durability)),
        deadline=_qos_time(p.deadline),
        lifespan=_qos_time(p.lifespan),
        liveliness=QosLiveliness(int(p.liveliness)),
        liveliness_lease_duration=_qos_time(p.liveliness_lease_duration),
        avoid_ros_namespace_conventions=bool(p.avoid_ros_namespace_conventions),
    )


def ensure_message_definition(store: Typestore, type_name: str) -> None:
    """Register ``type_name`` (and the types it nests) in ``store`` from the ``.msg`` files its
    package installs, when the store does not know it; RecorderError when none is found."""
    if type_name in store.fielddefs:
        return
    from ament_index_python.packages import PackageNotFoundError, get_package_share_directory

    package, _, name = type_name.partition("/msg/")
    try:
        msg_file = Path(get_package_share_directory(package)) / "msg" / f"{name}.msg"
        text = msg_file.read_text()
    except (PackageNotFoundError, OSError, ValueError) as error:
        raise RecorderError(
            f"no message definition for {type_name}: not in rosbags' type store and no "
            f"share/{package}/msg/{name}.msg installed ({error})"
        ) from error
    types = get_types_from_msg(text, type_name)
    store.register(types)
    for _, fields in types.values():
        for _, field in fields:
            for nested in _nested_type_names(field):
                ensure_message_definition(store, nested)


def _nested_type_names(field: object) -> list[str]:
    """Names of message types a rosbags field definition refers to."""
    names: list[str] = []
    if isinstance(field, tuple):
        for part in field:
            if isinstance(part, str) and "/msg/" in part:
                names.append(part)
            elif isinstance(part, tuple):
                names.extend(_nested_type_names(part))
    return names


class BagRecorder:
    """Records ``topics`` (resolved in ``node``'s namespace) into a new rosbag2 at ``bag_dir``.

    The node must be spun by the caller (any executor); subscriptions are created as publishers
    appear (see the module docstring). ``bag_dir`` must not exist. Call :meth:`close` to finish
    the bag: until then its index is not written.

    Args:
        node: the node that subscribes; its clock stamps the messages.
        bag_dir: rosbag2 directory to create (mcap storage).
        topics: topic names, relative (resolved in the node's namespace) or absolute.
    """

    def __init__(self, node: Node, bag_dir: Path, topics: Sequence[str]) -> None:
        if not topics:
            raise ValueError("BagRecorder needs at least one topic")
        self._node = node
        self._bag_dir = Path(bag_dir)
        self._topics = list(dict.fromkeys(node.resolve_topic_name(t) for t in topics))
        self._store = message_store()
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(self._topics, 0)
        self._types: dict[str, str] = {}
        self._connections: dict[str, Connection] = {}
        self._subscriptions: list[object] = []
        self._closed = False
        self._writer = Writer(
            self._bag_dir, version=Writer.VERSION_LATEST, storage_plugin=StoragePlugin.MCAP
        )
        self._writer.open()
        self._callbacks = ReentrantCallbackGroup()
        self._discover()
        self._timer = node.create_timer(
            DISCOVERY_PERIOD_S, self._discover, callback_group=MutuallyExclusiveCallbackGroup()
        )

    @property
    def bag_dir(self) -> Path:
        """The rosbag2 directory being written."""
        return self._bag_dir

    @property
    def topics(self) -> list[str]:
        """The fully qualified topics recorded."""
        return list(self._topics)

    def pending_topics(self) -> list[str]:
        """Topics not subscribed yet (no publisher seen so far)."""
        with self._lock:
            return [t for t in self._topics if t not in self._connections]

    def message_counts(self) -> dict[str, int]:
        """Messages written so far, per topic."""
        with self._lock:
            return dict(self._counts)

    def close(self) -> dict[str, int]:
        """Stop recording, finish the bag and return the messages written per topic.

        Safe to call more than once and after the node's context was shut down.
        """
        with self._lock:
            if not self._closed:
                self._closed = True
                self._writer.close()
            counts = dict(self._counts)
        if self._node.context.ok():
            self._node.destroy_timer(self._timer)
            for subscription in self._subscriptions:
                self._node.destroy_subscription(subscription)
        self._subscriptions.clear()
        return counts

    # ------------------------------------------------------------------------------------------

    def _discover(self) -> None:
        """Subscribe to every pending topic that now has a publisher."""
        if self._closed:
            return
        for topic in self.pending_topics():
            publishers = self._node.get_publishers_info_by_topic(topic)
            if publishers:
                self._subscribe(topic, publishers)

    def _subscribe(self, topic: str, publishers: Sequence[TopicEndpointInfo]) -> None:
        type_name = publishers[0].topic_type
        other_types = {p.topic_type for p in publishers} - {type_name}
        if other_types:
            self._node.get_logger().warning(
                f"{topic} is published with several types ({type_name}, "
                f"{', '.join(sorted(other_types))}); recording {type_name}"
            )
        msg_type = message_class(type_name)
        ensure_message_definition(self._store, type_name)
        with self._lock:
            if self._closed:
                return
            self._connections[topic] = self._writer.add_connection(
                topic,
                type_name,
                typestore=self._store,
                offered_qos_profiles=[offered_qos(p) for p in publishers],
            )
            self._types[topic] = type_name
        subscription = self._node.create_subscription(
            msg_type,
            topic,
            lambda raw, topic=topic: self._on_message(topic, raw),
            subscription_qos(publishers),
            callback_group=self._callbacks,
            raw=True,
        )
        self._subscriptions.append(subscription)

    def _on_message(self, topic: str, raw: bytes) -> None:
        stamp_ns = self._node.get_clock().now().nanoseconds
        with self._lock:
            if self._closed:
                return
            self._writer.write(self._connections[topic], stamp_ns, raw)
            self._counts[topic] += 1


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """Command-line interface of ``oxygen-record``."""
    parser = argparse.ArgumentParser(
        prog="oxygen-record",
        description="Record ROS 2 topics into a rosbag2 (mcap) until Ctrl-C or --duration.",
    )
    parser.add_argument("topics", nargs="+", help="topics to record (relative: node namespace)")
    parser.add_argument(
        "--out", type=Path, required=True, help="bag directory to create (must not exist)"
    )
    parser.add_argument(
        "--duration", type=float, default=None, help="stop after this many seconds (wall time)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``oxygen-record``; returns the process exit status."""
    from rclpy.utilities import remove_ros_args

    from oxygen_ros.ros.rclpy_compat import ExternalShutdownException

    args_with_ros = list(sys.argv if argv is None else ["oxygen-record", *argv])
    args = build_parser().parse_args(remove_ros_args(args_with_ros)[1:])
    if args.out.exists():
        print(f"oxygen-record: {args.out} exists; choose another --out", file=sys.stderr)
        return 1
    rclpy.init(args=args_with_ros)
    node = Node("oxygen_recorder")
    executor = MultiThreadedExecutor(num_threads=2)
    executor.add_node(node)
    recorder = BagRecorder(node, args.out, args.topics)
    print(f"oxygen-record: recording {', '.join(recorder.topics)} into {args.out}", flush=True)
    deadline = None if args.duration is None else time.monotonic() + args.duration
    try:
        while rclpy.ok() and (deadline is None or time.monotonic() < deadline):
            executor.spin_once(timeout_sec=0.1)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        counts = recorder.close()
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
    for topic, count in counts.items():
        print(f"  {topic}: {count} messages")
    print(f"oxygen-record: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
