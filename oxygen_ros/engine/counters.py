"""Named counts that only grow: the node's ``/diagnostics`` counters and the server's ``/stats``."""

from __future__ import annotations

import threading


class Counters:
    """Named monotonically increasing counts, safe to bump from several threads at once (the
    node's executor threads; the server's event loop and its model thread)."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + amount

    def get(self, name: str) -> int:
        with self._lock:
            return self._counts.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        """A copy of every count, sorted by name."""
        with self._lock:
            return dict(sorted(self._counts.items()))
