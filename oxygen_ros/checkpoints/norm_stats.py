"""openpi's ``norm_stats.json``: per-dimension statistics of state and actions, read and written.

    {"norm_stats": {"state": {"mean": [...], "std": [...], "q01": [...], "q99": [...]},
                    "actions": {...}}}

A checkpoint in openpi's layout keeps it in ``assets/<asset_id>/``; pi0.5 normalises with the
quantiles (`NormStats.normalize_quantile` / `unnormalize_quantile`), exactly as openpi does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Union

import numpy as np

logger = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]

# openpi's quantile normalisation adds this to the (q99 - q01) span.
QUANTILE_EPS = 1e-6
NORM_STATS_FILENAME = "norm_stats.json"
NORM_STATS_FIELDS = ("mean", "std", "q01", "q99")


class NormStatsError(ValueError):
    """A norm_stats.json that cannot be used for pi0.5 (missing keys, bad lengths, NaN, ...)."""


@dataclasses.dataclass(frozen=True)
class NormStats:
    """Per-dimension statistics of one quantity (``state`` or ``actions``), as in openpi.

    All four arrays are float64, 1-D and of equal length. pi0.5 uses only the quantiles; mean and
    std are kept because openpi's file format carries them.

    Raises:
        ValueError: on wrong shapes, non-finite values, negative std or q99 < q01. A dimension with
            q99 == q01 (constant in the data) is accepted with a warning, as openpi accepts it.
    """

    mean: np.ndarray
    std: np.ndarray
    q01: np.ndarray
    q99: np.ndarray

    def __post_init__(self) -> None:
        lengths = {}
        for name in NORM_STATS_FIELDS:
            value = np.array(getattr(self, name), dtype=np.float64)
            if value.ndim != 1 or value.size == 0:
                raise ValueError(f"{name} must be a non-empty 1-D array, got shape {value.shape}")
            bad = np.flatnonzero(~np.isfinite(value))
            if bad.size:
                raise ValueError(f"{name} has non-finite values at indices {bad.tolist()}")
            value.setflags(write=False)
            object.__setattr__(self, name, value)
            lengths[name] = value.size
        if len(set(lengths.values())) != 1:
            raise ValueError(f"mean/std/q01/q99 lengths differ: {lengths}")
        if (self.std < 0).any():
            raise ValueError(f"std is negative at indices {np.flatnonzero(self.std < 0).tolist()}")
        inverted = np.flatnonzero(self.q99 < self.q01)
        if inverted.size:
            raise ValueError(f"q99 < q01 at indices {inverted.tolist()}")
        constant = np.flatnonzero(self.q99 == self.q01)
        if constant.size:
            logger.warning(
                "norm stats: q99 == q01 at indices %s; those dimensions normalise by 1e-6",
                constant.tolist(),
            )

    @property
    def dim(self) -> int:
        return int(self.q01.size)

    def normalize_quantile(self, x: np.ndarray) -> np.ndarray:
        """``(x - q01) / (q99 - q01 + 1e-6) * 2 - 1`` over the last axis, in float64 (openpi).

        As in openpi, an ``x`` narrower than the stats uses their first ``x.shape[-1]`` entries.

        Raises:
            ValueError: if ``x`` is wider than the stats.
        """
        x = np.asarray(x, dtype=np.float64)
        n = self._width(x, "normalize")
        q01, q99 = self.q01[:n], self.q99[:n]
        return (x - q01) / (q99 - q01 + QUANTILE_EPS) * 2.0 - 1.0

    def unnormalize_quantile(self, y: np.ndarray) -> np.ndarray:
        """``(y + 1) / 2 * (q99 - q01 + 1e-6) + q01``, in float64 (openpi's `Unnormalize`).

        Dimensions beyond the stats (the model's zero padding) pass through unchanged, as in openpi;
        a ``y`` narrower than the stats uses their first ``y.shape[-1]`` entries.
        """
        y = np.asarray(y, dtype=np.float64)
        if y.ndim < 1:
            raise ValueError("unnormalize_quantile needs at least one axis")
        n = min(y.shape[-1], self.dim)
        head = (y[..., :n] + 1.0) / 2.0 * (self.q99[:n] - self.q01[:n] + QUANTILE_EPS) + self.q01[
            :n
        ]
        return np.concatenate([head, y[..., n:]], axis=-1)

    # The normaliser interface of `policy.Pi05Policy` (LeRobot folders bring
    # `checkpoints.lerobot.FeatureNorm`): openpi's pi0.5 normalises with the quantiles.
    def normalize(self, x: np.ndarray) -> np.ndarray:
        return self.normalize_quantile(x)

    def unnormalize(self, y: np.ndarray) -> np.ndarray:
        return self.unnormalize_quantile(y)

    def _width(self, x: np.ndarray, what: str) -> int:
        if x.ndim < 1:
            raise ValueError(f"{what} needs at least one axis")
        if x.shape[-1] > self.dim:
            raise ValueError(
                f"cannot {what} a vector of width {x.shape[-1]} with stats of width {self.dim}"
            )
        return x.shape[-1]

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name).tolist() for name in NORM_STATS_FIELDS}


def norm_stats_from_dict(
    data: Mapping[str, Any], required: Iterable[str] = ("state", "actions")
) -> dict[str, NormStats]:
    """Parse openpi's JSON structure ``{"norm_stats": {key: {mean, std, q01, q99}}}``.

    Raises:
        NormStatsError: naming the offending key and field.
    """
    if not isinstance(data, Mapping) or not isinstance(data.get("norm_stats"), Mapping):
        raise NormStatsError('expected a top-level object {"norm_stats": {...}}')
    entries = data["norm_stats"]
    missing = [k for k in required if k not in entries]
    if missing:
        raise NormStatsError(f"missing norm stats for {missing}; present: {sorted(entries)}")
    stats = {}
    for key, entry in entries.items():
        if not isinstance(entry, Mapping):
            raise NormStatsError(
                f"norm_stats[{key!r}] must be an object, got {type(entry).__name__}"
            )
        absent = [f for f in NORM_STATS_FIELDS if entry.get(f) is None]
        if absent:
            raise NormStatsError(
                f"norm_stats[{key!r}] lacks {absent} "
                "(pi0.5 uses quantile normalisation: q01 and q99 are required)"
            )
        try:
            stats[key] = NormStats(**{f: _as_vector(entry[f]) for f in NORM_STATS_FIELDS})
        except (ValueError, TypeError) as exc:
            raise NormStatsError(f"norm_stats[{key!r}]: {exc}") from exc
    return stats


def _as_vector(value: Any) -> np.ndarray:
    if not isinstance(value, list) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    ):
        raise ValueError(f"expected a list of numbers, got {str(value)[:80]}")
    return np.asarray(value, dtype=np.float64)


def load_norm_stats(
    path: PathLike, required: Iterable[str] = ("state", "actions")
) -> dict[str, NormStats]:
    """Load openpi's ``norm_stats.json`` (``path`` is the file or the directory holding it).

    Raises:
        FileNotFoundError: if the file does not exist.
        NormStatsError: if it is not valid JSON or not usable stats (see `norm_stats_from_dict`).
    """
    path = Path(path)
    if path.is_dir():
        path = path / NORM_STATS_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"norm stats file not found: {path}")
    try:
        # NaN/Infinity are not JSON; Python would accept them, so reject them explicitly.
        data = json.loads(path.read_text(encoding="utf-8"), parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise NormStatsError(f"{path} is not valid JSON: {exc}") from exc
    except ValueError as exc:
        raise NormStatsError(f"{path}: {exc}") from exc
    try:
        return norm_stats_from_dict(data, required)
    except NormStatsError as exc:
        raise NormStatsError(f"{path}: {exc}") from exc


def _reject_constant(name: str) -> float:
    raise ValueError(f"non-finite number {name} in norm stats")


def save_norm_stats(path: PathLike, stats: Mapping[str, NormStats]) -> Path:
    """Write stats in openpi's format; ``path`` is the file or a directory (-> norm_stats.json)."""
    path = Path(path)
    if path.is_dir() or path.suffix != ".json":
        path = path / NORM_STATS_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"norm_stats": {key: value.to_json() for key, value in stats.items()}}
    path.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path
