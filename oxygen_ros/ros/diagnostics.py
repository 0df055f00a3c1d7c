"""What the node reports on ``/diagnostics``: error counters, rolling latency windows, rates, a
keyed log throttle, and :class:`DiagnosticsReport`, which builds the ``DiagnosticArray`` from the
node's state. Thread-safe where callbacks of several executor threads meet.

Nothing here decides behaviour; it only counts and summarises, so that every dropped input,
skipped tick or refused request is visible (``diagnostic_msgs/DiagnosticArray``) and logged at a
rate a person can read.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue

# Counters (see /diagnostics "counters") that mean something went wrong; the rest count normal
# events.
FAULT_COUNTER_PREFIXES = (
    "image_",
    "joint_",
    "no_action_",
    "tick_",
    "non_finite",
    "stale",
    "stamp_",
    "duplicate",
    "deadline",
    "late_ticks",
    "requests_refused",
    "requests_failed",
    "requests_stalled",
    "ask_rejected",
    "ask_dropped",
    "ask_action_rejected",
    "instruction_rejected",
    "executor_errors",
    "decode_errors",
    "text_publish_errors",
    "final_deltas_lost",
    "prompt_task_shortened",
    "engine_close_errors",
    "error_transitions",
)


class KeyedThrottle:
    """Lets one message per key through every ``period_s`` seconds, reporting how many were held.

    rclpy's ``throttle_duration_sec`` throttles per call site, so two topics failing at one call
    site would hide each other; this throttles per (topic, reason) key instead.
    """

    def __init__(self, period_s: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._period = period_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = collections.Counter()

    def allow(self, key: str) -> tuple[bool, int]:
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
        self._values: collections.deque[float] = collections.deque(maxlen=size)
        self._lock = threading.Lock()

    def add(self, value: float) -> None:
        with self._lock:
            self._values.append(value)

    def clear(self) -> None:
        with self._lock:
            self._values.clear()

    def percentiles(self, *qs: float) -> list[float]:
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


def status(
    name: str, hardware_id: str, level: bytes, message: str, values: Mapping[str, object]
) -> DiagnosticStatus:
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


class DiagnosticsReport:
    """Builds the node's ``DiagnosticArray`` once a second; remembers the previous counts so that
    the summary names the faults that are new in the last second."""

    def __init__(self) -> None:
        self._previous: dict[str, int] = {}

    def build(
        self, name: str, stamp: Any, state: str, last_error: str, settings: Any | None, loop: Any
    ) -> DiagnosticArray:
        """``settings`` is the node's NodeSettings (None while unconfigured), ``loop`` its
        TickLoop."""
        counters = loop.counters.snapshot()
        engine = loop.engine_stats
        frame_rate = loop.frame_rate.rate(loop.chunks_published)
        token_rate = loop.token_rate.rate(engine.get("tokens_generated", 0))
        new = {
            key: n - self._previous.get(key, 0)
            for key, n in counters.items()
            if n > self._previous.get(key, 0)
        }
        self._previous = counters
        new_faults = sorted(key for key in new if key.startswith(FAULT_COUNTER_PREFIXES))
        level, summary = _loop_summary(
            state, last_error, frame_rate, loop, new.get("deadline_misses", 0)
        )
        memory = {key: value for key, value in engine.items() if key.startswith("kv_")}
        internals = {
            key.removeprefix("engine_"): value
            for key, value in engine.items()
            if key.startswith("engine_")
        }
        captures = internals.get("captures_during_frames", 0)
        assembler = loop.assembler
        array = DiagnosticArray()
        array.header.stamp = stamp
        array.status = [
            status(
                f"{name}: action loop",
                "oxygen_ros",
                level,
                summary,
                _loop_values(state, last_error, settings, loop, counters, frame_rate),
            ),
            status(
                f"{name}: language",
                "oxygen_ros",
                DiagnosticStatus.OK,
                f"{token_rate:.1f} tok/s",
                _language_values(loop, counters, engine, token_rate),
            ),
            *(
                [
                    status(
                        f"{name}: subtask",
                        "oxygen_ros",
                        DiagnosticStatus.OK,
                        loop.subtask_stats["subtask"] or "no subtask yet",
                        loop.subtask_stats,
                    )
                ]
                if loop.subtask_stats
                else []
            ),
            *([_server_status(name, loop.server_stats)] if loop.server_stats else []),
            status(
                f"{name}: kv memory",
                "oxygen_ros",
                DiagnosticStatus.OK,
                f"{memory.get('kv_bytes_in_use', 0)} bytes in use",
                memory,
            ),
            status(
                f"{name}: engine",
                "oxygen_ros",
                DiagnosticStatus.WARN if captures else DiagnosticStatus.OK,
                f"{captures} graph capture(s) inside frames"
                if captures
                else "no capture inside frames",
                internals,
            ),
            status(
                f"{name}: inputs",
                "oxygen_ros",
                DiagnosticStatus.OK,
                f"{len(assembler.latest) if assembler else 0} topics",
                _input_values(loop),
            ),
            status(
                f"{name}: counters",
                "oxygen_ros",
                DiagnosticStatus.WARN if new_faults else DiagnosticStatus.OK,
                f"in the last second: {', '.join(new_faults)}" if new_faults else "no new faults",
                counters,
            ),
        ]
        return array


def _server_status(name: str, server: Mapping[str, object]) -> DiagnosticStatus:
    """engine remote: the connection to oxygen-serve (WARN while reconnecting)."""
    uri = server["server_uri"]
    if server["server_connected"]:
        return status(
            f"{name}: server", "oxygen_ros", DiagnosticStatus.OK, f"connected to {uri}", server
        )
    return status(
        f"{name}: server",
        "oxygen_ros",
        DiagnosticStatus.WARN,
        f"disconnected from {uri}: {server['server_last_error']}; reconnecting",
        server,
    )


def _loop_summary(
    state: str, last_error: str, frame_rate: float, loop: Any, new_misses: int
) -> tuple[bytes, str]:
    governor, cost = loop.governor, loop.warm_up_cost
    if last_error:
        return DiagnosticStatus.ERROR, last_error
    if state != "active":
        return DiagnosticStatus.OK, f"{state}: no output"
    if frame_rate == 0.0:
        return DiagnosticStatus.WARN, "active but no action chunk in the last second"
    if governor.effective_hz < governor.requested_hz:
        return DiagnosticStatus.WARN, (
            f"replanning at {governor.effective_hz:g} Hz of the requested "
            f"{governor.requested_hz:g} "
            f"Hz: ticks hold about {governor.holdable_hz:.1f} Hz with room for language"
        )
    if cost is not None and cost.holdable_hz() < governor.requested_hz and not governor.adapt:
        return DiagnosticStatus.WARN, (
            f"rate_hz {governor.requested_hz:g} cannot be held with room for language: a tick "
            f"costs {cost.total_s * 1e3:.1f} ms at warm-up (overrun_policy skip)"
        )
    if new_misses:
        return DiagnosticStatus.WARN, f"{new_misses} deadline miss(es) in the last second"
    return DiagnosticStatus.OK, f"{frame_rate:.1f} Hz"


def _loop_values(
    state: str,
    last_error: str,
    settings: Any | None,
    loop: Any,
    counters: Mapping[str, int],
    frame_rate: float,
) -> dict[str, object]:
    governor, cost = loop.governor, loop.warm_up_cost
    action_p50, action_p99 = loop.action_ms.percentiles(50, 99)
    prefill_p50, prefill_p99 = loop.prefill_ms.percentiles(50, 99)
    (tick_p99,) = loop.tick_ms.percentiles(99)
    return {
        "state": state,
        "rate_hz": settings.rate_hz if settings else 0.0,
        "requested_rate_hz": governor.requested_hz,
        "effective_rate_hz": governor.effective_hz,
        "overrun_policy": settings.overrun_policy if settings else "",
        "rate_changes": counters.get("rate_changes", 0),
        "warmup_tick_ms": cost.total_s * 1e3 if cost else 0.0,
        "warmup_action_path_ms": cost.action_s * 1e3 if cost else 0.0,
        "warmup_language_step_ms": cost.language_step_s * 1e3 if cost else 0.0,
        "warmup_holdable_rate_hz": min(cost.holdable_hz(), 1e6) if cost else 0.0,
        "rate_feasible": cost.holdable_hz() >= governor.requested_hz if cost else False,
        "frame_rate_hz": frame_rate,
        "chunks_published": loop.chunks_published,
        "deadline_misses": counters.get("deadline_misses", 0),
        "tick_overruns": counters.get("tick_overruns", 0),
        "late_ticks": counters.get("late_ticks", 0),
        "action_latency_p50_ms": action_p50,
        "action_latency_p99_ms": action_p99,
        "prefill_ms_p50": prefill_p50,
        "prefill_ms_p99": prefill_p99,
        "tick_ms_p99": tick_p99,
        "dry_run": bool(settings.dry_run) if settings else False,
        "task": settings.task if settings else "",
        "consecutive_failures": loop.failing_ticks,
        "max_consecutive_failures": settings.max_consecutive_failures if settings else 0,
        "last_error": last_error,
    }


def _language_values(
    loop: Any, counters: Mapping[str, int], engine: Mapping[str, int], token_rate: float
) -> dict[str, object]:
    return {
        "tokens_per_s": token_rate,
        "active_requests": engine.get("active_requests", 0),
        "queued_requests": engine.get("queued_requests", 0),
        "questions_waiting": len(loop.questions),
        "ask_goals_open": len(loop.asks),
        "tokens_generated": engine.get("tokens_generated", 0),
        "decode_steps": engine.get("decode_steps", 0),
        "requests_finished": counters.get("requests_finished", 0),
        "requests_refused": counters.get("requests_refused", 0),
        "requests_failed": counters.get("requests_failed", 0),
        "publish_ms_per_delta": loop.publish_cost.per_delta_s * 1e3,
        "publish_reserve_ms": loop.publish_cost.expected_s() * 1e3,
    }


def _input_values(loop: Any) -> dict[str, object]:
    values: dict[str, object] = {}
    assembler = loop.assembler
    if assembler is None:
        return values
    for topic, latest in assembler.latest.items():
        age = loop.ages.get(topic)
        values[f"input_age_s {topic}"] = "never" if age is None else age
        values[f"received {topic}"] = latest.received
    for topic, count in assembler.masked_ticks.items():
        values[f"masked_ticks {topic}"] = count
    return values
