"""Node-side bookkeeping of streamed language: which requests are open, the frame each one reads,
the text so far, and when the next narration is due.

The engine reports text as :class:`TextDelta` s; the node publishes every delta as a ``Narration``
and, when a request finishes, its whole text as a ``std_msgs/String`` for ``topic echo`` users,
prefixed with its kind (``[answer] ...``). A request is admitted onto the engine's newest frame
right after that frame's action, so the stamp of the frame current at a request's first delta is
the stamp of the observation the request reads.

A request leaves :class:`LanguageStreams` with its final delta, whatever its finish reason
(``failed`` included) and whether or not that delta could be published, so a lost final never
keeps a kind "busy". There is no node-side expiry: the engine ends every request it accepted with
exactly one final delta (``OxygenEngine.decode`` holds that for any exception in a language stage;
``cancel`` and ``close`` answer the rest), and an engine that is closed takes its open streams with
it (:meth:`LanguageStreams.clear`).

Publishing text is part of the language budget: :class:`PublishCost` learns what publishing one
delta costs and how many deltas a tick brings, so the node ends ``decode()`` that much earlier.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..engine.types import TextDelta


@dataclasses.dataclass
class _OpenRequest:
    kind: str
    stamp: Any = None  # builtin_interfaces/Time
    pieces: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class StreamUpdate:
    """What to publish for one delta."""

    delta: TextDelta
    stamp: Any  # builtin_interfaces/Time of the observation the request reads
    full_text: str | None  # "[kind] text" once the request has finished, else None


class LanguageStreams:
    """Open language requests of the node (used from the tick thread only)."""

    def __init__(self) -> None:
        self._open: dict[int, _OpenRequest] = {}

    def opened(self, request_id: int, kind: str) -> None:
        """Record a request just submitted to the engine."""
        self._open[request_id] = _OpenRequest(kind)

    def busy(self, kind: str) -> bool:
        """Whether a request of ``kind`` is still queued or decoding."""
        return any(r.kind == kind for r in self._open.values())

    def update(self, delta: TextDelta, frame_stamp: Any) -> StreamUpdate:
        """Account for ``delta``; ``frame_stamp`` is the stamp of the engine's newest frame."""
        request = self._open.setdefault(delta.request_id, _OpenRequest(delta.kind))
        if request.stamp is None:
            request.stamp = frame_stamp
        request.pieces.append(delta.text)
        full_text = None
        if delta.final:
            del self._open[delta.request_id]
            text = "".join(request.pieces)
            if delta.finish_reason in ("refused", "failed"):
                text = f"({delta.finish_reason}: {delta.detail or 'no reason given'})"
            full_text = f"[{delta.kind}] {text}"
        return StreamUpdate(delta, request.stamp, full_text)

    def clear(self) -> None:
        """Forget every open request (the engine that held them is gone)."""
        self._open.clear()


class PublishCost:
    """Expected time to publish a tick's text deltas: an EMA of the cost per delta times an EMA of
    the deltas per tick (seconds)."""

    def __init__(self, alpha: float = 0.2) -> None:
        self._alpha = alpha
        self.per_delta_s = 0.0
        self.deltas_per_tick = 0.0

    def seed(self, per_delta_s: float) -> None:
        """Start from a measured cost per delta (the warm-up's) instead of nothing."""
        self.per_delta_s = per_delta_s

    def record(self, deltas: int, seconds: float) -> None:
        """One tick published ``deltas`` deltas in ``seconds``."""
        self.deltas_per_tick += self._alpha * (deltas - self.deltas_per_tick)
        if deltas:
            sample = seconds / deltas
            self.per_delta_s = (
                sample
                if self.per_delta_s == 0.0
                else self.per_delta_s + self._alpha * (sample - self.per_delta_s)
            )

    def expected_s(self) -> float:
        """What the next tick's publishing is expected to take."""
        return self.per_delta_s * self.deltas_per_tick


class PeriodicSchedule:
    """Says when something done every ``period_s`` seconds is due (period 0 = never)."""

    def __init__(self) -> None:
        self._last: float | None = None

    def due(self, now: float, period_s: float) -> bool:
        return period_s > 0 and (self._last is None or now - self._last >= period_s)

    def mark(self, now: float) -> None:
        self._last = now

    def reset(self) -> None:
        self._last = None
