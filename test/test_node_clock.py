"""One clock: with ``use_sim_time`` (a rosbag replayed with /clock) stamps and ages follow the
simulated ROS time, while the loop's timer, language budget and deadlines stay on steady time.

The node runs in this process; a second node publishes /clock in slow motion (a quarter of real
time, starting at 1000 s) and camera + joint messages stamped with that simulated time. A timer on
the ROS clock would tick at a quarter of rate_hz and frame times would mix 1000 s of simulated time
with steady time; neither may happen.

The same node asks for rate_hz 200 with a 6 ms decode margin, which no tick can hold (the margin
plus any action exceeds the 5 ms period): warm-up says so on /diagnostics and adapt starts lower.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from node_harness import stamp_ns, wait_for
from rclpy.clock import ClockType
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter
from rosgraph_msgs.msg import Clock as ClockMsg
from sensor_msgs.msg import Image, JointState

from oxygen_ros.msg import ActionChunk
from oxygen_ros.ros.convert import rgb_to_image
from oxygen_ros.ros.node import OxygenNode, spin_forever

pytestmark = [pytest.mark.ros, pytest.mark.slow]
SIM_START_S = 1000.0
SIM_SPEED = 0.25
RATE_HZ = 200.0
MARGIN_MS = 6.0


class SimClock:
    """Simulated time: SIM_START_S + SIM_SPEED * (steady time since start)."""

    def __init__(self) -> None:
        self._t0 = time.monotonic()

    def now_ns(self) -> int:
        return int((SIM_START_S + SIM_SPEED * (time.monotonic() - self._t0)) * 1e9)


@pytest.fixture(scope="module")
def sim(tiny_checkpoint):
    context = rclpy.Context()
    rclpy.init(context=context)
    node = OxygenNode(
        "oxygen_clock_test",
        context=context,
        parameter_overrides=[
            Parameter("use_sim_time", value=True),
            Parameter("checkpoint_dir", value=str(tiny_checkpoint)),
            Parameter("rate_hz", value=RATE_HZ),
            Parameter("decode_margin_ms", value=MARGIN_MS),
            Parameter("camera_topics", value=["/clock_test/camera"]),
            Parameter("camera_slots", value=["base_0_rgb"]),
            Parameter("joint_names", value=["j1", "j2"]),
            Parameter("narration_period_s", value=0.0),
            Parameter("max_observation_age_s", value=1.0),
            Parameter("autostart", value=False),
        ],
    )
    feeder = rclpy.create_node("clock_test_feeder", context=context)
    clock = SimClock()
    clock_pub = feeder.create_publisher(ClockMsg, "/clock", 10)
    camera = feeder.create_publisher(Image, "/clock_test/camera", 10)
    joints = feeder.create_publisher(JointState, "joint_states", 10)

    def publish_clock():
        ns = clock.now_ns()
        clock_pub.publish(ClockMsg(clock=rclpy.time.Time(nanoseconds=ns).to_msg()))

    def feed():
        stamp = rclpy.time.Time(nanoseconds=clock.now_ns()).to_msg()
        camera.publish(rgb_to_image(np.full((32, 32, 3), 100, np.uint8), stamp, "cam"))
        state = JointState(name=["j1", "j2"], position=[0.1, -0.1])
        state.header.stamp = stamp
        joints.publish(state)

    feeder.create_timer(0.01, publish_clock)
    feeder.create_timer(0.05, feed)
    chunks = []  # (steady receive time, message)
    feeder.create_subscription(
        ActionChunk,
        "/oxygen_clock_test/action_chunk",
        lambda m: chunks.append((time.monotonic(), m)),
        100,
    )
    loop_status = []

    def on_diagnostics(msg):
        for status in msg.status:
            if status.name.startswith("oxygen_clock_test: action loop"):
                loop_status.append(
                    (status.level, status.message, {kv.key: kv.value for kv in status.values})
                )

    feeder.create_subscription(DiagnosticArray, "/diagnostics", on_diagnostics, 10)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(feeder)
    executor.add_node(node)
    thread = threading.Thread(
        target=spin_forever, args=(executor, node.record_executor_error), daemon=True
    )
    thread.start()
    assert wait_for(lambda: node.get_clock().now().nanoseconds >= SIM_START_S * 1e9, 10), (
        "no /clock"
    )
    assert node.start(), "configure/activate failed"
    yield node, clock, chunks, loop_status
    executor.shutdown()
    thread.join(timeout=5)
    node.release()
    node.destroy_node()
    feeder.destroy_node()
    context.try_shutdown()


def test_stamps_and_ages_are_sim_time_and_frame_times_are_steady(sim):
    node, clock, chunks, _ = sim
    assert wait_for(lambda: len(chunks) >= 10, 30), "no chunks under use_sim_time"
    since = time.monotonic()
    time.sleep(0.5)
    recent = [m for t, m in list(chunks) if t >= since]
    assert recent
    for msg in recent:
        stamp = stamp_ns(msg.header.stamp)
        assert SIM_START_S * 1e9 < stamp <= clock.now_ns()  # the simulated stamp of an input
        # simulated now - simulated stamp; /clock comes every 10 ms (2.5 ms simulated), so an input
        # may be stamped up to that far ahead of the node's latest /clock
        assert -0.01 < msg.observation_age < 1.0
        assert 0.0 < msg.frame_ms < 1000.0  # steady time only: no 1000 s offset mixed in


def test_the_loop_runs_on_steady_time_while_sim_time_crawls(sim):
    """In 4 s of steady time the simulated clock advances 1 s. A timer on the ROS clock could
    tick at most ~1 s x the effective rate; the steady one ticks about four times as often on an
    idle machine, and still well over half again as often on one running two test suites
    (measured 65 chunks against at most 35)."""
    node, clock, chunks, _ = sim
    rate = node._loop.governor.effective_hz
    sim_before, since = clock.now_ns(), time.monotonic()
    time.sleep(4.0)
    sim_elapsed_s = (clock.now_ns() - sim_before) / 1e9
    published = len([1 for t, _ in list(chunks) if t >= since])
    assert sim_elapsed_s == pytest.approx(SIM_SPEED * 4.0, rel=0.2)
    assert node._timer.clock.clock_type == ClockType.STEADY_TIME
    assert published > 1.5 * (sim_elapsed_s * rate + 1), (published, rate)


def test_an_infeasible_rate_is_reported_with_its_measured_cost(sim):
    node, _, _, loop_status = sim
    seen = len(loop_status)
    assert wait_for(lambda: len(loop_status) > seen, 5)
    level, message, values = loop_status[-1]
    assert values["rate_feasible"] == "false"
    assert float(values["warmup_tick_ms"]) > MARGIN_MS > 1e3 / RATE_HZ
    assert float(values["requested_rate_hz"]) == RATE_HZ
    assert float(values["warmup_holdable_rate_hz"]) < RATE_HZ
    # the governor follows the ticks measured since warm-up, which may run faster or slower
    assert float(values["effective_rate_hz"]) < RATE_HZ
    assert level == DiagnosticStatus.WARN and f"of the requested {RATE_HZ:g} Hz" in message
