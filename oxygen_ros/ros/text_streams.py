"""Node-side bookkeeping of streamed language: which requests are open, the frame each one reads,
the text so far, and when the next narration is due.

The engine reports text as :class:`TextDelta` s; the node publishes every delta as a ``Narration``
and, when a request finishes, its whole text as a ``std_msgs/String`` for ``topic echo`` users,
prefixed with its kind (``[answer] ...``). A request is admitted onto the engine's newest frame
right after that frame's action, so the stamp of the frame current at a request's first delta is
the stamp of the observation the request reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from ..engine.types import TextDelta


@dataclasses.dataclass
class _OpenRequest:
    kind: str
    stamp: Any = None  # builtin_interfaces/Time
    pieces: List[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class StreamUpdate:
    """What to publish for one delta."""

    delta: TextDelta
    stamp: Any  # builtin_interfaces/Time of the observation the request reads
    full_text: Optional[str]  # "[kind] text" once the request has finished, else None


class LanguageStreams:
    """Open language requests of the node (used from the tick thread only)."""

    def __init__(self) -> None:
        self._open: Dict[int, _OpenRequest] = {}

    @property
    def open_count(self) -> int:
        return len(self._open)

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
            if delta.finish_reason == "refused":
                text = f"(refused: {delta.detail or 'no reason given'})"
            full_text = f"[{delta.kind}] {text}"
        return StreamUpdate(delta, request.stamp, full_text)

    def clear(self) -> None:
        """Forget every open request (the engine that held them is gone)."""
        self._open.clear()


class PeriodicSchedule:
    """Says when something done every ``period_s`` seconds is due (period 0 = never)."""

    def __init__(self) -> None:
        self._last: Optional[float] = None

    def due(self, now: float, period_s: float) -> bool:
        return period_s > 0 and (self._last is None or now - self._last >= period_s)

    def mark(self, now: float) -> None:
        self._last = now

    def reset(self) -> None:
        self._last = None
