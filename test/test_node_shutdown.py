"""Ctrl-C with questions open, over real DDS: a real ``oxygen_node`` process (tiny random-weight
model, a replayed synthetic bag) and an rclpy ActionClient in the test's own node.

SIGINT reaches the node while one Ask goal is streaming its answer and another is still waiting
for a frame (the inputs stopped, so no frame takes questions). Both clients get their result,
ABORTED with finish_reason ``cancelled`` (docs/ros_interfaces.md's promise), the streaming one
with the text said before; the node exits 0 with no traceback in its log. Unit tests of the
pieces (the stop handler, a teardown step that fails) are at the end.
"""

from __future__ import annotations

import signal
import time

import pytest
import rclpy
from action_msgs.msg import GoalStatus
from node_harness import (
    SYNTHETIC_INPUT_TOPICS,
    AskClient,
    NodeProcess,
    Probe,
    synthetic_bag_params,
    wait_for,
)
from rclpy.executors import SingleThreadedExecutor

from oxygen_ros.ros import shutdown
from oxygen_ros.tools.make_bag import write_synthetic_bag

WAIT_S = 30.0


@pytest.fixture(scope="module")
def bag(tmp_path_factory):
    return write_synthetic_bag(tmp_path_factory.mktemp("bag") / "synthetic", duration_s=2.0)


def _quiet_for(probe: Probe, seconds: float, timeout: float) -> bool:
    """Wait until no chunk has arrived for ``seconds`` (the node stopped making frames)."""

    def quiet() -> bool:
        with probe.lock:
            last = probe.chunks[-1][0] if probe.chunks else 0.0
        return time.monotonic() - last >= seconds

    return wait_for(quiet, timeout, interval=0.1)


@pytest.mark.ros
@pytest.mark.slow
def test_sigint_ends_open_goals_aborted_cancelled_and_exits_0(tiny_checkpoint, bag, tmp_path):
    node = NodeProcess(
        synthetic_bag_params(tiny_checkpoint)
        | {
            "rate_hz": 10.0,
            "max_observation_age_s": 0.5,
            "narration_period_s": 0.0,
            "decode_mode": "fixed",
            "decode_steps_per_frame": 1,
            "temperature": 1.0,
        },
        tmp_path,
    )
    probe = Probe(SYNTHETIC_INPUT_TOPICS)
    try:
        probe.wait_active(node)
        ask = AskClient(probe, WAIT_S)
        with probe.play_in_background(bag):
            assert wait_for(lambda: len(probe.chunks) >= 2, WAIT_S), node.log()[-3000:]
            streaming = ask.send("tell me a long story about the table", max_tokens=200)
            assert streaming.accepted
            assert wait_for(lambda: ask.feedback_of(streaming), WAIT_S), "no feedback streamed"
        # The inputs stopped: once they are stale no frame is made, so a new question waits.
        assert _quiet_for(probe, 1.0, WAIT_S), "the node kept making frames without inputs"
        waiting = ask.send("what is on the table?")
        assert waiting.accepted
        results = [handle.get_result_async() for handle in (streaming, waiting)]
        assert node.alive()

        node.process.send_signal(signal.SIGINT)

        assert wait_for(lambda: all(f.done() for f in results), WAIT_S), (
            f"a client got no result after SIGINT; node log:\n{node.log()[-3000:]}"
        )
        status = node.process.wait(WAIT_S)  # (a second SIGINT would cut the wait short)
        log = node.log()
        assert status == 0, log[-3000:]
        assert "Traceback" not in log and "failed during shutdown" not in log, log[-3000:]
        streamed, queued = (future.result() for future in results)
        for reply in (streamed, queued):
            assert reply.status == GoalStatus.STATUS_ABORTED, log[-3000:]
            assert reply.result.finish_reason == "cancelled"
        # the answer said before the stop is the result's text (feedback may trail the result)
        assert streamed.result.text
        assert wait_for(
            lambda: "".join(d for d, _ in ask.feedback_of(streaming)) == streamed.result.text, 5
        )
        assert queued.result.text == ""
        assert "before the question was asked" in queued.result.detail
    finally:
        if node.alive():
            node.stop()
        probe.close()


# --- the pieces --------------------------------------------------------------------------------


def test_a_first_signal_requests_the_stop_and_a_second_interrupts():
    signals = shutdown.StopSignals().install()
    try:
        signal.raise_signal(signal.SIGINT)
        assert signals.event.is_set() and signals.received == [signal.SIGINT]
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGINT) is not signals._on_signal


class _BrokenNode:
    """A node whose release fails (as publishing on invalid publishers did)."""

    def __init__(self, context: rclpy.Context) -> None:
        self.inner = rclpy.create_node("broken_release", context=context)
        self.released = False

    def release(self) -> None:
        self.released = True
        raise RuntimeError("feedback publisher is invalid")

    def goals_awaiting_result(self) -> int:
        return 0

    def destroy_node(self) -> None:
        self.inner.destroy_node()


@pytest.mark.ros
def test_a_failing_teardown_step_is_reported_and_the_rest_still_runs(capsys):
    context = rclpy.Context()
    rclpy.init(context=context)
    node = _BrokenNode(context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node.inner)
    errors = shutdown.close_node(node, executor, context=context, drain_timeout_s=0.1, linger_s=0.0)
    assert node.released
    assert len(errors) == 1 and "releasing the node failed" in errors[0]
    assert "feedback publisher is invalid" in capsys.readouterr().err
    assert not context.ok(), "the context was not shut down after the failed step"
