"""Latency bookkeeping: step estimates per batch size and context, and percentiles."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class StepTimer:
    """Exponential moving average of step latency (seconds) per (batch size, context bucket).

    The context is the token count a step works over: for a decode step the longest context read
    by a row (a batch of long contexts costs more than the same batch of short ones); for an
    admission prefill its new tokens. Contexts are bucketed to multiples of ``context_step``.
    """

    def __init__(self, alpha: float = 0.2, context_step: int = 128) -> None:
        if context_step < 1:
            raise ValueError(f"context_step must be >= 1, got {context_step}")
        self.alpha = alpha
        self.context_step = context_step
        self._ema: dict[tuple[int, int], float] = {}

    def key(self, batch: int, context: int = 0) -> tuple[int, int]:
        """(batch, context rounded up to the bucket: at least one bucket)."""
        step = self.context_step
        return batch, max(step, -(-context // step) * step)

    def record(self, batch: int, seconds: float, context: int = 0) -> None:
        key = self.key(batch, context)
        old = self._ema.get(key)
        self._ema[key] = seconds if old is None else old + self.alpha * (seconds - old)

    def measured_sizes(self) -> list[int]:
        """Batch sizes with at least one measurement."""
        return sorted({batch for batch, _ in self._ema})

    def measured_keys(self) -> list[tuple[int, int]]:
        return sorted(self._ema)

    def estimate(self, batch: int, context: int = 0) -> float:
        """Expected latency of a step of ``batch`` rows over ``context`` tokens; 0.0 when nothing
        has been measured yet.

        An unmeasured key is estimated conservatively from its neighbours: each measured key
        (b, c) bounds it by its latency scaled linearly up in batch and context where the wanted
        key is larger (b/b', c/c' when > 1; batched steps grow sub-linearly in both), and the
        tightest such bound is taken — so a measured larger neighbour is borrowed as it is.
        """
        key = self.key(batch, context)
        seconds = self._ema.get(key)
        if seconds is not None:
            return seconds
        if not self._ema:
            return 0.0
        b, c = key
        return min(t * max(1.0, b / mb) * max(1.0, c / mc) for (mb, mc), t in self._ema.items())


def percentile(values: Iterable[float], q: float) -> float:
    data = list(values)
    return float(np.percentile(data, q)) if data else 0.0
