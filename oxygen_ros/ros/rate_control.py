"""How fast the node can replan: the rate a tick's measured cost allows, and the adaptive rate of
``overrun_policy: adapt``.

A tick holds its rate when the action path (assembling the observation, prefill, action expert,
limits, publishing the chunk) takes at most ``1 - LANGUAGE_SHARE`` of the period and one language
step (plus the publishing of its text and the decode margin) still fits in the rest. Language then
always gets slack, even on a machine too slow for ``rate_hz``.

:class:`RateGovernor` lowers the effective rate to what the recent ticks can hold and returns it to
``rate_hz`` when their cost allows. It lowers fast (one window of ticks) and raises slowly (over
``RAISE_WINDOWS`` windows), so a machine whose load comes and goes does not swing the rate with
every burst. Two thresholds keep it from oscillating: it lowers only when the holdable rate falls
clearly below the effective one (``LOWER_BELOW``), raises only when it is well above it
(``RAISE_ABOVE``), and after each change it judges the new rate by ticks measured at it only.
Pure Python, no rclpy: the node feeds it one sample per tick.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np

LANGUAGE_SHARE = 0.25  # of each period kept for language when judging whether a rate can be held
WINDOW_TICKS = 30  # ticks measured (at the current rate) before lowering it
RAISE_WINDOWS = 3  # raising looks at this many windows of ticks
COST_PERCENTILE = 90  # the rate is chosen for this percentile of the window's tick costs
LOWER_BELOW = 0.95  # lower when the holdable rate is below this fraction of the effective rate
RAISE_ABOVE = 1.25  # raise when the holdable rate is above this multiple of the effective rate
TARGET_HEADROOM = 1.1  # a new rate leaves the holdable one this much above it
MIN_RATE_HZ = 1.0  # the lowest rate_hz a parameter may ask for


@dataclasses.dataclass(frozen=True)
class TickCost:
    """What one tick must spend (seconds): the action path and one language step after it."""

    action_s: float  # tick start -> chunk published
    language_step_s: float  # one decode step at batch 1, with the publishing of its delta
    margin_s: float  # decode_margin_ms: kept free before the next tick

    @property
    def total_s(self) -> float:
        return self.action_s + self.language_step_s + self.margin_s

    def period_needed_s(self) -> float:
        """The shortest period that holds this cost with room for language."""
        return max(self.action_s / (1.0 - LANGUAGE_SHARE), self.total_s)

    def holdable_hz(self) -> float:
        """The highest rate this cost can hold (inf for a zero cost)."""
        period = self.period_needed_s()
        return math.inf if period <= 0.0 else 1.0 / period


class RateGovernor:
    """The effective replanning rate: ``requested_hz`` while ticks hold it, lower while they cannot.

    ``adapt=False`` (``overrun_policy: skip``) keeps the requested rate whatever the cost.
    """

    def __init__(self, requested_hz: float, adapt: bool = True, window: int = WINDOW_TICKS) -> None:
        if requested_hz <= 0 or window < 1:
            raise ValueError(
                f"requested_hz must be > 0 and window >= 1, got {requested_hz}, {window}"
            )
        self.requested_hz = requested_hz
        self.adapt = adapt
        self.effective_hz = requested_hz
        self.holdable_hz = math.inf  # what the last full window of ticks could hold
        self._window = window
        self._holdable: collections.deque[float] = collections.deque(maxlen=window * RAISE_WINDOWS)

    def reset(self, requested_hz: float, adapt: bool, start_hz: float | None = None) -> None:
        """A new requested rate or policy; ``start_hz`` (adapt only) starts below the request, e.g.
        at the rate the warm-up measured."""
        self.requested_hz, self.adapt = requested_hz, adapt
        start = requested_hz if start_hz is None or not adapt else min(requested_hz, start_hz)
        self.effective_hz = (
            max(_rounded(start), MIN_RATE_HZ) if start < requested_hz else requested_hz
        )
        self.holdable_hz = math.inf if start_hz is None else start_hz
        self._holdable.clear()

    @property
    def effective_period_s(self) -> float:
        return 1.0 / self.effective_hz

    def record(self, cost: TickCost) -> float | None:
        """One tick's cost. Returns the new effective rate when it changes, else None."""
        if not self.adapt:
            return None
        self._holdable.append(cost.holdable_hz())
        if len(self._holdable) < self._window:
            return None
        samples = np.fromiter(self._holdable, dtype=np.float64)
        recent = float(np.percentile(samples[-self._window :], 100 - COST_PERCENTILE))
        self.holdable_hz = recent
        target = None
        if recent < self.effective_hz * LOWER_BELOW:
            target = max(MIN_RATE_HZ, _rounded(recent / TARGET_HEADROOM))
        elif self.effective_hz < self.requested_hz and len(samples) == self._holdable.maxlen:
            sustained = float(np.percentile(samples, 100 - COST_PERCENTILE))
            if sustained >= self.effective_hz * RAISE_ABOVE:
                target = min(self.requested_hz, _rounded(sustained / TARGET_HEADROOM))
        if target is None or target == self.effective_hz:
            return None
        self.effective_hz = target
        self._holdable.clear()  # judge the new rate by ticks measured at it
        return target


def _rounded(rate_hz: float) -> float:
    """Rates move in steps of 0.1 Hz (readable logs; no change for noise below that)."""
    return math.floor(rate_hz * 10.0) / 10.0
