"""The Ask action type over real DDS.

* ``oxygen_ros.action.Ask`` is generated with the fields Ask.action declares and has typesupport;
* an rclpy ActionServer and ActionClient in one process exchange goals of this type: feedback
  arrives in order and concatenates to the result's text, ``max_tokens`` ends an answer with
  ``length``, an empty question is rejected, and a cancel ends the goal as CANCELED with
  finish_reason ``cancelled`` and the text said before it;
* :class:`oxygen_ros.ros.ask_action.AnswerStream` turns engine text deltas into feedback and a
  result.

The server here answers from a fixed script (one word per token): it exercises the interface,
not the model.
"""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from oxygen_ros.engine.types import TextDelta

ANSWER_WORDS = ["The", " red", " cup", " is", " on", " the", " table", "."]
DEFAULT_MAX_TOKENS = 40
WAIT_S = 30.0


def test_generated_action_type_has_the_declared_fields():
    from rclpy.type_support import check_for_type_support

    from oxygen_ros.action import Ask

    check_for_type_support(Ask)
    assert Ask.Goal.get_fields_and_field_types() == {"question": "string", "max_tokens": "uint32"}
    assert Ask.Result.get_fields_and_field_types() == {
        "text": "string",
        "finish_reason": "string",
        "detail": "string",
    }
    assert Ask.Feedback.get_fields_and_field_types() == {"delta": "string", "token_count": "uint32"}


# --- AnswerStream ---------------------------------------------------------------------------------


def _delta(text, count, final=False, reason="", detail=""):
    return TextDelta(
        request_id=7,
        kind="answer",
        text=text,
        final=final,
        token_count=count,
        finish_reason=reason,
        detail=detail,
    )


def test_answer_stream_collects_deltas_into_feedback_and_result():
    from oxygen_ros.ros.ask_action import AnswerStream

    stream = AnswerStream()
    first = stream.feedback(_delta("Hel", 1))
    second = stream.feedback(_delta("lo", 2))
    last = stream.feedback(_delta("!", 3, final=True, reason="eos"))
    assert [(f.delta, f.token_count) for f in (first, second, last)] == [
        ("Hel", 1),
        ("lo", 2),
        ("!", 3),
    ]
    result = stream.result()
    assert (result.text, result.finish_reason, result.detail) == ("Hello!", "eos", "")
    with pytest.raises(ValueError, match="after the answer finished"):
        stream.feedback(_delta("more", 4))


def test_answer_stream_refuses_a_result_before_the_end_and_keeps_text_on_cancel():
    from oxygen_ros.ros.ask_action import AnswerStream

    stream = AnswerStream()
    stream.feedback(_delta("half an", 2))
    with pytest.raises(ValueError, match="not finished"):
        stream.result()
    stream.cancel("client cancelled")
    result = stream.result()
    assert (result.text, result.finish_reason, result.detail) == (
        "half an",
        "cancelled",
        "client cancelled",
    )


def test_goal_checks():
    from oxygen_ros.action import Ask
    from oxygen_ros.ros.ask_action import goal_problem, token_budget

    assert goal_problem(Ask.Goal(question="  \n")) == "the question is empty"
    assert goal_problem(Ask.Goal(question="where is the cup?")) == ""
    assert token_budget(Ask.Goal(question="q", max_tokens=0), default=40) == 40
    assert token_budget(Ask.Goal(question="q", max_tokens=3), default=40) == 3
    with pytest.raises(ValueError, match=">= 1"):
        token_budget(Ask.Goal(question="q"), default=0)


# --- server and client over DDS ------------------------------------------------------------------


class ScriptedAskServer:
    """An Ask action server answering every question with ANSWER_WORDS, one word per token.

    ``step`` is set once per word before the word is streamed (a test holds it to cancel in the
    middle); ``gate=None`` streams freely.
    """

    def __init__(self, node, name, gate=None):
        from rclpy.action import ActionServer, CancelResponse, GoalResponse
        from rclpy.callback_groups import ReentrantCallbackGroup

        from oxygen_ros.action import Ask
        from oxygen_ros.ros.ask_action import goal_problem

        self.gate = gate
        self.rejected = []

        def on_goal(goal):
            problem = goal_problem(goal)
            if problem:
                self.rejected.append(problem)
                return GoalResponse.REJECT
            return GoalResponse.ACCEPT

        self.server = ActionServer(
            node,
            Ask,
            name,
            execute_callback=self._execute,
            goal_callback=on_goal,
            cancel_callback=lambda _handle: CancelResponse.ACCEPT,
            callback_group=ReentrantCallbackGroup(),
        )

    def _execute(self, handle):
        from oxygen_ros.ros.ask_action import AnswerStream, token_budget

        budget = token_budget(handle.request, DEFAULT_MAX_TOKENS)
        stream = AnswerStream()
        for count, word in enumerate(ANSWER_WORDS[:budget], start=1):
            if self.gate is not None:
                self.gate.wait_for_next()
            if handle.is_cancel_requested:
                stream.cancel("cancelled by the client")
                handle.canceled()
                return stream.result()
            last = count == len(ANSWER_WORDS) or count == budget
            reason = ("eos" if count == len(ANSWER_WORDS) else "length") if last else ""
            handle.publish_feedback(stream.feedback(_delta(word, count, final=last, reason=reason)))
        handle.succeed()
        return stream.result()


class Gate:
    """Lets the server stream one word per `open_one` call (and everything after `open_all`)."""

    def __init__(self):
        self._semaphore = threading.Semaphore(0)
        self._all = threading.Event()

    def wait_for_next(self):
        while not self._all.is_set():
            if self._semaphore.acquire(timeout=0.05):
                return

    def open_one(self):
        self._semaphore.release()

    def open_all(self):
        self._all.set()


class RosPair:
    """A server node and a client node spun by one multi-threaded executor in a thread.

    The client node joins the executor only once its action client is built: rclpy 9 (Kilted)
    registers an ActionClient with its node before the client is complete, so an executor already
    spinning the node could meet it half-made.
    """

    def __init__(self, server_node, client_node, executor, name):
        self.server_node, self.client_node, self.name = server_node, client_node, name
        self.executor = executor
        self.owned = []  # action servers and clients, destroyed after the executor stops

    def server(self, gate=None):
        server = ScriptedAskServer(self.server_node, self.name, gate=gate)
        self.owned.append(server.server)
        return server

    def client(self):
        from rclpy.action import ActionClient

        from oxygen_ros.action import Ask

        assert self.client_node not in self.executor.get_nodes(), "one client per pair"
        client = ActionClient(self.client_node, Ask, self.name)
        self.owned.append(client)
        self.executor.add_node(self.client_node)
        assert client.wait_for_server(timeout_sec=WAIT_S), "the Ask action server never appeared"
        return client


@pytest.fixture
def ros_pair():
    import rclpy
    from rclpy.executors import MultiThreadedExecutor

    suffix = uuid.uuid4().hex[:8]
    context = rclpy.Context()
    rclpy.init(context=context)
    server_node = rclpy.create_node(f"ask_server_{suffix}", context=context)
    client_node = rclpy.create_node(f"ask_client_{suffix}", context=context)
    executor = MultiThreadedExecutor(num_threads=4, context=context)
    executor.add_node(server_node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    pair = RosPair(server_node, client_node, executor, f"ask_{suffix}")
    try:
        yield pair
    finally:
        executor.shutdown()
        spinner.join(timeout=10)
        for entity in pair.owned:
            entity.destroy()
        server_node.destroy_node()
        client_node.destroy_node()
        rclpy.shutdown(context=context)


def _wait(future, what):
    done = threading.Event()
    future.add_done_callback(lambda _f: done.set())
    assert done.wait(WAIT_S), f"timed out waiting for {what}"
    return future.result()


def _wait_for(condition, what):
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.ros
def test_goal_streams_feedback_in_order_and_ends_with_the_whole_answer(ros_pair):
    from action_msgs.msg import GoalStatus

    from oxygen_ros.action import Ask

    ros_pair.server()
    client = ros_pair.client()
    feedback = []
    handle = _wait(
        client.send_goal_async(
            Ask.Goal(question="Where is the cup?"),
            feedback_callback=lambda msg: feedback.append(msg.feedback),
        ),
        "goal acceptance",
    )
    assert handle.accepted
    # Every piece arrives (reliable QoS, keep-last 10 > 8 pieces), in the order sent. The result is
    # asked for afterwards: rclpy's ActionClient drops a goal's feedback once its result is in, and
    # feedback and result travel on different DDS entities, so late pieces would be lost.
    _wait_for(lambda: len(feedback) == len(ANSWER_WORDS), f"8 feedback messages, got {feedback}")
    assert [f.delta for f in feedback] == ANSWER_WORDS
    assert [f.token_count for f in feedback] == [1, 2, 3, 4, 5, 6, 7, 8]
    response = _wait(handle.get_result_async(), "the result")

    assert response.status == GoalStatus.STATUS_SUCCEEDED
    assert response.result.text == "The red cup is on the table."
    assert response.result.finish_reason == "eos"


@pytest.mark.ros
def test_max_tokens_ends_the_answer_with_length_and_empty_questions_are_rejected(ros_pair):
    from action_msgs.msg import GoalStatus

    from oxygen_ros.action import Ask

    server = ros_pair.server()
    client = ros_pair.client()
    feedback = []
    handle = _wait(
        client.send_goal_async(
            Ask.Goal(question="Where is the cup?", max_tokens=3),
            feedback_callback=lambda msg: feedback.append(msg.feedback.delta),
        ),
        "goal acceptance",
    )
    _wait_for(lambda: len(feedback) == 3, f"3 feedback messages, got {feedback}")
    assert feedback == ["The", " red", " cup"]
    response = _wait(handle.get_result_async(), "the result")
    assert response.status == GoalStatus.STATUS_SUCCEEDED
    assert (response.result.text, response.result.finish_reason) == ("The red cup", "length")

    rejected = _wait(client.send_goal_async(Ask.Goal(question="   ")), "goal response")
    assert not rejected.accepted
    assert server.rejected == ["the question is empty"]


@pytest.mark.ros
def test_cancel_ends_the_goal_as_cancelled_with_the_text_so_far(ros_pair):
    from action_msgs.msg import GoalStatus

    from oxygen_ros.action import Ask

    gate = Gate()
    ros_pair.server(gate=gate)
    client = ros_pair.client()
    feedback = []
    got_two = threading.Event()

    def on_feedback(msg):
        feedback.append(msg.feedback.delta)
        if len(feedback) == 2:
            got_two.set()

    handle = _wait(
        client.send_goal_async(
            Ask.Goal(question="Where is the cup?"), feedback_callback=on_feedback
        ),
        "goal acceptance",
    )
    gate.open_one()
    gate.open_one()
    assert got_two.wait(WAIT_S), f"two feedback messages expected, got {feedback}"
    cancel = _wait(handle.cancel_goal_async(), "the cancel response")
    assert len(cancel.goals_canceling) == 1
    # The server accepted the cancel before answering it, so it sees the request before the
    # third word is released.
    gate.open_all()
    response = _wait(handle.get_result_async(), "the result")

    assert response.status == GoalStatus.STATUS_CANCELED
    assert response.result.finish_reason == "cancelled"
    assert response.result.text == "The red"
    assert feedback == ["The", " red"]
