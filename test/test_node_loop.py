"""The node's loop in this process: it survives exceptions and counts overruns and late ticks.

The node runs in this test's process (its own rclpy context and executor thread) so the test can
make the engine fail or stall on purpose; inputs still travel over DDS from a second node.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String

from node_harness import wait_for
from oxygen_ros.msg import ActionChunk
from oxygen_ros.ros.convert import rgb_to_image
from oxygen_ros.ros.node import OxygenNode, spin_forever

pytestmark = [pytest.mark.ros, pytest.mark.slow]
RATE_HZ = 10.0


@pytest.fixture(scope="module")
def running(tiny_checkpoint, tmp_path_factory):
    checkpoint = tiny_checkpoint
    context = rclpy.Context()
    rclpy.init(context=context)
    node = OxygenNode("oxygen_loop_test", context=context, parameter_overrides=[
        Parameter("checkpoint_dir", value=str(checkpoint)),
        Parameter("rate_hz", value=RATE_HZ),
        Parameter("camera_topics", value=["/loop_test/camera"]),
        Parameter("camera_slots", value=["base_0_rgb"]),
        Parameter("joint_names", value=["j1", "j2"]),
        Parameter("narration_period_s", value=0.0),
        Parameter("max_observation_age_s", value=1.0),
        Parameter("autostart", value=False),
    ])
    assert node.start(), "configure/activate failed"
    feeder = rclpy.create_node("loop_test_feeder", context=context)
    camera = feeder.create_publisher(Image, "/loop_test/camera", 10)
    joints = feeder.create_publisher(JointState, "joint_states", 10)
    chunks = []
    feeder.create_subscription(ActionChunk, "/oxygen_loop_test/action_chunk", chunks.append, 10)
    instruction = feeder.create_publisher(String, "/oxygen_loop_test/instruction", 10)

    def feed():
        stamp = _now(feeder)
        camera.publish(rgb_to_image(np.full((32, 32, 3), 100, np.uint8), stamp, "cam"))
        state = JointState(name=["j1", "j2"], position=[0.1, -0.1])
        state.header.stamp = stamp
        joints.publish(state)

    feeder.create_timer(0.05, feed)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    executor.add_node(feeder)
    # The loop `oxygen_node` runs: errors raised inside the executor are reported to the node.
    thread = threading.Thread(target=spin_forever, args=(executor, node.record_executor_error), daemon=True)
    thread.start()
    yield node, chunks, instruction, feeder
    executor.shutdown()
    thread.join(timeout=5)
    assert not thread.is_alive(), "spin_forever did not return after the executor shut down"
    node.release()
    node.destroy_node()
    feeder.destroy_node()
    context.try_shutdown()


def _now(node):
    return node.get_clock().now().to_msg()


def test_tick_exceptions_are_counted_and_the_loop_continues(running):
    node, chunks, *_ = running
    assert wait_for(lambda: len(chunks) >= 3, 20)
    engine = node._engine
    act = engine.act
    failures = []

    def failing_act(observation):
        if len(failures) < 3:
            failures.append(1)
            raise RuntimeError("injected failure")
        return act(observation)

    engine.act = failing_act
    try:
        assert wait_for(lambda: len(failures) == 3, 10)
        count = len(chunks)
        assert wait_for(lambda: len(chunks) >= count + 3, 10), "no chunks after the failures"
    finally:
        engine.act = act
    assert node._counters.get("no_action_engine_error") == 3
    assert node._counters.get("tick_exceptions") == 0


def test_an_overrun_is_counted_and_the_next_tick_is_not_skipped_silently(running):
    node, chunks, *_ = running
    engine = node._engine
    act = engine.act
    stalled = []

    def slow_act(observation):
        if not stalled:
            stalled.append(1)
            time.sleep(0.35)  # 3.5 periods at 10 Hz
        return act(observation)

    engine.act = slow_act
    try:
        assert wait_for(lambda: stalled and node._counters.get("tick_overruns") >= 1, 10)
        count = len(chunks)
        assert wait_for(lambda: len(chunks) >= count + 3, 10)
    finally:
        engine.act = act
    counts = node._counters.snapshot()
    assert counts["deadline_misses"] >= 1 and counts["late_ticks"] >= 1 and counts["skipped_periods"] >= 2


def test_an_empty_instruction_is_rejected_and_counted(running):
    node, _, instruction, _ = running
    instruction.publish(String(data="  "))
    assert wait_for(lambda: node._counters.get("instruction_rejected_empty") == 1, 5)
    assert node.get_parameter("task").value == "pick up the red block"


def test_an_error_inside_the_executor_is_counted_and_spinning_goes_on(running):
    """Any callback error escaping rclpy's executor (here a feeder timer that raises) must not end
    the spin loop that also drives the node's action timer."""
    node, chunks, _, feeder = running
    raised = []

    def explode():
        if len(raised) < 2:
            raised.append(1)
            raise RuntimeError("injected executor error")

    timer = feeder.create_timer(0.05, explode)
    try:
        assert wait_for(lambda: node._counters.get("executor_errors") == 2, 10)
        count = len(chunks)
        assert wait_for(lambda: len(chunks) >= count + 3, 10), "no chunks after the executor errors"
    finally:
        feeder.destroy_timer(timer)
