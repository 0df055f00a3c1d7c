"""State and action statistics of a dataset, and the normalisers made of them.

Statistics are computed over every frame (``data.stats.vector_stats``: exact quantiles, as
openpi's ``compute_norm_stats`` computes them over the whole dataset, not LeRobot's per-episode
aggregate). Normalisation is LeRobot's QUANTILES mode, ``2 (x - q01) / (q99 - q01) - 1``, done by
the very class the checkpoint loader builds from the written folder
(`checkpoints.lerobot.FeatureNorm`), so training and inference normalise identically.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from oxygen_ros.checkpoints.lerobot import FeatureNorm
from oxygen_ros.data.stats import vector_stats

from .dataset import ACTION_KEY, STATE_KEY, TrainingFrames, frame_chunk

RELATIVE_EXCLUDE = ("gripper",)  # with relative actions these stay absolute (LeRobot's default)
NORM_MODE = "QUANTILES"
NORM_EPS = 1e-8  # LeRobot's normaliser eps
# the statistics a LeRobot normaliser file holds per feature
WRITTEN_STATS = ("mean", "std", "min", "max", "q01", "q10", "q50", "q90", "q99")
NORMALIZER_FILES = "policy_preprocessor_step_*_normalizer_processor.safetensors"


@dataclasses.dataclass(frozen=True)
class DatasetNorms:
    """The statistics to write ({feature: {stat: values}}) and the normalisers they make;
    ``relative`` marks the action dims learned relative to the state (empty: all absolute)."""

    stats: dict[str, dict[str, np.ndarray]]
    state: FeatureNorm
    action: FeatureNorm
    relative: tuple[bool, ...] = ()

    @property
    def relative_mask(self) -> np.ndarray | None:
        return np.asarray(self.relative, dtype=bool) if any(self.relative) else None


def feature_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """LeRobot-style statistics of a [N, D] column, float32."""
    stats = vector_stats(values)
    return {name: np.asarray(stats[name], dtype=np.float32) for name in WRITTEN_STATS}


def dataset_norms(
    frames: TrainingFrames, relative: Sequence[bool] = (), horizon: int = 1
) -> DatasetNorms:
    """Quantile statistics of the state and action columns and their normalisers.

    With ``relative`` dims the action statistics are those of what the model learns: every
    frame's ``horizon``-row chunk with those dims relative to the frame's state.

    Raises:
        ValueError: a ``relative`` mask wider than the actions or the state.
    """
    mask = np.asarray(relative, dtype=bool)
    if mask.any():
        width = frames.actions.shape[1]
        if len(mask) != width or frames.states.shape[1] < width:
            raise ValueError(
                f"relative actions need one flag per action dim ({width}) and a state at least "
                f"as wide (got {len(mask)} flags, state {frames.states.shape[1]})"
            )
        chunks = [frame_chunk(frames, i, horizon, mask) for i in range(len(frames))]
        actions = np.concatenate(chunks)
    else:
        actions = frames.actions
    stats = {STATE_KEY: feature_stats(frames.states), ACTION_KEY: feature_stats(actions)}
    return DatasetNorms(
        stats,
        _quantile_norm(STATE_KEY, stats),
        _quantile_norm(ACTION_KEY, stats),
        tuple(bool(m) for m in mask),
    )


def checkpoint_norms(folder: Path) -> DatasetNorms:
    """The statistics a checkpoint written by ``oxygen-train`` (a LeRobot folder) normalises
    with, so that a run starting from its weights sees the same normalised values.

    Raises:
        ValueError: no single normaliser file in ``folder``, or one without the state's and the
            action's quantiles.
    """
    files = sorted(Path(folder).glob(NORMALIZER_FILES))
    if len(files) != 1:
        raise ValueError(
            f"{folder}: expected one LeRobot normaliser file ({NORMALIZER_FILES}), found "
            f"{len(files)}"
        )
    values = load_file(str(files[0]))
    stats = {
        key: {s: values[f"{key}.{s}"] for s in WRITTEN_STATS if f"{key}.{s}" in values}
        for key in (STATE_KEY, ACTION_KEY)
    }
    missing = [f"{k}.{q}" for k in stats for q in ("q01", "q99") if q not in stats[k]]
    if missing:
        raise ValueError(f"{files[0]}: no {', '.join(missing)}")
    return DatasetNorms(stats, _quantile_norm(STATE_KEY, stats), _quantile_norm(ACTION_KEY, stats))


def _quantile_norm(key: str, stats: dict[str, dict[str, np.ndarray]]) -> FeatureNorm:
    kept = {s: stats[key][s] for s in ("q01", "q99")}
    return FeatureNorm(key, NORM_MODE, NORM_EPS, kept, int(stats[key]["q01"].size))
