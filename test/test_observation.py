"""oxygen_ros.ros.observation: latest-message store and per-tick assembly (messages, no DDS)."""

from __future__ import annotations

import numpy as np
import pytest
from builtin_interfaces.msg import Time
from sensor_msgs.msg import Image, JointState

from oxygen_ros.engine.counters import Counters
from oxygen_ros.ros.convert import rgb_to_image
from oxygen_ros.ros.observation import JOINT_STATES_TOPIC, ObservationAssembler
from oxygen_ros.ros.params import CameraInput

NS = 1_000_000_000
NOW_NS = 1_700_000_000 * NS
JOINTS = ["a", "b"]
CAMERAS = [
    CameraInput("/cam/base", "base_0_rgb", False),
    CameraInput("/cam/wrist", "left_wrist_0_rgb", False),
]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stamp(ns: int) -> Time:
    return Time(sec=ns // NS, nanosec=ns % NS)


def image(ns: int, encoding: str = "rgb8") -> Image:
    msg = rgb_to_image(np.zeros((8, 8, 3), np.uint8), stamp(ns), "cam")
    msg.encoding = encoding
    return msg


def joints(ns: int, positions=(0.1, 0.2), names=JOINTS) -> JointState:
    msg = JointState(name=list(names), position=[float(p) for p in positions])
    msg.header.stamp = stamp(ns)
    return msg


@pytest.fixture
def setup():
    counters, warnings, clock = Counters(), [], FakeClock()
    assembler = ObservationAssembler(
        CAMERAS, JOINTS, counters, lambda key, msg: warnings.append(msg), clock
    )
    return assembler, counters, warnings, clock


def test_fresh_inputs_make_an_observation_stamped_with_the_newest_input(setup):
    assembler, counters, _, _ = setup
    assembler.latest["/cam/base"].store(image(NOW_NS - 30_000_000))
    assembler.latest["/cam/wrist"].store(image(NOW_NS - 20_000_001))
    assembler.latest[JOINT_STATES_TOPIC].store(joints(NOW_NS - 25_000_000))
    result = assembler.assemble("task", 0.5, NOW_NS)
    assert result.observation is not None and result.stamp_ns == NOW_NS - 20_000_001
    assert sorted(result.observation.images) == ["base_0_rgb", "left_wrist_0_rgb"]
    assert result.observation.state.tolist() == pytest.approx([0.1, 0.2])
    assert counters.snapshot() == {}


def test_a_missing_camera_is_masked_and_counted(setup):
    assembler, counters, _, _ = setup
    assembler.latest["/cam/base"].store(image(NOW_NS))
    assembler.latest[JOINT_STATES_TOPIC].store(joints(NOW_NS))
    result = assembler.assemble("task", 0.5, NOW_NS)
    assert list(result.observation.images) == ["base_0_rgb"] and result.masked == ["/cam/wrist"]
    assert counters.get("camera_masked") == 1 and assembler.masked_ticks["/cam/wrist"] == 1


def test_no_joint_state_or_no_camera_means_no_observation(setup):
    assembler, _, _, _ = setup
    assert assembler.assemble("task", 0.5, NOW_NS).reason == "no_joint_state"
    assembler.latest[JOINT_STATES_TOPIC].store(joints(NOW_NS))
    result = assembler.assemble("task", 0.5, NOW_NS)
    assert (
        result.observation is None
        and result.reason == "no_camera"
        and "never received" in result.detail
    )


def test_stale_inputs_give_no_observation(setup):
    assembler, counters, warnings, clock = setup
    assembler.latest["/cam/base"].store(image(NOW_NS))
    assembler.latest[JOINT_STATES_TOPIC].store(joints(NOW_NS))
    clock.now += 0.6  # received 0.6 s ago
    result = assembler.assemble("task", 0.5, NOW_NS + 600_000_000)
    assert result.observation is None and result.reason == "stale_joint_state"
    assert counters.get("stale_inputs") == 2 and any("stale" in w for w in warnings)
    old = assembler.assemble("task", 0.5, NOW_NS + 10 * NS)  # counted once per message
    assert old.observation is None and counters.get("stale_inputs") == 2


def test_header_stamps_older_than_the_limit_are_stale_even_when_just_received(setup):
    assembler, _, _, _ = setup
    assembler.latest["/cam/base"].store(image(NOW_NS))
    assembler.latest[JOINT_STATES_TOPIC].store(joints(NOW_NS - 2 * NS))
    assert assembler.assemble("task", 0.5, NOW_NS).reason == "stale_joint_state"


def test_bad_messages_are_counted_once_and_the_last_good_value_is_kept(setup):
    assembler, counters, warnings, _ = setup
    assembler.latest["/cam/base"].store(image(NOW_NS - 2))
    assembler.latest[JOINT_STATES_TOPIC].store(joints(NOW_NS - 2))
    assert assembler.assemble("t", 0.5, NOW_NS).observation is not None
    assembler.latest["/cam/base"].store(image(NOW_NS - 1, encoding="yuv422"))
    assembler.latest[JOINT_STATES_TOPIC].store(joints(NOW_NS - 1, positions=(np.nan, 0.0)))
    for _ in range(3):
        result = assembler.assemble("t", 0.5, NOW_NS)
        assert result.observation is not None and result.stamp_ns == NOW_NS - 2
    assert counters.get("image_unsupported_encoding") == 1 and counters.get("joint_non_finite") == 1
    assert any("/cam/base" in w and "yuv422" in w for w in warnings)


def test_duplicates_and_backward_stamps_are_dropped_and_big_jumps_accepted(setup):
    assembler, counters, _, _ = setup
    latest = assembler.latest[JOINT_STATES_TOPIC]
    latest.reset_after_s = 1.0
    latest.store(joints(NOW_NS))
    latest.store(joints(NOW_NS))  # duplicate
    latest.store(joints(NOW_NS - 100_000_000))  # 0.1 s back: out of order
    assert latest.sample.stamp == NOW_NS and latest.received == 1
    latest.store(joints(NOW_NS - 5 * NS))  # 5 s back: the source restarted
    assert latest.sample.stamp == NOW_NS - 5 * NS
    assert counters.snapshot() == {"duplicate_messages": 1, "stamp_backwards": 1, "stamp_resets": 1}
