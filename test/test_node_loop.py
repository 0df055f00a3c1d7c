"""The node's loop in this process: it survives exceptions, counts overruns and late ticks, counts
engine faults by kind and takes the lifecycle error transition when they persist, adapts its rate
to what ticks can hold, and refuses text it cannot take.

The node runs in this test's process (its own rclpy context and executor thread) so the test can
make the engine fail or stall on purpose (faults from ``FaultInjector`` at the engine's call
boundary, or an engine method that raises); inputs and outputs travel over DDS to a second node.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from lifecycle_msgs.srv import GetState
from node_harness import STATE_UNCONFIGURED, send_request, wait_for
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter
from rclpy.qos import DurabilityPolicy, HistoryPolicy, ReliabilityPolicy, qos_profile_system_default
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory

from oxygen_ros.engine.faults import FaultInjector
from oxygen_ros.engine.kv_cache import KVMemoryError
from oxygen_ros.msg import ActionChunk, Narration
from oxygen_ros.ros.convert import rgb_to_image
from oxygen_ros.ros.node import OxygenNode, spin_forever

pytestmark = [pytest.mark.ros, pytest.mark.slow]
RATE_HZ = 10.0


@pytest.fixture(scope="module")
def running(tiny_checkpoint, tmp_path_factory):
    checkpoint = tiny_checkpoint
    context = rclpy.Context()
    rclpy.init(context=context)
    node = OxygenNode(
        "oxygen_loop_test",
        context=context,
        parameter_overrides=[
            Parameter("checkpoint_dir", value=str(checkpoint)),
            Parameter("rate_hz", value=RATE_HZ),
            Parameter("camera_topics", value=["/loop_test/camera"]),
            Parameter("camera_slots", value=["base_0_rgb"]),
            Parameter("joint_names", value=["j1", "j2"]),
            Parameter("narration_period_s", value=0.0),
            Parameter("max_observation_age_s", value=1.0),
            Parameter("autostart", value=False),
        ],
    )
    assert node.start(), "configure/activate failed"
    feeder = rclpy.create_node("loop_test_feeder", context=context)
    camera = feeder.create_publisher(Image, "/loop_test/camera", 10)
    joints = feeder.create_publisher(JointState, "joint_states", 10)
    chunks = []
    feeder.create_subscription(ActionChunk, "/oxygen_loop_test/action_chunk", chunks.append, 10)
    instruction = feeder.create_publisher(String, "/oxygen_loop_test/instruction", 10)
    # What ros2_control's JointTrajectoryController subscribes with (rclcpp::SystemDefaultsQoS).
    feeder.trajectories = []
    feeder.create_subscription(
        JointTrajectory,
        "/oxygen_loop_test/joint_trajectory",
        feeder.trajectories.append,
        qos_profile_system_default,
    )
    feeder.narrations = []
    feeder.create_subscription(
        Narration, "/oxygen_loop_test/narration", feeder.narrations.append, 100
    )
    feeder.loop_status = []  # (level, message, values) of the node's "action loop" status

    def on_diagnostics(msg):
        for status in msg.status:
            if status.name.startswith("oxygen_loop_test: action loop"):
                feeder.loop_status.append(
                    (status.level, status.message, {kv.key: kv.value for kv in status.values})
                )
            elif status.name.startswith("oxygen_loop_test: counters"):
                feeder.counters_status.append({kv.key: kv.value for kv in status.values})

    feeder.counters_status = []  # values of the node's "counters" status
    feeder.create_subscription(DiagnosticArray, "/diagnostics", on_diagnostics, 10)
    feeder.ask = feeder.create_publisher(String, "/oxygen_loop_test/ask", 10)

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
    thread = threading.Thread(
        target=spin_forever, args=(executor, node.record_executor_error), daemon=True
    )
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
    assert (
        counts["deadline_misses"] >= 1
        and counts["late_ticks"] >= 1
        and counts["skipped_periods"] >= 2
    )


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


# ----------------------------------------------------------------------------------------------
# Engine faults: counted by kind, retried; persistent ones end in the error transition
# ----------------------------------------------------------------------------------------------


class _Replaced:
    """Replaces ``engine.<name>`` with ``wrapper(original)`` until the block ends."""

    def __init__(self, engine, name, wrapper):
        self.engine, self.name = engine, name
        self.original = getattr(engine, name)
        setattr(engine, name, wrapper(self.original))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        setattr(self.engine, self.name, self.original)


def _faulty(injector: FaultInjector, stage: str):
    """An engine method that first asks ``injector`` whether this call fails (InjectedFault)."""

    def wrapper(method):
        def call(*args, **kwargs):
            injector.check(stage)
            return method(*args, **kwargs)

        return call

    return wrapper


def _raising(exc_type, times: int, raised: list):
    """An engine method whose first ``times`` calls raise ``exc_type``."""

    def wrapper(method):
        def call(*args, **kwargs):
            if len(raised) < times:
                raised.append(1)
                raise exc_type("injected")
            return method(*args, **kwargs)

        return call

    return wrapper


def _chunks_keep_flowing(chunks, count: int = 3, timeout: float = 10.0) -> bool:
    start = len(chunks)
    return wait_for(lambda: len(chunks) >= start + count, timeout)


def test_isolated_engine_faults_are_counted_by_kind_and_chunks_keep_flowing(running):
    node, chunks, *_ = running
    assert wait_for(lambda: len(chunks) >= 3, 20)
    before = node._counters.snapshot()
    injector = FaultInjector(at={"action": [2, 5, 8]})  # three failing ticks, never two in a row
    with _Replaced(node._engine, "act", _faulty(injector, "action")):
        assert wait_for(lambda: injector.calls.get("action", 0) >= 10, 10)
    assert injector.raised == {"action": 3}
    kv_raised, decode_raised = [], []
    with _Replaced(node._engine, "act", _raising(KVMemoryError, 2, kv_raised)):
        assert wait_for(lambda: len(kv_raised) == 2, 10)
    with _Replaced(node._engine, "decode", _raising(RuntimeError, 2, decode_raised)):
        assert wait_for(lambda: len(decode_raised) == 2, 10)
    assert _chunks_keep_flowing(chunks), "no chunks after isolated faults"
    after = node._counters.snapshot()
    assert after.get("no_action_engine_error", 0) - before.get("no_action_engine_error", 0) == 3
    assert after.get("no_action_kv_memory", 0) - before.get("no_action_kv_memory", 0) == 2
    assert after.get("decode_errors", 0) - before.get("decode_errors", 0) == 2
    assert after.get("tick_exceptions", 0) == before.get("tick_exceptions", 0)
    assert node.state_label == "active" and node._loop.failing_ticks == 0


def test_rejected_observations_do_not_count_as_engine_failures(running):
    """A model rejecting the observation (ValueError) is the input's fault: however long it lasts
    it is counted, and the node does not go to error."""
    node, chunks, *_ = running
    assert node.set_parameters([Parameter("max_consecutive_failures", value=3)])[0].successful
    rejected = []
    try:
        with _Replaced(node._engine, "act", _raising(ValueError, 6, rejected)):
            assert wait_for(lambda: len(rejected) == 6, 10)
        assert _chunks_keep_flowing(chunks)
    finally:
        assert node.set_parameters([Parameter("max_consecutive_failures", value=30)])[0].successful
    assert node._counters.get("no_action_engine_rejected") >= 6
    assert node.state_label == "active"


def test_a_lost_final_delta_never_leaves_narration_busy(running):
    """Every text publish fails (FaultInjector stage text_publish): each narration's final is lost,
    yet its slot is freed, so narrations keep being submitted and finishing; once publishing
    works again they reach subscribers."""
    node, chunks, _, feeder = running
    assert node.set_parameters(
        [Parameter("narration_max_tokens", value=2), Parameter("narration_period_s", value=0.1)]
    )[0].successful
    finished = node._counters.get("requests_finished")
    try:
        node.faults = FaultInjector(every={"text_publish": 1})
        assert wait_for(lambda: node._counters.get("final_deltas_lost") >= 3, 20), (
            node._counters.snapshot()
        )
        assert node._counters.get("requests_finished") >= finished + 3
        assert node._counters.get("text_publish_errors") >= node._counters.get("final_deltas_lost")
        node.faults = FaultInjector()
        assert wait_for(
            lambda: any(n.final and n.kind == "narration" for n in list(feeder.narrations)), 20
        )
    finally:
        node.faults = FaultInjector()
        assert node.set_parameters([Parameter("narration_period_s", value=0.0)])[0].successful
    assert node.state_label == "active"


def test_a_decode_step_that_raises_as_a_whole_fails_its_requests_not_the_tick(running):
    """The engine's language boundary seen from the node: the decoder's step replaced by one that
    raises (outside every guard inside it) ends the narrations it was serving with a published
    ``failed`` final, nothing escapes ``decode`` (no decode_errors), and chunks and later
    narrations keep coming."""
    node, chunks, _, feeder = running
    assert node.set_parameters(
        [Parameter("narration_max_tokens", value=8), Parameter("narration_period_s", value=0.2)]
    )[0].successful
    before = node._counters.snapshot()
    seen = len(feeder.narrations)
    broke = []
    try:
        with _Replaced(node._engine.decoder, "step", _raising(RuntimeError, 3, broke)):
            assert wait_for(lambda: len(broke) == 3, 20)
        assert wait_for(
            lambda: any(n.final and n.finish_reason == "failed" for n in feeder.narrations[seen:]),
            20,
        )
        assert wait_for(
            lambda: any(
                n.final and n.finish_reason in ("eos", "length") for n in feeder.narrations[seen:]
            ),
            20,
        ), "no narration finished normally after the faults"
        assert _chunks_keep_flowing(chunks)
    finally:
        assert node.set_parameters([Parameter("narration_period_s", value=0.0)])[0].successful
    after = node._counters.snapshot()
    assert after.get("decode_errors", 0) == before.get("decode_errors", 0)
    assert after.get("requests_failed", 0) - before.get("requests_failed", 0) >= 1
    assert node._engine.faults_by_stage.get("decode_step", 0) >= 3
    finals = [n.request_id for n in feeder.narrations[seen:] if n.final]
    assert len(finals) == len(set(finals))  # one final per request
    node._engine.check_memory()


def test_a_task_shortened_to_fit_is_counted_and_logged_throttled(running):
    """A task too long for the prompt that reaches the tokenizer anyway (set here behind the
    set-time check's back) loses task text, never the state: each shortened prompt is counted on
    /diagnostics and reported through the node's throttled logger under one key."""
    node, chunks, _, feeder = running
    warned = []
    real_warn = node._loop._warn

    def recording_warn(key, message):
        warned.append((key, message))
        real_warn(key, message)

    settings = node._settings
    node._loop._warn = recording_warn
    try:
        with node._engine_lock:
            node._settings = dataclasses.replace(
                settings, task="pick up the red cup and place it on the tray " * 12
            )
        assert wait_for(lambda: node._counters.get("prompt_task_shortened") >= 3, 20)
        assert _chunks_keep_flowing(chunks)
    finally:
        with node._engine_lock:
            node._settings = settings
        node._loop._warn = real_warn
    shortened = [message for key, message in warned if key == "prompt:task_shortened"]
    assert shortened  # throttled per key: at most one line per 5 s, however many ticks
    assert "max_token_len 96" in shortened[0] and "the robot state is kept whole" in shortened[0]
    assert wait_for(
        lambda: any(int(c.get("prompt_task_shortened", 0)) >= 3 for c in feeder.counters_status),
        5,
    )


# ----------------------------------------------------------------------------------------------
# Text the node cannot take
# ----------------------------------------------------------------------------------------------


def test_too_long_text_on_ask_and_instruction_is_refused(running):
    node, _, instruction, feeder = running
    assert node.set_parameters([Parameter("max_text_chars", value=20)])[0].successful
    try:
        feeder.ask.publish(String(data="q" * 21))
        assert wait_for(lambda: node._counters.get("ask_rejected_too_long") == 1, 5)
        instruction.publish(String(data="stack all of the cups"))  # 21 characters
        assert wait_for(lambda: node._counters.get("instruction_rejected_too_long") == 1, 5)
        assert node.get_parameter("task").value == "pick up the red block"
        instruction.publish(String(data="stack the cups"))  # 14: accepted
        assert wait_for(lambda: node.get_parameter("task").value == "stack the cups", 5)
    finally:
        assert node.set_parameters(
            [
                Parameter("max_text_chars", value=500),
                Parameter("task", value="pick up the red block"),
            ]
        )[0].successful
    assert node._counters.get("ask_rejected_too_long") == 1


def test_ask_and_instruction_are_refused_while_inactive(running):
    node, chunks, instruction, feeder = running
    assert node.trigger_deactivate().name == "SUCCESS"
    try:
        feeder.ask.publish(String(data="what is on the table?"))
        instruction.publish(String(data="stack the cups"))
        assert wait_for(
            lambda: (
                node._counters.get("ask_rejected_inactive") == 1
                and node._counters.get("instruction_rejected_inactive") == 1
            ),
            5,
        )
        assert list(node._loop.questions) == []
        assert node.get_parameter("task").value == "pick up the red block"
    finally:
        assert node.trigger_activate().name == "SUCCESS"
    assert _chunks_keep_flowing(chunks)


# ----------------------------------------------------------------------------------------------
# Output QoS
# ----------------------------------------------------------------------------------------------


def test_the_trajectory_reaches_a_system_default_subscriber_and_keeps_only_the_newest(running):
    """ros2_control's JointTrajectoryController subscribes with the system-default QoS; the node's
    publisher must match it and hold at most one trajectory (keep-last 1) for delivery."""
    node, *_, feeder = running
    count = len(feeder.trajectories)
    assert wait_for(lambda: len(feeder.trajectories) >= count + 3, 10)
    qos = node._loop.outputs.trajectory.qos_profile
    assert (qos.history, qos.depth) == (HistoryPolicy.KEEP_LAST, 1)
    assert (qos.reliability, qos.durability) == (
        ReliabilityPolicy.RELIABLE,
        DurabilityPolicy.VOLATILE,
    )


# ----------------------------------------------------------------------------------------------
# overrun_policy adapt
# ----------------------------------------------------------------------------------------------


def test_sustained_overrun_lowers_the_rate_visibly_and_it_climbs_back(running):
    """Each act takes >= 100 ms: a tick holds at most 0.75 / 0.1 = 7.5 Hz with room for language,
    so the rate drops to <= 7.5 / 1.1 = 6.8 Hz; once acts are fast again it returns to rate_hz."""
    node, chunks, _, feeder = running

    def slow(method):
        def call(observation):
            time.sleep(0.1)
            return method(observation)

        return call

    changes = node._counters.get("rate_changes")
    with _Replaced(node._engine, "act", slow):
        assert wait_for(lambda: node._loop.governor.effective_hz < RATE_HZ, 20), (
            "the rate was not lowered"
        )
        assert node._loop.governor.effective_hz <= 6.8
        seen = len(feeder.loop_status)
        assert wait_for(
            lambda: any(
                float(v["effective_rate_hz"]) < RATE_HZ for _, _, v in feeder.loop_status[seen:]
            ),
            5,
        )
        level, message, values = [
            s for s in feeder.loop_status[seen:] if float(s[2]["effective_rate_hz"]) < RATE_HZ
        ][0]
        assert level == DiagnosticStatus.WARN and "replanning at" in message
        assert float(values["requested_rate_hz"]) == RATE_HZ
        assert _chunks_keep_flowing(chunks)
    # raising looks at three windows of 30 ticks, measured at the lowered rate
    assert wait_for(lambda: node._loop.governor.effective_hz == RATE_HZ, 60), (
        "the rate did not return to rate_hz"
    )
    assert node._counters.get("rate_changes") >= changes + 2


# ----------------------------------------------------------------------------------------------
# Last: a persistent fault takes the node through the error transition (then it configures again)
# ----------------------------------------------------------------------------------------------


def _lifecycle_state(feeder) -> int:
    """The node's state over its get_state service (asked again when a fresh client's first
    reply is lost, see `node_harness.Probe.call`)."""
    name = "/oxygen_loop_test/get_state"
    client = feeder.create_client(GetState, name)
    try:
        assert client.wait_for_service(timeout_sec=5)
        return send_request(client, name, GetState.Request(), 10.0, tries=4).current_state.id
    finally:
        feeder.destroy_client(client)


def test_a_persistent_engine_fault_ends_in_the_error_transition(running):
    node, chunks, _, feeder = running
    assert node.set_parameters([Parameter("max_consecutive_failures", value=5)])[0].successful
    engine = node._engine
    injector = FaultInjector(every={"action": 1})
    seen = len(feeder.loop_status)
    engine.act = _faulty(injector, "action")(engine.act)
    assert wait_for(lambda: node.state_label == "unconfigured", 15), node._counters.snapshot()
    assert injector.raised["action"] == 5  # exactly the run that ends it
    assert node._engine is None and engine.memory()["bytes_in_use"] == 0  # released, nothing held
    assert _lifecycle_state(feeder) == STATE_UNCONFIGURED
    assert node._counters.get("error_transitions") == 1
    assert wait_for(
        lambda: any(level == DiagnosticStatus.ERROR for level, _, _ in feeder.loop_status[seen:]), 5
    )
    level, message, values = [
        s for s in feeder.loop_status[seen:] if s[0] == DiagnosticStatus.ERROR
    ][-1]
    assert "5 consecutive ticks failed inside the engine" in message and "InjectedFault" in message
    assert values["state"] == "unconfigured" and values["last_error"] == message
    count = len(chunks)
    time.sleep(0.5)
    assert len(chunks) == count, "chunks after the error transition"
    # the cause fixed (a fresh engine), the node configures and acts again
    assert node.start()
    assert node.get_parameter("max_consecutive_failures").value == 5
    assert _chunks_keep_flowing(chunks, timeout=20)
    assert node._last_error == ""
