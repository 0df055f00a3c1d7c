"""The ``Ask`` action (``action/Ask.action``): goal checks, and text deltas as feedback and result.

An action server answering questions keeps one :class:`AnswerStream` per goal: every engine
:class:`~oxygen_ros.engine.types.TextDelta` of the goal's request goes through
:meth:`AnswerStream.feedback`, and the final one becomes the result with
:meth:`AnswerStream.result`. The stream remembers the text so far, so a cancelled or failed goal
still returns what was said before it ended.

For clients: rclpy's ActionClient stops delivering a goal's feedback once the goal's result has
arrived, and feedback and result travel on different DDS entities; the result's ``text`` is
therefore the authoritative answer, the feedback its live preview.
"""

from __future__ import annotations

from oxygen_ros.action import Ask

from ..engine.types import TextDelta

CANCELLED = "cancelled"


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
