"""Latency bookkeeping: per-batch-size decode step estimates and run summaries."""

from __future__ import annotations

from typing import Dict, Iterable, List

import numpy as np


class StepTimer:
    """Exponential moving average of decode-step latency per batch size (seconds)."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha = alpha
        self._ema: Dict[int, float] = {}

    def record(self, batch: int, seconds: float) -> None:
        old = self._ema.get(batch)
        self._ema[batch] = seconds if old is None else old + self.alpha * (seconds - old)

    def measured_sizes(self) -> List[int]:
        return sorted(self._ema)

    def estimate(self, batch: int) -> float:
        """Expected latency of a step at ``batch``; 0.0 when nothing has been measured yet.

        An unmeasured size borrows the nearest measured larger size, or scales the largest measured
        one linearly (pessimistic: batched decode grows sub-linearly).
        """
        if batch in self._ema:
            return self._ema[batch]
        if not self._ema:
            return 0.0
        larger = [b for b in self._ema if b > batch]
        if larger:
            return self._ema[min(larger)]
        top = max(self._ema)
        return self._ema[top] * batch / top


def percentile(values: Iterable[float], q: float) -> float:
    data = list(values)
    return float(np.percentile(data, q)) if data else 0.0


def summarize_ms(values: List[float]) -> Dict[str, float]:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "mean": float(np.mean(values)) if values else 0.0}
