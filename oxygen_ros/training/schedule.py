"""The learning-rate schedule: linear warmup, then cosine decay (openpi's ``CosineDecaySchedule``
shape: from ``peak / (warmup + 1)`` up to ``peak`` over ``warmup`` steps, then down to
``final_fraction * peak`` at ``total`` steps, flat after)."""

from __future__ import annotations

import math


def learning_rate(
    step: int, peak: float, warmup: int, total: int, final_fraction: float = 0.1
) -> float:
    """The learning rate of optimiser step ``step`` (0-based)."""
    if step < warmup:
        return peak * (step + 1) / (warmup + 1)
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    final = peak * final_fraction
    return final + (peak - final) * 0.5 * (1.0 + math.cos(math.pi * progress))
