"""Which idle session yields its place to a robot that arrives while every place is taken.

The event loop keeps one `Place` per open session: whether the server is waiting for its client
(and since when) or serving one of its frames, and whether it ever sent an observation. When a
newcomer finds no room, `pick_idle` names the session to close for it: among the sessions the
server waits for, those that never sent an observation first, then the one idle longest; never
one whose frame is being served, and never one idle for less than the grace (a robot between two
frames of an episode). Only the event loop touches places (no lock).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable

from .sessions import Session

# Long enough that a robot mid-episode is never taken for an idle one: openpi's example clients
# ask every ~0.5 s (DROID: 8 actions at 15 Hz; ALOHA: 25 at 50 Hz), so 3 s is six of their gaps
# and three periods of a 1 Hz node. Short enough that a working robot is served quickly: it is
# held at most this long before its metadata frame, well within the node client's 5 s open
# timeout (openpi's client waits for the metadata without a limit). docs/serving.md.
DEFAULT_IDLE_GRACE_S = 3.0


@dataclasses.dataclass
class Place:
    """An open session as the event loop sees it."""

    session: Session
    idle_since: float | None  # loop time the server began waiting for the client; None: busy
    observed: bool = False  # the client sent an observation that was answered
    evicted: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # yield now
    released: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # place is free

    def busy(self) -> None:
        """A message arrived: the server works for this client until it answers."""
        self.idle_since = None

    def waiting(self, since: float, observed: bool) -> None:
        self.idle_since = since
        self.observed = self.observed or observed


def _idle(places: Iterable[Place]) -> list[Place]:
    return [p for p in places if p.idle_since is not None and not p.evicted.is_set()]


def has_idle(places: Iterable[Place]) -> bool:
    """Whether some session waits for its client (a newcomer may get its place)."""
    return bool(_idle(places))


def pick_idle(places: Iterable[Place], now: float, grace_s: float) -> tuple[Place, float] | None:
    """The place to free for a newcomer and how long until it may be freed (0: now), or None when
    no session is waiting for its client.

    Sessions idle for at least ``grace_s`` go first: those that never sent an observation before
    the others, the longest idle first; otherwise the one that would go first, once it has been
    idle for the grace (a robot paused between episodes is not taken while a session that never
    sent anything can be).
    """
    idle = _idle(places)
    if not idle:
        return None

    def order(place: Place) -> tuple[bool, float]:
        return place.observed, place.idle_since

    ready = [p for p in idle if now - p.idle_since >= grace_s]
    if ready:
        return min(ready, key=order), 0.0
    first = min(idle, key=order)
    return first, first.idle_since + grace_s - now
