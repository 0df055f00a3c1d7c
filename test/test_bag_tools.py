"""Tests for oxygen-make-bag and oxygen-replay: bag contents, then replay into live subscribers.

conftest.py sets a private ROS_DOMAIN_ID and localhost discovery before rclpy is imported.
"""

import importlib.metadata
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import rclpy
from builtin_interfaces.msg import Time
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import ReliabilityPolicy, qos_profile_sensor_data
from rclpy.serialization import deserialize_message, serialize_message
from rosbags.highlevel import AnyReader
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String

from oxygen_ros.ros.convert import image_to_rgb, stamp_to_seconds
from oxygen_ros.tools import make_bag, replay
from oxygen_ros.tools.make_bag import EPOCH_NS, joint_motion, write_synthetic_bag
from oxygen_ros.tools.replay import BagPlayer

REPO = Path(__file__).resolve().parents[1]
BASE, WRIST, JOINTS = "/camera/base/image_raw", "/camera/wrist/image_raw", "/joint_states"
DURATION_S = 2.0


@pytest.fixture(scope="module")
def bag(tmp_path_factory) -> Path:
    return write_synthetic_bag(tmp_path_factory.mktemp("bags") / "synthetic", DURATION_S)


def read_bag(path: Path) -> dict:
    """topic -> (msgtype, [(bag timestamp, deserialised message), ...])."""
    topics: dict = {}
    with AnyReader([path]) as reader:
        for connection, timestamp, raw in reader.messages():
            msg = reader.deserialize(raw, connection.msgtype)
            records = topics.setdefault(connection.topic, (connection.msgtype, []))[1]
            records.append((timestamp, msg))
    return topics


# ---------------------------------------------------------------------------- make_bag


def test_bag_has_expected_topics_counts_and_types(bag):
    topics = read_bag(bag)
    assert set(topics) == {BASE, WRIST, JOINTS}
    assert topics[BASE][0] == topics[WRIST][0] == "sensor_msgs/msg/Image"
    assert topics[JOINTS][0] == "sensor_msgs/msg/JointState"
    assert abs(len(topics[BASE][1]) - 60) <= 2
    assert abs(len(topics[WRIST][1]) - 60) <= 2
    assert abs(len(topics[JOINTS][1]) - 200) <= 2
    assert (bag / "synthetic.mcap").exists()


def test_bag_timestamps_are_monotonic_and_match_header_stamps(bag):
    for topic, (_, records) in read_bag(bag).items():
        stamps = [timestamp for timestamp, _ in records]
        assert stamps[0] == EPOCH_NS, topic
        assert all(later > earlier for earlier, later in zip(stamps, stamps[1:], strict=False)), (
            topic
        )
        for timestamp, msg in records:
            assert msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec == timestamp


def test_bag_images_are_rgb8_and_moving(bag):
    topics = read_bag(bag)
    frames = {}
    for topic in (BASE, WRIST):
        msg = topics[topic][1][0][1]
        assert (msg.width, msg.height, msg.encoding, msg.step) == (224, 224, "rgb8", 672)
        assert msg.header.frame_id == f"camera_{topic.split('/')[2]}_optical_frame"
        first, later = (topics[topic][1][i][1].data for i in (0, 15))
        assert not np.array_equal(first, later), "scene must move"
        frames[topic] = first
    assert not np.array_equal(frames[BASE], frames[WRIST]), "cameras must differ"


def test_bag_joint_states_are_smooth_sinusoids(bag):
    records = read_bag(bag)[JOINTS][1]
    names = [f"joint_{i}" for i in range(1, 8)]
    for timestamp, msg in records[::37]:
        assert list(msg.name) == names
        position, velocity = joint_motion((timestamp - EPOCH_NS) * 1e-9, 7)
        np.testing.assert_allclose(msg.position, position)
        np.testing.assert_allclose(msg.velocity, velocity)
    positions = np.array([msg.position for _, msg in records])
    assert np.abs(np.diff(positions, axis=0)).max() < 0.05  # 10 ms steps of a slow sinusoid


def test_compressed_sqlite3_bag_with_custom_size(tmp_path):
    path = write_synthetic_bag(
        tmp_path / "small",
        0.5,
        width=64,
        height=48,
        num_joints=3,
        compressed=True,
        storage="sqlite3",
        distro="humble",
    )
    topics = read_bag(path)
    assert set(topics) == {BASE + "/compressed", WRIST + "/compressed", JOINTS}
    msgtype, records = topics[BASE + "/compressed"]
    assert msgtype == "sensor_msgs/msg/CompressedImage" and len(records) == 15
    assert "jpeg" in records[0][1].format
    assert list(records[0][1].data[:2]) == [0xFF, 0xD8]  # JPEG start-of-image marker
    assert list(topics[JOINTS][1][0][1].name) == ["joint_1", "joint_2", "joint_3"]
    assert list(path.glob("*.db3"))


def test_make_bag_cli(tmp_path, capsys):
    out = tmp_path / "cli_bag"
    argv = ["--out", str(out), "--duration", "0.2", "--width", "32", "--height", "24"]
    assert make_bag.main(argv) == 0
    assert "wrote" in capsys.readouterr().out
    assert (out / "metadata.yaml").exists()
    assert make_bag.main(argv) == 1  # refuses to overwrite
    assert "exists" in capsys.readouterr().err


def test_make_bag_namespace_puts_every_topic_under_it(tmp_path, capsys):
    out = tmp_path / "r1_bag"
    argv = ["--out", str(out), "--duration", "0.2", "--width", "32", "--height", "24"]
    assert make_bag.main([*argv, "--namespace", "r1", "--distro", "jazzy"]) == 0
    assert "ROS 2 jazzy messages, topics under /r1" in capsys.readouterr().out
    assert set(read_bag(out)) == {"/r1" + BASE, "/r1" + WRIST, "/r1" + JOINTS}
    assert make_bag.camera_topic("base", True, "/fleet/r2/") == "/fleet/r2" + BASE + "/compressed"
    for bad in ("1robot", "r 1", "r1//x", "~/r1"):
        with pytest.raises(SystemExit):
            make_bag.main([*argv[:1], str(tmp_path / "bad"), "--namespace", bad])


def test_default_distro_is_the_one_in_use(monkeypatch):
    monkeypatch.setenv("ROS_DISTRO", "kilted")
    assert make_bag.default_distro() == "kilted"
    monkeypatch.setenv("ROS_DISTRO", "rolling")  # no message store for it: the package default
    assert make_bag.default_distro() == "jazzy"
    monkeypatch.delenv("ROS_DISTRO")
    from oxygen_ros.ros.rclpy_compat import DISTRO_BY_RCLPY_MAJOR

    try:  # the PyPI wheels; a sourced ROS install sets ROS_DISTRO instead
        rclpy_major = int(importlib.metadata.version("ros-rclpy").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("rclpy is not installed from the ros-rclpy wheel")
    assert make_bag.default_distro() == DISTRO_BY_RCLPY_MAJOR[rclpy_major]


def test_make_bag_rejects_bad_arguments(tmp_path):
    with pytest.raises(SystemExit):
        make_bag.main(["--out", str(tmp_path / "x"), "--duration", "-1"])
    with pytest.raises(ValueError):
        write_synthetic_bag(tmp_path / "y", 1.0, width=0)


# ---------------------------------------------------------------------------- replay helpers


def test_message_class_resolves_type_names():
    assert replay.message_class("sensor_msgs/msg/Image") is Image
    assert replay.message_class("sensor_msgs/JointState") is JointState
    assert replay.message_class("no_such_msgs/msg/Thing") is None
    assert replay.message_class("sensor_msgs/msg/NoSuchType") is None
    assert replay.message_class("garbage") is None


def test_qos_sensor_data_for_images_reliable_otherwise():
    assert replay.qos_for("sensor_msgs/msg/Image").reliability == ReliabilityPolicy.BEST_EFFORT
    assert replay.qos_for("sensor_msgs/msg/CompressedImage") is qos_profile_sensor_data
    qos = replay.qos_for("sensor_msgs/msg/JointState")
    assert qos.reliability == ReliabilityPolicy.RELIABLE
    assert qos.depth == replay.RELIABLE_HISTORY_DEPTH >= 100


def test_restamp_patch_changes_only_the_stamp():
    msg = JointState(name=["a", "b"], position=[1.0, 2.0])
    msg.header.stamp.sec, msg.header.stamp.nanosec = 5, 6
    msg.header.frame_id = "base"
    original = serialize_message(msg)
    restamp = replay.restamper_for(JointState)
    patched = restamp(original, 1_800_000_000, 123_456_789)
    msg.header.stamp.sec, msg.header.stamp.nanosec = 1_800_000_000, 123_456_789
    assert deserialize_message(patched, JointState) == msg
    # Byte-for-byte, only the 8 stamp bytes after the 4-byte CDR header may differ. (Comparing
    # with a fresh serialize_message is wrong: CDR alignment padding is uninitialised memory.)
    assert len(patched) == len(original)
    assert patched[:4] == original[:4] and patched[12:] == original[12:]
    assert patched[4:12] != original[4:12]
    assert replay.restamper_for(String) is None


# ---------------------------------------------------------------------------- replay into ROS


@pytest.fixture
def ros_context():
    context = rclpy.Context()
    rclpy.init(context=context)
    yield context
    context.shutdown()


class Recorder:
    """Subscribes to the bag's topics and spins in a background thread."""

    def __init__(self, context, topics=(BASE, WRIST, JOINTS)) -> None:
        self.node = rclpy.create_node("bag_tools_recorder", context=context)
        self.received = defaultdict(list)  # topic -> [message]
        for topic in topics:
            # Joint states: a history as deep as the bag, so a slow spin loses nothing.
            msg_type, qos = (
                (Image, qos_profile_sensor_data) if "camera" in topic else (JointState, 1000)
            )
            self.node.create_subscription(msg_type, topic, self._callback(topic), qos)
        self._executor = SingleThreadedExecutor(context=context)
        self._executor.add_node(self.node)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()

    def _callback(self, topic):
        return lambda msg: self.received[topic].append(msg)

    def _spin(self) -> None:
        while not self._stop.is_set():
            self._executor.spin_once(timeout_sec=0.05)

    def wait_for(self, topic: str, count: int, timeout_s: float = 3.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.received[topic]) < count and time.monotonic() < deadline:
            time.sleep(0.02)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._executor.shutdown()
        self.node.destroy_node()


@pytest.fixture
def recorder(ros_context):
    rec = Recorder(ros_context)
    yield rec
    rec.close()


@pytest.fixture
def player_node(ros_context):
    node = rclpy.create_node("bag_tools_player", context=ros_context)
    yield node
    node.destroy_node()


@pytest.mark.ros
def test_replay_at_4x_reaches_subscribers_with_fresh_stamps(bag, recorder, player_node):
    player = BagPlayer(player_node, bag, rate=4.0)
    assert player.topics == sorted([BASE, WRIST, JOINTS])
    assert player.wait_for_subscribers(10.0)
    started = time.monotonic()
    published = player.play()
    elapsed = time.monotonic() - started
    recorder.wait_for(JOINTS, 200)

    assert published == 320
    expected = player.duration_s / 4
    assert 0.15 * expected <= elapsed <= 3 * expected
    joints = recorder.received[JOINTS]
    assert len(joints) >= 180  # reliable QoS: normally all 200
    assert len(recorder.received[BASE]) >= 30 and len(recorder.received[WRIST]) >= 30

    now = time.time()
    for msg in (joints[0], joints[-1], recorder.received[BASE][-1]):
        assert abs(stamp_to_seconds(msg.header.stamp) - now) < 30  # restamped to current time
    position, _ = joint_motion(0.0, 7)
    np.testing.assert_allclose(joints[0].position, position)  # payload unchanged
    assert image_to_rgb(recorder.received[WRIST][-1]).shape == (224, 224, 3)


@pytest.mark.ros
def test_replay_keep_stamps_and_topic_filter(bag, ros_context, player_node):
    recorder = Recorder(ros_context, topics=(JOINTS,))
    try:
        player = BagPlayer(player_node, bag, rate=20.0, topics=[JOINTS], restamp=False)
        assert player.topics == [JOINTS]
        assert player.wait_for_subscribers(10.0)
        assert player.play() == 200
        recorder.wait_for(JOINTS, 200)
    finally:
        recorder.close()
    stamps = [
        msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec for msg in recorder.received[JOINTS]
    ]
    assert len(stamps) >= 180
    assert stamps[0] == EPOCH_NS
    assert all(later > earlier for earlier, later in zip(stamps, stamps[1:], strict=False))


@pytest.mark.ros
def test_replay_into_a_namespace(bag, ros_context, player_node):
    recorder = Recorder(ros_context, topics=("/r1" + JOINTS, JOINTS))
    try:
        player = BagPlayer(player_node, bag, rate=20.0, topics=[JOINTS], namespace="r1")
        assert player.topics == ["/r1" + JOINTS]
        assert player.wait_for_subscribers(10.0)
        assert player.play() == 200
        recorder.wait_for("/r1" + JOINTS, 180)
    finally:
        recorder.close()
    assert len(recorder.received["/r1" + JOINTS]) >= 180
    assert recorder.received[JOINTS] == []  # nothing left on the bag's own name


@pytest.mark.ros
def test_replay_under_sim_time_stamps_the_time_on_clock(bag, ros_context, ros_env):
    """use_sim_time: the player's clock follows /clock (its node is spun), it waits for the first
    /clock message, and the stamps it writes are sim time, not 0 and not the wall clock."""
    from rosgraph_msgs.msg import Clock

    sim_s = 1234
    clock_node = rclpy.create_node("bag_tools_clock", context=ros_context)
    clock_pub = clock_node.create_publisher(Clock, "/clock", 10)
    recorder = Recorder(ros_context, topics=(JOINTS,))
    command = [
        sys.executable,
        "-m",
        "oxygen_ros.tools.replay",
        str(bag),
        "--topics",
        JOINTS,
        "--rate",
        "4",
        "--ros-args",
        "-p",
        "use_sim_time:=true",
    ]
    process = subprocess.Popen(
        command, cwd=REPO, env=ros_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 60
        while process.poll() is None and time.monotonic() < deadline:
            elapsed_ns = int((time.monotonic() % 1.0) * 1e9)
            clock_pub.publish(Clock(clock=Time(sec=sim_s, nanosec=elapsed_ns)))
            time.sleep(0.01)
        out, err = process.communicate(timeout=10)
        recorder.wait_for(JOINTS, 150)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        recorder.close()
        clock_node.destroy_node()
    assert process.returncode == 0, err
    assert "waiting for /clock" in err and "published 200 messages" in out
    stamps = [msg.header.stamp.sec for msg in recorder.received[JOINTS]]
    assert len(stamps) >= 150
    assert set(stamps) == {sim_s}, sorted(set(stamps))[:5]


@pytest.mark.ros
def test_loop_plays_until_stopped(bag, player_node):
    player = BagPlayer(player_node, bag, rate=40.0, loop=True, topics=[JOINTS])
    stop = threading.Event()
    result = []
    thread = threading.Thread(target=lambda: result.append(player.play(stop)))
    thread.start()
    time.sleep(0.4)  # one pass takes ~0.05 s
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert result[0] > 200


@pytest.mark.ros
def test_player_rejects_bad_rate_and_unknown_topics(bag, player_node):
    with pytest.raises(ValueError):
        BagPlayer(player_node, bag, rate=0.0)
    with pytest.raises(ValueError, match="nothing to play"):
        BagPlayer(player_node, bag, topics=["/not/in/bag"])


@pytest.mark.ros
def test_replay_cli_subprocess(bag, ros_env):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "oxygen_ros.tools.replay",
            str(bag),
            "--rate",
            "20",
            "--topics",
            JOINTS,
            BASE,
        ],
        cwd=REPO,
        env=ros_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "published 260 messages on 2 topic(s)" in result.stdout


@pytest.mark.ros
def test_replay_cli_reports_missing_bag(tmp_path, ros_env):
    result = subprocess.run(
        [sys.executable, "-m", "oxygen_ros.tools.replay", str(tmp_path / "missing")],
        cwd=REPO,
        env=ros_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "cannot play" in result.stderr
