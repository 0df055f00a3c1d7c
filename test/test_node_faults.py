"""Reliability and safety of the running node: bad and missing inputs, out-of-order stamps, stale
sensors, corrupt checkpoints, dry run and joint limits.

Every case goes through a real ``oxygen_node`` process over DDS. Bad inputs come from a bag written
with ``rosbags`` (bad encodings, truncated data, wrong step, corrupt jpeg, NaN and missing joints, a
camera that stops) or, where exact header stamps matter, are published by the test. Each test
checks the counter in /diagnostics AND that valid chunks keep flowing afterwards.
"""

from __future__ import annotations

import io
import math
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from builtin_interfaces.msg import Time
from lifecycle_msgs.msg import Transition
from node_harness import STATE_INACTIVE, STATE_UNCONFIGURED, NodeProcess, Probe, wait_for
from PIL import Image as PILImage
from rclpy.parameter import Parameter
from rclpy.qos import qos_profile_sensor_data
from rosbags.rosbag2 import StoragePlugin, Writer
from sensor_msgs.msg import CompressedImage

from oxygen_ros.tools.make_bag import joint_names, message_store, write_synthetic_bag

pytestmark = [pytest.mark.ros, pytest.mark.slow]

BASE, WRIST, RIGHT = (
    "/camera/base/image_raw",
    "/camera/wrist/image_raw",
    "/camera/right/image_raw/compressed",
)
JOINTS = joint_names(7)
MAX_AGE_S = 0.5
FAULT_BAG_S = 6.0


# ----------------------------------------------------------------------------------------------
# A bag full of faults
# ----------------------------------------------------------------------------------------------


class _BagBuilder:
    """Serialises messages with a rosbags typestore (the definitions of the distribution in use)."""

    def __init__(self) -> None:
        self.store = message_store()
        t = self.store.types
        self._time, self._header = t["builtin_interfaces/msg/Time"], t["std_msgs/msg/Header"]
        self._image, self._compressed = (
            t["sensor_msgs/msg/Image"],
            t["sensor_msgs/msg/CompressedImage"],
        )
        self._joints = t["sensor_msgs/msg/JointState"]

    def _head(self, ns: int) -> object:
        return self._header(stamp=self._time(sec=ns // 10**9, nanosec=ns % 10**9), frame_id="cam")

    def image(
        self,
        ns: int,
        encoding: str = "rgb8",
        width: int = 64,
        height: int = 48,
        step: int | None = None,
        data: np.ndarray | None = None,
    ) -> bytes:
        step = width * 3 if step is None else step
        if data is None:
            data = np.random.default_rng(ns % 2**32).integers(0, 255, height * step, dtype=np.uint8)
        msg = self._image(
            header=self._head(ns),
            height=height,
            width=width,
            encoding=encoding,
            is_bigendian=0,
            step=step,
            data=data,
        )
        return bytes(self.store.serialize_cdr(msg, msg.__msgtype__))

    def jpeg(self, ns: int, corrupt: bool = False) -> bytes:
        buffer = io.BytesIO()
        PILImage.fromarray(np.full((48, 64, 3), 90, dtype=np.uint8)).save(buffer, format="JPEG")
        data = buffer.getvalue()
        if corrupt:  # a valid JPEG header followed by garbage
            data = data[:20] + bytes(np.random.default_rng(1).integers(0, 255, 400, dtype=np.uint8))
        msg = self._compressed(
            header=self._head(ns), format="jpeg", data=np.frombuffer(data, dtype=np.uint8)
        )
        return bytes(self.store.serialize_cdr(msg, msg.__msgtype__))

    def joints(self, ns: int, names=JOINTS, positions=None) -> bytes:
        positions = (
            np.linspace(-0.2, 0.2, len(names))
            if positions is None
            else np.asarray(positions, float)
        )
        msg = self._joints(
            header=self._head(ns),
            name=list(names),
            position=positions,
            velocity=np.zeros(0),
            effort=np.zeros(0),
        )
        return bytes(self.store.serialize_cdr(msg, msg.__msgtype__))


def _between(t: float, start: float, end: float) -> bool:
    return start <= t < end


def write_fault_bag(path: Path) -> Path:
    """6 s: base camera always good; the wrist camera sends an unsupported encoding, truncated data,
    a too-small step and zero-size images, then good images, then stops at 4 s; the compressed
    camera sends corrupt jpeg for 0.5 s; joint states carry NaN, missing joints and short position
    arrays in 0.2 s windows (shorter than max_observation_age_s, so actions keep flowing)."""
    b = _BagBuilder()
    events = []
    for i in range(int(FAULT_BAG_S * 20)):  # cameras at 20 Hz
        t = i / 20
        ns = int(t * 1e9)
        events.append((ns, BASE, b.image(ns)))
        if _between(t, 1.0, 1.5):
            events.append((ns, WRIST, b.image(ns, encoding="yuv422")))
        elif _between(t, 1.5, 2.0):
            events.append(
                (ns, WRIST, b.image(ns, data=np.zeros(48 * 64 * 3 - 500, dtype=np.uint8)))
            )
        elif _between(t, 2.0, 2.5):
            events.append((ns, WRIST, b.image(ns, step=100)))  # < 64 * 3
        elif _between(t, 2.5, 3.0):
            events.append(
                (ns, WRIST, b.image(ns, width=0, height=0, data=np.zeros(0, dtype=np.uint8)))
            )
        elif t < 4.0:
            events.append((ns, WRIST, b.image(ns)))
        events.append((ns, RIGHT, b.jpeg(ns, corrupt=_between(t, 2.5, 3.0))))
    for i in range(int(FAULT_BAG_S * 50)):  # joints at 50 Hz
        t = i / 50
        ns = int(t * 1e9) + 1
        if _between(t, 3.0, 3.2):
            raw = b.joints(ns, positions=[0.1, math.nan, 0.0, 0.0, 0.0, 0.0, 0.0])
        elif _between(t, 3.4, 3.6):
            raw = b.joints(ns, names=JOINTS[:5], positions=np.zeros(5))
        elif _between(t, 3.8, 4.0):
            raw = b.joints(ns, positions=np.zeros(4))  # 7 names, 4 positions
        else:
            raw = b.joints(ns)
        events.append((ns, "/joint_states", raw))
    types = {
        BASE: "sensor_msgs/msg/Image",
        WRIST: "sensor_msgs/msg/Image",
        RIGHT: "sensor_msgs/msg/CompressedImage",
        "/joint_states": "sensor_msgs/msg/JointState",
    }
    with Writer(path, version=Writer.VERSION_LATEST, storage_plugin=StoragePlugin.MCAP) as writer:
        connections = {
            topic: writer.add_connection(topic, kind, typestore=b.store)
            for topic, kind in types.items()
        }
        for ns, topic, raw in sorted(events, key=lambda e: e[0]):
            writer.write(connections[topic], ns, raw)
    return path


# ----------------------------------------------------------------------------------------------
# Fixtures: one node for the input and safety cases
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_bag(tmp_path_factory):
    return write_synthetic_bag(tmp_path_factory.mktemp("good") / "bag", duration_s=3.0)


@pytest.fixture(scope="module")
def fault_bag(tmp_path_factory):
    return write_fault_bag(tmp_path_factory.mktemp("faults") / "bag")


def _params(checkpoint: Path, **extra) -> dict:
    return {
        "checkpoint_dir": str(checkpoint),
        "rate_hz": 15.0,
        "camera_topics": [BASE, WRIST, RIGHT],
        "camera_slots": ["base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"],
        "joint_names": JOINTS,
        "max_observation_age_s": MAX_AGE_S,
        "narration_period_s": 0.0,
        **extra,
    }


@pytest.fixture(scope="module")
def node(tiny_checkpoint, tmp_path_factory):
    process = NodeProcess(_params(tiny_checkpoint), tmp_path_factory.mktemp("node"))
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture(scope="module")
def probe(node):
    probe = Probe()
    probe.wait_active(node)
    yield probe
    probe.close()


def _counters_after(probe: Probe, keys, timeout: float = 10.0) -> dict:
    """Fresh /diagnostics once every key has been counted at least once (or the timeout passed)."""
    values = {}

    def counted() -> bool:
        nonlocal values
        values = probe.fresh_diagnostics()
        return all(int(values.get(key, 0)) > 0 for key in keys)

    wait_for(counted, timeout, interval=0.0)
    return values


def _chunks_flow(probe: Probe, count: int = 5, timeout: float = 15.0) -> bool:
    since = time.monotonic()
    return wait_for(lambda: len(probe.chunks_since(since)) >= count, timeout)


# ----------------------------------------------------------------------------------------------
# Bad and missing inputs
# ----------------------------------------------------------------------------------------------


def test_bad_inputs_are_counted_and_chunks_keep_flowing(node, probe, fault_bag):
    player = probe.player(fault_bag)
    assert player.wait_for_subscribers(10)
    started = time.monotonic()
    player.play()
    tail = probe.chunks_since(started + FAULT_BAG_S - 1.5)
    keys = [
        "image_unsupported_encoding",
        "image_truncated_data",
        "image_bad_step",
        "image_zero_size",
        "image_corrupt_compressed",
        "joint_non_finite",
        "joint_missing_joints",
        "joint_length_mismatch",
        "camera_masked",
    ]
    values = _counters_after(probe, keys)
    for key in keys:
        assert int(values.get(key, 0)) > 0, f"{key} not counted: {values}"
    assert int(values[f"masked_ticks {WRIST}"]) > 0  # the wrist camera stopped at 4 s
    assert len(tail) >= 5, f"only {len(tail)} chunks in the last 1.5 s of the fault bag"
    assert all(all(math.isfinite(a) for a in c.actions) for c in tail)
    log = node.log()
    assert f"dropping a message on {WRIST}: Image encoding 'yuv422' is not supported" in log
    assert f"dropping a message on {RIGHT}: CompressedImage" in log


def test_a_burst_at_ten_times_the_bag_rate_is_absorbed(probe, good_bag):
    before = int(probe.fresh_diagnostics().get("received joint_states", 0))
    probe.player(good_bag, rate=10.0).play()  # 3 s of bag in 0.3 s
    assert int(probe.fresh_diagnostics().get("received joint_states", 0)) > before
    with probe.play_in_background(good_bag):
        assert _chunks_flow(probe)
    assert probe.counter("tick_exceptions") == 0


def test_out_of_order_and_duplicate_stamps_are_dropped(probe, good_bag):
    publisher = probe.node.create_publisher(CompressedImage, RIGHT, qos_profile_sensor_data)
    keys = ("duplicate_messages", "stamp_backwards", "stamp_resets")
    before = probe.fresh_diagnostics()
    with probe.play_in_background(good_bag):
        assert _chunks_flow(probe)
        now = probe.node.get_clock().now().nanoseconds
        for offset_s in (
            0.0,
            0.1,
            0.1,
            0.05,
            -10.0,
            0.2,
        ):  # ok, ok, duplicate, backwards, reset, ok
            publisher.publish(_compressed(now + int(offset_s * 1e9)))
            time.sleep(0.5)  # the camera queue holds one message: let the node take each
        values = _counters_after(probe, keys)
        for key in keys:
            assert int(values.get(key, 0)) == int(before.get(key, 0)) + 1, (
                f"{key}: {before} -> {values}"
            )
        assert _chunks_flow(probe), "no chunks after the stamp faults"
    probe.node.destroy_publisher(publisher)


def _compressed(stamp_ns: int) -> CompressedImage:
    buffer = io.BytesIO()
    PILImage.fromarray(np.full((48, 64, 3), 90, dtype=np.uint8)).save(buffer, format="JPEG")
    msg = CompressedImage(format="jpeg")
    msg.header.stamp = Time(sec=stamp_ns // 10**9, nanosec=stamp_ns % 10**9)
    msg.data = buffer.getvalue()
    return msg


def test_stale_inputs_publish_no_chunk(probe, good_bag):
    before = probe.counter("no_action_stale_joint_state")
    time.sleep(MAX_AGE_S + 0.5)  # nothing is published: every input ages out
    since = time.monotonic()
    time.sleep(1.0)
    assert probe.chunks_since(since) == [], "a chunk was published from stale inputs"
    assert probe.counter("no_action_stale_joint_state") > before
    with probe.play_in_background(good_bag):
        assert _chunks_flow(probe), "no chunks once fresh inputs return"


def test_dry_run_publishes_the_chunk_but_no_trajectory(probe, good_bag):
    with probe.play_in_background(good_bag):
        assert probe.set("dry_run", True).successful
        time.sleep(0.3)
        since = time.monotonic()
        assert _chunks_flow(probe)
        assert probe.trajectories_since(since) == []
        assert probe.set("dry_run", False).successful
        since = time.monotonic()
        assert wait_for(lambda: len(probe.trajectories_since(since)) >= 3, 10)


def test_joint_limits_clip_the_published_trajectory(probe, good_bag):
    lower, upper, speed, dt = -0.05, 0.05, 0.5, 0.02
    with probe.play_in_background(good_bag):
        results = probe.set_parameters(
            Parameter("joint_lower_limits", value=[lower] * 7),
            Parameter("joint_upper_limits", value=[upper] * 7),
            Parameter("max_joint_velocity", value=[speed] * 7),
        )
        assert all(r.successful for r in results), [r.reason for r in results]
        time.sleep(0.3)
        since = time.monotonic()
        assert wait_for(lambda: len(probe.trajectories_since(since)) >= 5, 15)
        for trajectory in probe.trajectories_since(since):
            positions = np.array([p.positions for p in trajectory.points])
            assert positions.min() >= lower - 1e-6 and positions.max() <= upper + 1e-6
            assert np.abs(np.diff(positions, axis=0)).max(initial=0.0) <= speed * dt + 1e-6
        assert any(c.clipped_values > 0 for c in probe.chunks_since(since))
        assert probe.counter("clipped_values") > 0
        cleared = probe.set_parameters(
            *(
                Parameter(name, Parameter.Type.DOUBLE_ARRAY, [])
                for name in ("joint_lower_limits", "joint_upper_limits", "max_joint_velocity")
            )
        )
        assert all(r.successful for r in cleared)
        assert _chunks_flow(probe)


# ----------------------------------------------------------------------------------------------
# Corrupt checkpoint: configure fails, the node stays up, a good checkpoint then configures
# ----------------------------------------------------------------------------------------------


def test_corrupt_checkpoint_fails_configure_and_the_node_stays_alive(tiny_checkpoint, tmp_path):
    broken = tmp_path / "broken_ckpt"
    shutil.copytree(tiny_checkpoint, broken)
    (broken / "model.safetensors").write_bytes(b"\xff" * 1000)
    name = "oxygen_broken"
    process = NodeProcess(_params(broken), tmp_path, name=name)
    probe = Probe(target=name)
    try:
        assert wait_for(lambda: "configure failed" in process.log(), 60), process.log()[-3000:]
        assert "not a readable safetensors file" in process.log()
        assert process.alive()
        assert probe.get_state() == STATE_UNCONFIGURED
        assert "not a readable safetensors file" in probe.fresh_diagnostics()["last_error"]
        assert probe.set("checkpoint_dir", str(tiny_checkpoint)).successful
        assert probe.change_state(Transition.TRANSITION_CONFIGURE)
        assert probe.get_state() == STATE_INACTIVE
        assert probe.fresh_diagnostics()["last_error"] == ""
    finally:
        probe.close()
        assert process.stop(signum=signal.SIGTERM) == 0, process.log()[-3000:]


def test_gripper_commit_without_a_gripper_is_refused_and_changes_nothing(probe):
    result = probe.set("gripper_commit", True)
    assert not result.successful
    assert "gripper_commit needs gripper dims" in result.reason
    assert probe.get_parameter("gripper_commit") is False
