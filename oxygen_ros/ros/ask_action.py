"""The ``Ask`` action (``action/Ask.action``): goal checks, and text deltas as feedback and result.

An action server answering questions keeps one :class:`AnswerStream` per goal: every engine
:class:`~oxygen_ros.engine.types.TextDelta` of the goal's request goes through
:meth:`AnswerStream.feedback`, and the final one becomes the result with
:meth:`AnswerStream.result`. The stream remembers the text so far, so a cancelled or failed goal
still returns what was said before it ended.

The node serves the action on ``~/ask`` (next to the fire-and-forget ``~/ask`` String topic; an
action's topics and services live under ``~/ask/_action/``, so the two coexist). It never blocks
in an action callback: an accepted goal joins the question queue as a :class:`Question`; the tick
submits it and feeds its deltas to :class:`AskGoal`, which publishes them as feedback; the final
delta calls ``goal_handle.execute`` with a callback that only sets the terminal state and returns
the result, so rclpy answers the client from a short executor task. While the answer streams the
goal is ACCEPTED; its status changes to EXECUTING and then to SUCCEEDED, ABORTED or CANCELED when
the final delta arrives.

For clients: rclpy's ActionClient stops delivering a goal's feedback once the goal's result has
arrived, and feedback and result travel on different DDS entities; the result's ``text`` is
therefore the authoritative answer, the feedback its live preview.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from oxygen_ros.action import Ask

from ..engine.types import TextDelta

CANCELLED = "cancelled"
SUCCESSFUL = ("eos", "stop", "length")  # finish reasons that end a goal as SUCCEEDED


def goal_problem(goal: Ask.Goal) -> str:
    """Why ``goal`` cannot be answered, or ``""`` when it can (the server rejects it then)."""
    if not goal.question.strip():
        return "the question is empty"
    return ""


def token_budget(goal: Ask.Goal, default: int) -> int:
    """Token limit of the answer: the goal's ``max_tokens``, or ``default`` when it is 0.

    Raises:
        ValueError: if ``default`` is below 1 (a limit the node's parameters never allow).
    """
    if default < 1:
        raise ValueError(f"the default answer token limit must be >= 1, got {default}")
    return int(goal.max_tokens) or int(default)


class AnswerStream:
    """The text and token count of one goal's answer, fed with its request's text deltas."""

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self.token_count = 0
        self.finish_reason = ""
        self.detail = ""

    @property
    def text(self) -> str:
        """Everything streamed so far."""
        return "".join(self._pieces)

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason)

    def feedback(self, delta: TextDelta) -> Ask.Feedback:
        """Record ``delta`` and return the feedback that carries it.

        Raises:
            ValueError: if the stream has already finished (a delta after the final one).
        """
        if self.finished:
            raise ValueError(
                f"request {delta.request_id}: text delta after the answer finished "
                f"({self.finish_reason})"
            )
        self._pieces.append(delta.text)
        self.token_count = max(self.token_count, int(delta.token_count))
        if delta.final:
            self.finish_reason = delta.finish_reason or "stop"
            self.detail = delta.detail
        return Ask.Feedback(delta=delta.text, token_count=self.token_count)

    def cancel(self, detail: str = "") -> None:
        """End the stream as cancelled (the client cancelled, or the node dropped the request)."""
        if not self.finished:
            self.finish_reason, self.detail = CANCELLED, detail

    def result(self) -> Ask.Result:
        """The goal's result: the whole text, why it ended and the reason's detail.

        Raises:
            ValueError: if the stream has not finished (no final delta and no cancel yet).
        """
        if not self.finished:
            raise ValueError("the answer has not finished; feed its final delta or cancel it first")
        return Ask.Result(text=self.text, finish_reason=self.finish_reason, detail=self.detail)


class AskGoal:
    """One accepted goal (``handle`` is rclpy's ServerGoalHandle) and the answer streamed to it."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.stream = AnswerStream()
        self.concluded = False  # the result went to rclpy, which sends it to the client at once

    @property
    def cancel_requested(self) -> bool:
        return bool(self.handle.is_cancel_requested)

    def feed(self, delta: TextDelta) -> None:
        """Publish ``delta`` as feedback; the final one ends the goal."""
        self.handle.publish_feedback(self.stream.feedback(delta))
        if delta.final:
            self._finish()

    def cancel(self, detail: str) -> None:
        """End the goal as cancelled without an engine delta (it never reached the engine)."""
        self.stream.cancel(detail)
        self._finish()

    def _finish(self) -> None:
        self.handle.execute(self._conclude)

    def _conclude(self, handle: Any) -> Ask.Result:
        """rclpy's execute callback: the terminal state, then the result (never blocks)."""
        reason = self.stream.finish_reason
        if reason == CANCELLED and handle.is_cancel_requested:
            handle.canceled()
        elif reason in SUCCESSFUL:
            handle.succeed()
        else:  # refused, failed, stalled, or cancelled by the node itself
            handle.abort()
        result = self.stream.result()
        self.concluded = True
        return result


@dataclasses.dataclass
class Question:
    """A question waiting for the next frame: from ``~/ask`` (no goal) or an Ask goal."""

    text: str
    goal: AskGoal | None = None

    def token_budget(self, default: int) -> int:
        """The answer's token limit: the goal's ``max_tokens``, else ``default``."""
        return default if self.goal is None else token_budget(self.goal.handle.request, default)
