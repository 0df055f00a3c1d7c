"""Bookkeeping the node reports on ``/diagnostics``: error counters, rolling latency windows, rates,
and a keyed log throttle. Thread-safe where callbacks of several executor threads meet.

Nothing here decides behaviour; it only counts and summarises, so that every dropped input,
skipped tick or refused request is visible (``diagnostic_msgs/DiagnosticArray``) and logged at a
rate a person can read.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable, Deque, Dict, List, Mapping, Tuple

import numpy as np
from diagnostic_msgs.msg import DiagnosticStatus, KeyValue


class Counters:
    """Named monotonically increasing counts (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Dict[str, int] = collections.Counter()

    def add(self, key: str, amount: int = 1) -> None:
        with self._lock:
            self._counts[key] += amount

    def get(self, key: str) -> int:
        with self._lock:
            return self._counts.get(key, 0)

    def snapshot(self) -> Dict[str, int]:
        """A copy of every count, sorted by name."""
        with self._lock:
            return dict(sorted(self._counts.items()))


class KeyedThrottle:
    """Lets one message per key through every ``period_s`` seconds, reporting how many were held.

    rclpy's ``throttle_duration_sec`` throttles per call site, so two topics failing at one call site
    would hide each other; this throttles per (topic, reason) key instead.
    """

    def __init__(self, period_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._period = period_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: Dict[str, float] = {}
        self._held: Dict[str, int] = collections.Counter()

    def allow(self, key: str) -> Tuple[bool, int]:
        """(whether to log now, messages suppressed for this key since the last one logged)."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._period:
                self._held[key] += 1
                return False, 0
            self._last[key] = now
            return True, self._held.pop(key, 0)


class RollingWindow:
    """The last ``size`` samples of a quantity, with percentiles (thread-safe)."""

    def __init__(self, size: int = 600) -> None:
        self._values: Deque[float] = collections.deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        with self._lock:
            self._values.append(value)

    def clear(self) -> None:
        with self._lock:
            self._values.clear()

    def percentiles(self, *qs: float) -> List[float]:
        """The requested percentiles (0 when empty)."""
        with self._lock:
            data = np.fromiter(self._values, dtype=np.float64)
        if data.size == 0:
            return [0.0 for _ in qs]
        return [float(v) for v in np.percentile(data, qs)]


class RateMeter:
    """Events per second over the time since the previous :meth:`rate` call."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last_time = clock()
        self._last_count = 0

    def rate(self, count: int) -> float:
        """Rate of the cumulative ``count`` since the previous call."""
        now = self._clock()
        elapsed = now - self._last_time
        value = (count - self._last_count) / elapsed if elapsed > 0 else 0.0
        self._last_time, self._last_count = now, count
        return max(value, 0.0)


def status(name: str, hardware_id: str, level: bytes, message: str, values: Mapping[str, object]) -> DiagnosticStatus:
    """A ``DiagnosticStatus`` whose values are formatted as text (floats to 3 decimals)."""
    msg = DiagnosticStatus()
    msg.name = name
    msg.hardware_id = hardware_id
    msg.level = level
    msg.message = message
    msg.values = [KeyValue(key=key, value=_text(value)) for key, value in values.items()]
    return msg


def _text(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)

