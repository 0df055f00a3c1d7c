"""Feature statistics of a LeRobotDataset v3, in the layout of LeRobot's
``datasets/compute_stats.py`` (v0.4.4 and main lay them out alike).

Per episode (``compute_episode_stats``), for every feature but strings:

* keys ``min``, ``max``, ``mean``, ``std`` (population), ``count`` (shape (1,)) and the quantiles
  ``q01``, ``q10``, ``q50``, ``q90``, ``q99`` (LeRobot's ``DEFAULT_QUANTILES``);
* a vector feature (N, D): per-dimension stats of shape (D,); a scalar column (N,) (timestamp,
  indices): shape (1,); count = N frames;
* an image feature: per-channel stats of shape (3, 1, 1) in [0, 1] (pixels / 255), over the frames
  LeRobot samples (:func:`sample_indices`: all frames up to 100, then ``N**0.75``, evenly
  spaced), each downsampled by an integer stride when its larger side is >= 300 px; count = the
  number of sampled frames.

The per-episode quantiles are not LeRobot's numbers. Here they are exact sample quantiles,
``numpy.quantile``'s linear method: position (N - 1)·q among the sorted values, interpolated
between its two neighbours (for uint8 images computed from the exact 256-level histogram, the same
numbers). LeRobot (v0.4.4 and main alike) estimates them with ``RunningQuantileStats``: a
5000-bin histogram over [min, max], read where the cumulative count reaches q·N and interpolated
inside that bin, so its median of an even-length episode is near the upper of the two middle
values, not their mean. The bins cost it at most 1/5000 of the range; the other definition costs
up to the gap between neighbouring sorted values, large on short episodes: up to 0.12 rad per
joint on the sim's 19-53-frame episodes. On images (thousands of pixels per channel) the two agree
within 0.05 of a pixel level.

Dataset stats (``meta/stats.json``) aggregate the episodes' as LeRobot main's ``aggregate_stats``
does (since its PR #3804): min of mins, max of maxes, count-weighted mean, pooled variance, sum of
counts, and for each quantile an envelope of the episodes' values, the min over episodes for
q <= 50 and the max for q > 50 (bounds across episodes, not quantiles of the pooled frames).
LeRobot v0.4.x (0.4.4 included) aggregates the same way except the quantiles, which it averages
weighted by the episodes' counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)
QUANTILE_KEYS = tuple(f"q{int(q * 100):02d}" for q in QUANTILES)

Stats = dict[str, np.ndarray]


def sample_indices(length: int) -> list[int]:
    """Frames whose images LeRobot uses for an episode's image stats."""
    min_samples, max_samples = 100, 10_000
    if length < min_samples:
        min_samples = length
    count = max(min_samples, min(int(length**0.75), max_samples))
    return np.round(np.linspace(0, length - 1, count)).astype(int).tolist()


def _downsample(image_chw: np.ndarray, target: int = 150, threshold: int = 300) -> np.ndarray:
    _, height, width = image_chw.shape
    if max(height, width) < threshold:
        return image_chw
    factor = int(width / target) if width > height else int(height / target)
    return image_chw[:, ::factor, ::factor]


def _stats_over_rows(rows: np.ndarray, count: int) -> Stats:
    """Stats over axis 0 of (samples, dims) float64 ``rows``."""
    stats: Stats = {
        "min": rows.min(axis=0),
        "max": rows.max(axis=0),
        "mean": rows.mean(axis=0),
        "std": rows.std(axis=0),
        "count": np.array([count], dtype=np.int64),
    }
    quantiles = np.quantile(rows, QUANTILES, axis=0)
    for key, value in zip(QUANTILE_KEYS, quantiles, strict=False):
        stats[key] = value
    return stats


def vector_stats(values: np.ndarray) -> Stats:
    """Stats of an (N,) or (N, D) numeric column."""
    values = np.asarray(values, dtype=np.float64)
    rows = values.reshape(len(values), -1)
    return _stats_over_rows(rows, len(values))


def _uint8_channel_stats(values: np.ndarray) -> dict[str, float]:
    """Exact stats (quantiles as ``numpy.quantile``'s linear method) of uint8 ``values`` from
    their 256-bin histogram: the same numbers as over the values, ~50x faster."""
    counts = np.bincount(values, minlength=256).astype(np.int64)
    levels = np.arange(256, dtype=np.float64)
    n = int(counts.sum())
    mean = float((counts * levels).sum() / n)
    present = np.flatnonzero(counts)
    out = {
        "min": float(present[0]),
        "max": float(present[-1]),
        "mean": mean,
        "std": float(np.sqrt((counts * (levels - mean) ** 2).sum() / n)),
    }
    ends = np.cumsum(counts)  # the sorted values' positions i < ends[v] hold v (or lower)
    for key, q in zip(QUANTILE_KEYS, QUANTILES, strict=True):
        h = (n - 1) * q
        lo = int(np.floor(h))
        below = float(np.searchsorted(ends, lo, side="right"))
        above = float(np.searchsorted(ends, min(lo + 1, n - 1), side="right"))
        out[key] = below + (h - lo) * (above - below)
    return out


def image_stats(images: Sequence[np.ndarray] | np.ndarray) -> Stats:
    """Per-channel stats, shape (3, 1, 1), in [0, 1], of an episode's (H, W, 3) uint8 images."""
    picked = [_downsample(np.transpose(images[i], (2, 0, 1))) for i in sample_indices(len(images))]
    stack = np.stack(picked)  # (S, C, H, W) uint8
    channels = [_uint8_channel_stats(stack[:, c].reshape(-1)) for c in range(stack.shape[1])]
    stats: Stats = {
        key: np.array([ch[key] for ch in channels]).reshape(-1, 1, 1) / 255.0
        for key in ("min", "max", "mean", "std", *QUANTILE_KEYS)
    }
    stats["count"] = np.array([len(picked)], dtype=np.int64)
    return stats


def aggregate_stats(per_episode: Sequence[Mapping[str, Stats]]) -> dict[str, Stats]:
    """Dataset stats from episodes' stats (see the module docstring)."""
    keys = list(dict.fromkeys(k for stats in per_episode for k in stats))
    out: dict[str, Stats] = {}
    for key in keys:
        items = [stats[key] for stats in per_episode if key in stats]
        counts = np.stack([s["count"] for s in items]).astype(np.float64)
        means = np.stack([s["mean"] for s in items])
        variances = np.stack([s["std"] ** 2 for s in items])
        weights = counts.reshape(counts.shape + (1,) * (means.ndim - counts.ndim))
        total = counts.sum(axis=0)
        mean = (means * weights).sum(axis=0) / total.reshape(total.shape + (1,) * (means.ndim - 2))
        variance = ((variances + (means - mean) ** 2) * weights).sum(axis=0) / total.reshape(
            total.shape + (1,) * (means.ndim - 2)
        )
        merged: Stats = {
            "min": np.min(np.stack([s["min"] for s in items]), axis=0),
            "max": np.max(np.stack([s["max"] for s in items]), axis=0),
            "mean": mean,
            "std": np.sqrt(variance),
            "count": total.astype(np.int64),
        }
        for q in QUANTILE_KEYS:
            values = np.stack([s[q] for s in items])
            merged[q] = values.min(axis=0) if int(q[1:]) <= 50 else values.max(axis=0)
        out[key] = merged
    return out
