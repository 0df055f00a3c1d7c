"""The server's counters: every refusal kind, frames served, batch sizes (read at ``/stats``)."""

from __future__ import annotations

import threading


class Counters:
    """Named counts, safe to bump from the event loop and the model worker at once."""

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
        with self._lock:
            return dict(sorted(self._counts.items()))
