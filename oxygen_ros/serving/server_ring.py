"""Which of a client's servers it uses, and when it moves on to the next (failover).

A `PolicyClient` may be given several servers, each serving the same model. It uses one at a
time, the first one first, and moves on to the next (cycling back to the first after the last)
when the one it uses

* cannot be reached (refused, timed out, handshake failed) or loses its connection: at once;
* stops answering in time: `SWITCH_AFTER_UNANSWERED` requests in a row got no usable reply
  within their deadline: late, answered with an error (a server that refuses every frame), or not
  sent because earlier ones are still unanswered. One refused frame between good replies resets
  nothing: the count is of requests *in a row*.

and goes back to the first server (`fail_back`) when its client finds it ready again.

With one server there is nowhere to go: it is tried again, and a slow server is only waited for.

Waits between attempts: the next server is tried at once while the servers of this round have not
all failed; after a whole round with no server answering, the `Backoff` delay for the number of
failed rounds in a row.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

# Three ticks in a row: a hiccup of one or two replies (a long batch, a garbage collection) is
# waited out; a server that has stopped is left about three deadlines after its last reply.
SWITCH_AFTER_UNANSWERED = 3


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Waits between connection attempts: ``first_s`` doubling up to ``max_s``."""

    first_s: float = 0.1
    max_s: float = 5.0

    def delay(self, failures: int) -> float:
        """The wait after ``failures`` failed attempts in a row (1 = the first failure)."""
        return min(self.max_s, self.first_s * 2 ** max(failures - 1, 0))


class ServerRing:
    """The servers in order, the one in use, and the counts that decide when to move on.

    Not thread-safe: its client calls it with its own lock held.
    """

    def __init__(
        self,
        uris: Sequence[str],
        backoff: Backoff | None = None,
        switch_after_unanswered: int = SWITCH_AFTER_UNANSWERED,
    ) -> None:
        if not uris:
            raise ValueError("no server given: name at least one ws://HOST:PORT")
        duplicates = sorted({uri for uri in uris if list(uris).count(uri) > 1})
        if duplicates:
            raise ValueError(f"servers named more than once: {duplicates}")
        if switch_after_unanswered < 1:
            raise ValueError(
                f"switch_after_unanswered must be at least 1, got {switch_after_unanswered}"
            )
        self.uris = tuple(uris)
        self.backoff = backoff or Backoff()
        self.switch_after_unanswered = switch_after_unanswered
        self.index = 0
        self._failures = 0  # attempts and connections in a row that ended with no reply
        self._unanswered = 0  # requests in a row with no reply in time, on this connection

    @property
    def current(self) -> str:
        return self.uris[self.index]

    @property
    def several(self) -> bool:
        return len(self.uris) > 1

    def connected(self) -> None:
        """A connection to the current server was made: its requests are counted afresh."""
        self._unanswered = 0

    def replied(self) -> None:
        """The current server sent a usable reply (in time or not; not an error): it works, the
        waits start over."""
        self._failures = 0

    def answered_in_time(self) -> None:
        self._unanswered = 0

    def unanswered(self) -> bool:
        """A request got no reply in time; True when the client should leave this server."""
        self._unanswered += 1
        return self.several and self._unanswered >= self.switch_after_unanswered

    def fail_back(self) -> float:
        """The first server is ready again: make it current, to be tried at once."""
        self.index = 0
        return 0.0

    def move_on(self) -> float:
        """After a failed attempt or a lost connection: make the next server current and return
        how long to wait before trying it (see the module docstring)."""
        self._failures += 1
        self.index = (self.index + 1) % len(self.uris)
        rounds, rest = divmod(self._failures, len(self.uris))
        return 0.0 if rest else self.backoff.delay(rounds)
