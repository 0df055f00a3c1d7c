"""The node's Ask action and narration marker over real DDS: a real ``oxygen_node`` process (tiny
random-weight model, a replayed synthetic bag) and an rclpy ActionClient in the test's own node.

* a goal's feedback streams in order and concatenates to the result's text; the result says why
  the answer ended and the goal SUCCEEDED;
* a cancelled goal ends CANCELED with finish_reason ``cancelled``, and its KV is freed: the node's
  /diagnostics show the KV in use and the live segments back where they were before the goal;
* goals that are empty, too long or sent while the node is inactive are rejected (and counted);
* each finished text is also a TEXT_VIEW_FACING Marker at the frame and position of the
  parameters (narration_marker: true), the same text as ~/narration_text.

Narration is off (narration_period_s 0) so that only the test's questions use KV memory, and
language decodes one step per tick (decode_mode fixed, k = 1) so a long answer lasts long enough
to be cancelled in the middle.
"""

from __future__ import annotations

import pytest
from action_msgs.msg import GoalStatus
from lifecycle_msgs.msg import Transition
from node_harness import (
    STATE_ACTIVE,
    SYNTHETIC_INPUT_TOPICS,
    AskClient,
    NodeProcess,
    playing_probe,
    synthetic_bag_params,
    wait_for,
)
from std_msgs.msg import String
from visualization_msgs.msg import Marker

pytestmark = [pytest.mark.ros, pytest.mark.slow]

MAX_TEXT_CHARS = 60
MARKER_FRAME = "table"
MARKER_POSITION = [0.5, -0.25, 1.5]
WAIT_S = 30.0


@pytest.fixture(scope="module")
def node(tiny_checkpoint, tmp_path_factory):
    process = NodeProcess(
        synthetic_bag_params(tiny_checkpoint)
        | {
            "rate_hz": 10.0,
            "max_observation_age_s": 1.0,
            "narration_period_s": 0.0,
            "answer_max_tokens": 6,
            "decode_mode": "fixed",
            "decode_steps_per_frame": 1,
            # random weights: sampling streams varied text instead of one blank token
            "temperature": 1.0,
            "max_text_chars": MAX_TEXT_CHARS,
            "narration_marker": True,
            "narration_marker_frame": MARKER_FRAME,
            "narration_marker_position": MARKER_POSITION,
        },
        tmp_path_factory.mktemp("node"),
    )
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture(scope="module")
def probe(node, synthetic_bag):
    with playing_probe(node, synthetic_bag, SYNTHETIC_INPUT_TOPICS) as probe:
        assert wait_for(lambda: len(probe.chunks) >= 3, WAIT_S), "no chunks from the node"
        yield probe


@pytest.fixture(scope="module")
def ask(probe):
    return AskClient(probe)


def test_feedback_streams_in_order_and_concatenates_to_the_result(probe, ask):
    handle = ask.send("what is on the table?", max_tokens=5)
    assert handle.accepted
    reply = ask.result(handle)
    result = reply.result
    assert reply.status == GoalStatus.STATUS_SUCCEEDED, result
    assert result.finish_reason in ("eos", "stop", "length")
    assert wait_for(lambda: "".join(d for d, _ in ask.feedback_of(handle)) == result.text, 5), (
        ask.feedback_of(handle),
        result.text,
    )
    counts = [count for _, count in ask.feedback_of(handle)]
    assert counts == sorted(counts) and 1 <= counts[-1] <= 5  # in order, within max_tokens


def test_a_cancel_stops_the_answer_frees_its_kv_and_ends_cancelled(probe, ask):
    before = probe.fresh_diagnostics()
    baseline = (int(before["kv_bytes_in_use"]), int(before["kv_live_segments"]))
    handle = ask.send("describe everything you see, in detail", max_tokens=200)
    assert handle.accepted
    assert wait_for(lambda: len(ask.feedback_of(handle)) >= 2, WAIT_S), "no feedback streamed"
    during = probe.fresh_diagnostics()
    assert int(during["kv_live_segments"]) > baseline[1]  # the answer holds its own KV
    cancel = handle.cancel_goal_async()
    assert wait_for(cancel.done, WAIT_S)
    reply = ask.result(handle)
    assert reply.status == GoalStatus.STATUS_CANCELED
    assert reply.result.finish_reason == "cancelled"
    assert wait_for(lambda: "".join(d for d, _ in ask.feedback_of(handle)) == reply.result.text, 5)
    assert ask.feedback_of(handle)[-1][1] < 200  # stopped long before its token limit
    after = probe.fresh_diagnostics()
    assert (int(after["kv_bytes_in_use"]), int(after["kv_live_segments"])) == baseline


def test_bad_goals_are_rejected_and_counted(probe, ask):
    assert not ask.send("   ").accepted
    assert not ask.send("x" * (MAX_TEXT_CHARS + 1)).accepted
    assert probe.counter("ask_action_rejected_empty") == 1
    assert probe.counter("ask_action_rejected_too_long") == 1


def test_goals_are_rejected_while_the_node_is_inactive(probe, ask):
    assert probe.change_state(Transition.TRANSITION_DEACTIVATE)
    try:
        assert not ask.send("are you there?").accepted
        assert probe.counter("ask_action_rejected_inactive") == 1
    finally:
        assert probe.change_state(Transition.TRANSITION_ACTIVATE)
    assert probe.get_state() == STATE_ACTIVE


def test_finished_texts_are_published_as_markers_where_the_parameters_say(probe, ask):
    with probe.lock:
        texts_before = len(probe.texts)
    probe.ask.publish(String(data="what colour is the cup?"))
    assert wait_for(lambda: len(probe.texts) > texts_before, WAIT_S), "no finished text"
    with probe.lock:
        text = probe.texts[texts_before]
    assert text.startswith("[answer] ")
    assert wait_for(lambda: any(m.text == text for m in list(ask.markers)), 5), "no marker"
    marker = next(m for m in list(ask.markers) if m.text == text)
    assert marker.type == Marker.TEXT_VIEW_FACING and marker.action == Marker.ADD
    assert marker.header.frame_id == MARKER_FRAME
    position = marker.pose.position
    assert [position.x, position.y, position.z] == MARKER_POSITION
    assert marker.scale.z > 0 and marker.color.a == 1.0


def test_answers_unfinished_at_cleanup_are_counted_and_their_goals_end(probe, ask):
    """Releasing the engine (deactivate, clean up) cancels the requests still decoding: counted as
    requests_cancelled_at_close, and an Ask goal among them ends ABORTED with finish_reason
    cancelled (the client did not cancel it) and the text said before."""
    handle = ask.send("tell me a long story about the table", max_tokens=200)
    assert handle.accepted
    assert wait_for(lambda: len(ask.feedback_of(handle)) >= 1, WAIT_S), "no feedback streamed"
    assert probe.change_state(Transition.TRANSITION_DEACTIVATE)
    assert probe.change_state(Transition.TRANSITION_CLEANUP)
    try:
        reply = ask.result(handle)
        assert reply.status == GoalStatus.STATUS_ABORTED
        assert reply.result.finish_reason == "cancelled"
        assert wait_for(
            lambda: "".join(d for d, _ in ask.feedback_of(handle)) == reply.result.text, 5
        )
        assert probe.counter("requests_cancelled_at_close") == 1
    finally:
        assert probe.change_state(Transition.TRANSITION_CONFIGURE)
        assert probe.change_state(Transition.TRANSITION_ACTIVATE)
    assert probe.get_state() == STATE_ACTIVE
