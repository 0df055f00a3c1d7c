"""BagRecorder over DDS: real publishers (best-effort images, reliable joint states, a latched
transient-local string, a topic that appears only after recording started), a real rosbag2 read
back with rosbags: counts, types, payloads, receive-time stamps, offered QoS."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import rclpy
from node_harness import wait_for
from rclpy.executors import MultiThreadedExecutor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
from rclpy.serialization import deserialize_message
from rosbags.highlevel import AnyReader
from rosbags.interfaces import QosDurability
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String

from oxygen_ros.tools.record import BagRecorder, RecorderError, message_class

pytestmark = pytest.mark.ros

LATCHED_QOS = QoSProfile(
    depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL
)


@pytest.fixture
def ros_nodes() -> Iterator[tuple[Node, Node]]:
    """A publisher node and a recorder node in namespace /r1, spun by a multi-threaded
    executor in a background thread."""
    context = rclpy.Context()
    rclpy.init(context=context)
    publisher = Node("record_test_publisher", namespace="r1", context=context)
    recorder = Node("record_test_recorder", namespace="r1", context=context)
    executor = MultiThreadedExecutor(num_threads=3, context=context)
    executor.add_node(publisher)
    executor.add_node(recorder)
    thread = threading.Thread(target=executor.spin, daemon=True)
    thread.start()
    try:
        yield publisher, recorder
    finally:
        executor.shutdown()
        thread.join(timeout=5)
        publisher.destroy_node()
        recorder.destroy_node()
        rclpy.shutdown(context=context)


def _image(i: int) -> Image:
    pixels = np.full((8, 6, 3), i, dtype=np.uint8)
    pixels[0, 0] = (255, 0, i)
    msg = Image(height=8, width=6, encoding="rgb8", step=18)
    msg.header.stamp.sec, msg.header.frame_id = 100 + i, "scene"
    msg.data = pixels.tobytes()
    return msg


def _joint_state(i: int) -> JointState:
    msg = JointState(name=["a", "b"], position=[0.1 * i, -0.2 * i])
    msg.header.stamp.nanosec = 1000 * i
    return msg


def test_records_best_effort_reliable_latched_and_late_topics(ros_nodes, tmp_path: Path) -> None:
    pub_node, rec_node = ros_nodes
    task_pub = pub_node.create_publisher(String, "sim/task", LATCHED_QOS)
    task = String(data="touch the red cube")
    task_pub.publish(task)  # before the recorder exists: only transient-local delivers it
    image_pub = pub_node.create_publisher(Image, "camera/scene/image_raw", qos_profile_sensor_data)
    joint_pub = pub_node.create_publisher(JointState, "joint_states", 10)

    bag = tmp_path / "episode"
    recorder = BagRecorder(
        rec_node, bag, ["camera/scene/image_raw", "joint_states", "sim/task", "/r1/sim/subtask"]
    )
    assert recorder.topics == [
        "/r1/camera/scene/image_raw",
        "/r1/joint_states",
        "/r1/sim/task",
        "/r1/sim/subtask",
    ]
    assert wait_for(lambda: recorder.pending_topics() == ["/r1/sim/subtask"], 10)
    for publisher in (image_pub, joint_pub, task_pub):
        assert wait_for(lambda p=publisher: p.get_subscription_count() > 0, 10)
    assert wait_for(lambda: recorder.message_counts()["/r1/sim/task"] == 1, 10)

    subtask_pub = pub_node.create_publisher(String, "sim/subtask", 10)  # appears late
    assert wait_for(lambda: recorder.pending_topics() == [], 10)
    assert wait_for(lambda: subtask_pub.get_subscription_count() > 0, 10)

    images, joints = [_image(i) for i in range(5)], [_joint_state(i) for i in range(7)]
    subtasks = [String(data=s) for s in ("reach", "grasp")]
    start_ns = rec_node.get_clock().now().nanoseconds
    for stream, publisher, key in (
        (images, image_pub, "/r1/camera/scene/image_raw"),
        (joints, joint_pub, "/r1/joint_states"),
        (subtasks, subtask_pub, "/r1/sim/subtask"),
    ):
        for n, msg in enumerate(stream, start=1):
            publisher.publish(msg)  # one at a time: a best-effort sample is never overwritten
            assert wait_for(lambda k=key, n=n: recorder.message_counts()[k] == n, 10)
    end_ns = rec_node.get_clock().now().nanoseconds
    counts = recorder.close()
    assert recorder.close() == counts  # idempotent
    assert counts == {
        "/r1/camera/scene/image_raw": 5,
        "/r1/joint_states": 7,
        "/r1/sim/task": 1,
        "/r1/sim/subtask": 2,
    }

    expected = {
        "/r1/camera/scene/image_raw": images,
        "/r1/joint_states": joints,
        "/r1/sim/task": [task],
        "/r1/sim/subtask": subtasks,
    }
    with AnyReader([bag]) as reader:
        types = {c.topic: c.msgtype for c in reader.connections}
        assert types == {
            "/r1/camera/scene/image_raw": "sensor_msgs/msg/Image",
            "/r1/joint_states": "sensor_msgs/msg/JointState",
            "/r1/sim/task": "std_msgs/msg/String",
            "/r1/sim/subtask": "std_msgs/msg/String",
        }
        latched = next(c for c in reader.connections if c.topic == "/r1/sim/task")
        assert latched.ext.offered_qos_profiles[0].durability == QosDurability.TRANSIENT_LOCAL
        got: dict[str, list[tuple[int, bytes]]] = {topic: [] for topic in expected}
        for connection, stamp, raw in reader.messages():
            got[connection.topic].append((stamp, bytes(raw)))
        decoded_image = reader.deserialize(
            got["/r1/camera/scene/image_raw"][3][1], types["/r1/camera/scene/image_raw"]
        )
    for topic, messages in expected.items():
        # padding bytes of the CDR are not defined: compare the messages the bytes decode to
        assert [deserialize_message(raw, type(messages[0])) for _, raw in got[topic]] == messages
    stamps = [
        stamp
        for topic in ("/r1/camera/scene/image_raw", "/r1/joint_states")
        for stamp, _ in got[topic]
    ]
    assert all(start_ns <= s <= end_ns for s in stamps)  # receive time on the recorder's clock
    assert got["/r1/sim/task"][0][0] < start_ns  # the latched message arrived before
    assert decoded_image.header.stamp.sec == 103
    assert np.array_equal(
        decoded_image.data.reshape(8, 6, 3), np.asarray(images[3].data).reshape(8, 6, 3)
    )


def test_unknown_message_type_is_named() -> None:
    with pytest.raises(RecorderError, match="no_such_pkg/msg/Thing"):
        message_class("no_such_pkg/msg/Thing")


def test_existing_bag_dir_is_refused(ros_nodes, tmp_path: Path) -> None:
    _, rec_node = ros_nodes
    (tmp_path / "bag").mkdir()
    with pytest.raises(Exception, match="exists"):
        BagRecorder(rec_node, tmp_path / "bag", ["joint_states"])
