"""State and action statistics of a dataset, and the normalisers made of them.

Statistics are computed over every frame (``data.stats.vector_stats``: exact quantiles, as
openpi's ``compute_norm_stats`` computes them over the whole dataset, not LeRobot's per-episode
aggregate). Normalisation is LeRobot's QUANTILES mode, ``2 (x - q01) / (q99 - q01) - 1``, done by
the very class the checkpoint loader builds from the written folder
(`checkpoints.lerobot.FeatureNorm`), so training and inference normalise identically.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from oxygen_ros.checkpoints.lerobot import FeatureNorm
from oxygen_ros.data.stats import vector_stats

from .dataset import ACTION_KEY, STATE_KEY, TrainingFrames

NORM_MODE = "QUANTILES"
NORM_EPS = 1e-8  # LeRobot's normaliser eps
# the statistics a LeRobot normaliser file holds per feature
WRITTEN_STATS = ("mean", "std", "min", "max", "q01", "q10", "q50", "q90", "q99")


@dataclasses.dataclass(frozen=True)
class DatasetNorms:
    """The statistics to write ({feature: {stat: values}}) and the normalisers they make."""

    stats: dict[str, dict[str, np.ndarray]]
    state: FeatureNorm
    action: FeatureNorm


def feature_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """LeRobot-style statistics of a [N, D] column, float32."""
    stats = vector_stats(values)
    return {name: np.asarray(stats[name], dtype=np.float32) for name in WRITTEN_STATS}


def dataset_norms(frames: TrainingFrames) -> DatasetNorms:
    """Quantile statistics of the state and action columns and their normalisers."""
    stats = {STATE_KEY: feature_stats(frames.states), ACTION_KEY: feature_stats(frames.actions)}

    def norm(key: str) -> FeatureNorm:
        kept = {s: stats[key][s] for s in ("q01", "q99")}
        return FeatureNorm(key, NORM_MODE, NORM_EPS, kept, int(stats[key]["q01"].size))

    return DatasetNorms(stats, norm(STATE_KEY), norm(ACTION_KEY))
