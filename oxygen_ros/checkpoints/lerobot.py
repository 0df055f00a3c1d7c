"""LeRobot ``pi05`` checkpoint folders (``lerobot-train --policy.type=pi05``), read as they are.

A LeRobot ``pretrained_model/`` folder holds::

    config.json                          the policy config, "type": "pi05"
    model.safetensors                    weights: "model." + openpi's state-dict names
    policy_preprocessor.json             processor steps; the normalizer step's "state_file"
    policy_preprocessor_step_<i>_normalizer_processor.safetensors   "<feature>.<stat>" tensors
    policy_postprocessor.json (+ its unnormalizer state file)        the action statistics

This module decides which format a folder is in (`detect_format`), maps LeRobot's tensor names
onto openpi's (`weight_plan`), reads the policy config and the processor steps (`read_lerobot`),
and normalises exactly as LeRobot's ``NormalizerProcessorStep`` does (`FeatureNorm`), in float32
with LeRobot's own epsilon rules (they are not openpi's). Nothing here imports LeRobot.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..model.config import PRESETS, Pi05Config
from ..model.pi05 import Pi05Model
from .conventions import InputConventions, lerobot_conventions
from .core import (
    MODEL_FILENAME,
    CheckpointError,
    DTypeLike,
    LoadedCheckpoint,
    as_dtype,
    build_model,
    expected_file_tensors,
    find_tensor_problems,
    infer_config,
    read_safetensors_header,
    stream_weights,
)

logger = logging.getLogger(__name__)

CONFIG_FILENAME = "config.json"
PREPROCESSOR_FILENAME = "policy_preprocessor.json"
POSTPROCESSOR_FILENAME = "policy_postprocessor.json"
POLICY_TYPE = "pi05"
NORMALIZER_STEP = "normalizer_processor"
UNNORMALIZER_STEP = "unnormalizer_processor"
RELATIVE_STEP = "relative_actions_processor"
TOKENIZER_STEP = "tokenizer_processor"
STATE_KEY = "observation.state"
ACTION_KEY = "action"
IMAGE_PREFIX = "observation.images."
VISUAL, STATE, ACTION = "VISUAL", "STATE", "ACTION"
IDENTITY, MEAN_STD, MIN_MAX, QUANTILES, QUANTILE10 = (
    "IDENTITY",
    "MEAN_STD",
    "MIN_MAX",
    "QUANTILES",
    "QUANTILE10",
)
NORM_MODES = (IDENTITY, MEAN_STD, MIN_MAX, QUANTILES, QUANTILE10)
# LeRobot's FeatureType names (configs/types.py).
FEATURE_TYPES = (STATE, VISUAL, "ENV", ACTION, "REWARD", "LANGUAGE")
# LeRobot's PI05Config defaults (configuration_pi05.py), used when config.json omits a field.
DEFAULT_EPS = 1e-8
DEFAULT_NORMALIZATION = {VISUAL: IDENTITY, STATE: QUANTILES, ACTION: QUANTILES}
DEFAULT_MAX_DIM = 32
DEFAULT_TIME_PERIODS = (4e-3, 4.0)

# -- tensor names ---------------------------------------------------------------------------------
PREFIX = "model."
TIED_LM_HEAD = "paligemma_with_expert.paligemma.lm_head.weight"
TIED_EMBED = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
RENAMES = (("action_time_mlp_in.", "time_mlp_in."), ("action_time_mlp_out.", "time_mlp_out."))
# Dropped by LeRobot's own loader (pi0 leftovers): the state projection and plain expert norm
# weights (pi0.5's expert norms are adaRMS, `dense.*`).
DROPPED = re.compile(
    r"^(state_proj\.|paligemma_with_expert\.gemma_expert\.model\."
    r"(layers\.\d+\.(input_layernorm|post_attention_layernorm)|norm)\.weight$)"
)
# Tensors of LeRobot's MEM variant (proprioceptive memory), which this package does not run.
MEM_ONLY = ("proprio_history_proj.",)


class LeRobotFormatError(CheckpointError):
    """A folder that is not a loadable LeRobot pi05 checkpoint (the message says what was found)."""


def read_json(path: Path) -> Any:
    """A JSON file of a LeRobot folder.

    Raises:
        LeRobotFormatError: an unreadable file, invalid JSON or UTF-8, or JSON nested too deeply
            for Python's parser (which recurses once per level); the message names the file.
    """
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except RecursionError as exc:
        raise LeRobotFormatError(
            f"{path} is not readable JSON: nested too deeply to parse ({exc})"
        ) from exc
    except (OSError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
        raise LeRobotFormatError(f"{path} is not readable JSON: {exc}") from exc


# -- tensor names ---------------------------------------------------------------------------------


def openpi_key(file_key: str) -> str | None:
    """LeRobot tensor name -> openpi's name in model.safetensors; None: dropped as LeRobot does.

    Strips exactly one leading ``model.`` (never the inner ``paligemma.model.``), then applies
    LeRobot's renames (``action_time_mlp_*`` -> ``time_mlp_*``) and drops (``state_proj``, plain
    expert norm weights).
    """
    key = file_key[len(PREFIX) :] if file_key.startswith(PREFIX) else file_key
    for old, new in RENAMES:
        if key.startswith(old):
            key = new + key[len(old) :]
    return None if DROPPED.match(key) else key


def weight_plan(
    header: Mapping[str, tuple[str, tuple[int, ...]]],
) -> tuple[dict[str, str | None], dict[str, tuple[str, tuple[int, ...]]]]:
    """Map a LeRobot file's tensors onto openpi's names.

    Returns ``(plan, mapped)``: ``plan`` maps every file key to its openpi file key (None: not
    loaded), ``mapped`` is the header under openpi's names (what `core.find_tensor_problems`
    checks). The tied token embedding is stored as ``lm_head`` (as in openpi); a file holding only
    ``embed_tokens`` (LeRobot main copies one into the other) is read from there.

    Raises:
        LeRobotFormatError: MEM tensors (``proprio_history_proj``) or two tensors mapping onto one
            name.
    """
    mem = sorted(k for k in header if openpi_key(k) and openpi_key(k).startswith(MEM_ONLY))
    if mem:
        raise LeRobotFormatError(
            f"tensors {mem[:4]} belong to LeRobot's MEM variant (use_proprioceptive_memory: a "
            "proprioceptive-history projection into the backbone), which pi0.5 here does not run"
        )
    plan: dict[str, str | None] = {}
    owners: dict[str, str] = {}
    for file_key in header:
        target = openpi_key(file_key)
        if target is None:
            logger.debug("dropping %s: LeRobot's loader drops it too", file_key)
        elif target in owners:
            raise LeRobotFormatError(
                f"tensors {owners[target]!r} and {file_key!r} both map onto {target!r}"
            )
        else:
            owners[target] = file_key
        plan[file_key] = target
    if TIED_EMBED in owners:
        if TIED_LM_HEAD in owners:  # both names written: the head is the one openpi reads
            plan[owners.pop(TIED_EMBED)] = None
        else:
            plan[owners[TIED_EMBED]] = TIED_LM_HEAD
            owners[TIED_LM_HEAD] = owners.pop(TIED_EMBED)
    mapped = {target: header[file_key] for target, file_key in owners.items()}
    return plan, mapped


# -- normalisation --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FeatureNorm:
    """One feature's normalisation exactly as LeRobot's (un)normalizer step computes it.

    float32 torch arithmetic in LeRobot's operation order. A range whose width is 0 divides by
    ``eps`` (QUANTILES, QUANTILE10, MIN_MAX); MEAN_STD divides by ``std + eps``; the inverses use
    the raw width / std. IDENTITY, or no statistics for the feature, passes values through.
    """

    key: str
    mode: str
    eps: float = DEFAULT_EPS
    stats: Mapping[str, np.ndarray] = dataclasses.field(default_factory=dict)
    dim: int | None = None  # the feature's width (config shape), None: unknown

    @property
    def passthrough(self) -> bool:
        return self.mode == IDENTITY or not self.stats

    def _stat(self, name: str, width: int) -> torch.Tensor:
        return torch.from_numpy(self.stats[name][:width])

    def _range(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        low, high = {
            QUANTILES: ("q01", "q99"),
            QUANTILE10: ("q10", "q90"),
            MIN_MAX: ("min", "max"),
        }[self.mode]
        lo = self._stat(low, width)
        denom = self._stat(high, width) - lo
        denom = torch.where(denom == 0, torch.tensor(self.eps, dtype=torch.float32), denom)
        return lo, denom

    def _check(self, x: np.ndarray) -> torch.Tensor:
        """``x`` as float32; narrower than the statistics uses their leading entries (a robot
        that drives the first dims only), wider is an error."""
        x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        width = next(iter(self.stats.values())).shape[-1]
        if x.ndim < 1 or x.shape[-1] > width:
            raise ValueError(
                f"{self.key}: expected at most width {width} (the checkpoint's statistics), got "
                f"{tuple(x.shape)}"
            )
        return x

    def normalize(self, x: np.ndarray) -> np.ndarray:
        """Raw values -> model space (float32)."""
        if self.passthrough:
            return np.asarray(x, dtype=np.float32)
        t = self._check(x)
        width = t.shape[-1]
        if self.mode == MEAN_STD:
            return ((t - self._stat("mean", width)) / (self._stat("std", width) + self.eps)).numpy()
        lo, denom = self._range(width)
        return (2.0 * (t - lo) / denom - 1.0).numpy()

    def unnormalize(self, y: np.ndarray) -> np.ndarray:
        """Model space -> raw values (float32)."""
        if self.passthrough:
            return np.asarray(y, dtype=np.float32)
        t = self._check(y)
        width = t.shape[-1]
        if self.mode == MEAN_STD:
            return (t * self._stat("std", width) + self._stat("mean", width)).numpy()
        lo, denom = self._range(width)
        if self.mode == MIN_MAX:
            return ((t + 1) / 2 * denom + lo).numpy()
        return ((t + 1.0) * denom / 2.0 + lo).numpy()

    def describe(self) -> str:
        if not self.stats:
            return f"{self.key}: {self.mode}, no statistics (passes through)"
        if self.mode == IDENTITY:
            return f"{self.key}: IDENTITY"
        return f"{self.key}: {self.mode} (eps {self.eps:g}) over {self.dim or '?'} dims"


_NEEDED_STATS = {
    MEAN_STD: ("mean", "std"),
    MIN_MAX: ("min", "max"),
    QUANTILES: ("q01", "q99"),
    QUANTILE10: ("q10", "q90"),
    IDENTITY: (),
}


# -- the folder -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LeRobotSpec:
    """What a LeRobot pi05 folder says about running it (see `read_lerobot`)."""

    cameras: tuple[str, ...]  # image keys, in input_features order, then the empty cameras
    empty_cameras: int
    state_dim: int | None  # input_features observation.state width
    action_dim: int  # output_features action width: the real action dimension
    chunk_size: int
    n_action_steps: int
    num_inference_steps: int
    max_state_dim: int
    max_action_dim: int
    tokenizer_max_length: int
    image_resolution: tuple[int, int]
    state_norm: FeatureNorm
    action_norm: FeatureNorm
    relative_actions: tuple[bool, ...]  # per action dim: the raw state is added back; () = none
    conventions: InputConventions
    files: tuple[str, ...]  # every file read
    notes: tuple[str, ...]  # what was read and what it decides, for logs and oxygen-model-info

    @property
    def uses_relative_actions(self) -> bool:
        return any(self.relative_actions)


# -- reading fields: each check names the file and the field --------------------------------------
# Every value the loader takes from config.json or a processor file goes through one of these, so a
# folder that lies is refused at load with a LeRobotFormatError, never a bare Python error later.


def _show(value: Any) -> str:
    """A value for an error message, cut short (a lying file may hold anything)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse(where: object, field: str, expected: str, value: Any) -> LeRobotFormatError:
    return LeRobotFormatError(f"{where}: {field} must be {expected}, got {_show(value)}")


def _integer(
    values: Mapping[str, Any], name: str, default: int, where: object, minimum: int = 1
) -> int:
    """``values[name]`` (``default`` when absent): an integer >= ``minimum``; a bool, a float such
    as 2.5 or 2.0, a string or null is refused."""
    value = values.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise _refuse(where, name, expected, value)
    return value


def _number(
    values: Mapping[str, Any], name: str, default: float, where: object, positive: bool = False
) -> float:
    """``values[name]`` (``default`` when absent): a finite number (JSON's NaN and Infinity
    parse), above zero when ``positive``."""
    value = values.get(name, default)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or (positive and value <= 0)
    ):
        raise _refuse(where, name, "a positive number" if positive else "a finite number", value)
    return float(value)


def _flag(values: Mapping[str, Any], name: str, default: bool, where: object) -> bool:
    """``values[name]`` (``default`` when absent): true or false (the string "false" is not)."""
    value = values.get(name, default)
    if not isinstance(value, bool):
        raise _refuse(where, name, "true or false", value)
    return value


def _object(values: Mapping[str, Any], name: str, where: object) -> dict[str, Any]:
    """``values[name]``: a JSON object; absent or null is an empty one."""
    value = values.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _refuse(where, name, "an object", value)
    return value


def _names(values: Mapping[str, Any], name: str, where: object) -> list[str] | None:
    """``values[name]``: a list of strings; absent or null is None."""
    value = values.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _refuse(where, name, "a list of strings", value)
    return value


def _shape(value: Any, field: str, where: object, ndim: int | None = None) -> tuple[int, ...]:
    """A shape: a non-empty list of positive integers (of ``ndim`` entries when given)."""
    if (
        not isinstance(value, list)
        or not value
        or (ndim is not None and len(value) != ndim)
        or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value)
    ):
        count = f"{ndim} " if ndim is not None else ""
        raise _refuse(where, field, f"a list of {count}positive integers", value)
    return tuple(value)


def _norm_map(values: Mapping[str, Any], name: str, where: object) -> dict[str, str]:
    """A LeRobot normalisation mapping: {feature type: mode}, both names LeRobot knows."""
    mapping = _object(values, name, where)
    for kind, mode in mapping.items():
        if kind not in FEATURE_TYPES:
            raise _refuse(where, f"{name} key", f"one of {', '.join(FEATURE_TYPES)}", kind)
        if mode not in NORM_MODES:
            raise _refuse(where, f"{name}[{kind!r}]", f"one of {', '.join(NORM_MODES)}", mode)
    return mapping


def _features(values: Mapping[str, Any], name: str, where: object) -> dict[str, dict[str, Any]]:
    """LeRobot features {key: {"type", "shape"}}: known types, shapes of positive integers, a
    camera [3, height, width], the state and the action one width each."""
    features = _object(values, name, where)
    for key, feature in features.items():
        field = f"{name}[{key!r}]"
        if not isinstance(feature, dict):
            raise _refuse(where, field, "an object {type, shape}", feature)
        kind = feature.get("type")
        if kind not in FEATURE_TYPES:
            raise _refuse(where, f"{field}.type", f"one of {', '.join(FEATURE_TYPES)}", kind)
        expected_kind = {STATE_KEY: STATE, ACTION_KEY: ACTION}.get(key)
        if expected_kind is not None and kind != expected_kind:
            raise _refuse(where, f"{field}.type", repr(expected_kind), kind)
        shape = feature.get("shape")
        if kind == VISUAL:
            if _shape(shape, f"{field}.shape", where, 3)[0] != 3:
                raise _refuse(
                    where, f"{field}.shape", "[3, height, width] (RGB, channels first)", shape
                )
        else:
            _shape(shape, f"{field}.shape", where, 1 if kind in (STATE, ACTION) else None)
    return features


def _width(feature: Mapping[str, Any] | None) -> int | None:
    """A feature's width (its shape, checked by `_features`, has one entry); None: no feature."""
    return None if feature is None else feature["shape"][0]


def _steps(ckpt_dir: Path, filename: str) -> list[dict[str, Any]]:
    """A processor file's steps (none when the file is absent), each checked: an object whose
    ``registry_name`` and ``state_file`` are strings and whose ``config`` is an object."""
    path = ckpt_dir / filename
    if not path.is_file():
        return []
    written = read_json(path)
    if not isinstance(written, dict):
        raise LeRobotFormatError(f"{path} must hold a JSON object {{'steps': [...]}}")
    steps = written.get("steps")
    if not isinstance(steps, list):
        raise _refuse(path, "steps", "a list of step objects", steps)
    for i, step in enumerate(steps):
        where = f"{path} steps[{i}]"
        if not isinstance(step, dict):
            raise _refuse(where, "the step", "an object", step)
        for field in ("registry_name", "state_file"):
            if step.get(field) is not None and not isinstance(step[field], str):
                raise _refuse(where, field, "a string", step[field])
        _object(step, "config", where)
    return steps


def _step(steps: Sequence[dict[str, Any]], registry_name: str, path: Path) -> dict | None:
    found = [s for s in steps if s.get("registry_name") == registry_name]
    if len(found) > 1:
        raise LeRobotFormatError(f"{path}: {len(found)} {registry_name!r} steps; expected one")
    return found[0] if found else None


def _read_stats(ckpt_dir: Path, step: Mapping[str, Any], source: str) -> dict[str, dict]:
    """``<feature>.<stat>`` tensors of a normalizer step's ``state_file`` -> {feature: {stat}}."""
    state_file = step.get("state_file")
    if state_file is None:
        return {}
    if not state_file or Path(state_file).name != state_file:
        raise _refuse(source, "state_file", "a file name in the checkpoint folder", state_file)
    path = ckpt_dir / state_file
    if not path.is_file():
        raise LeRobotFormatError(
            f"{source} names the statistics file {state_file!r}, which is not in {ckpt_dir}"
        )
    try:
        flat = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise LeRobotFormatError(f"{path} is not a readable safetensors file: {exc}") from exc
    stats: dict[str, dict[str, np.ndarray]] = {}
    for name, tensor in flat.items():
        feature, _, stat = name.rpartition(".")
        values = tensor.detach().to(torch.float32).numpy()
        if not np.isfinite(values).all():
            raise LeRobotFormatError(f"{path}: {name} holds non-finite values")
        stats.setdefault(feature, {})[stat] = values
    return stats


def _norm_mode(
    key: str,
    kind: str,
    step: Mapping[str, Any] | None,
    fallback_map: Mapping[str, str],
    source: str,
) -> str:
    """The mode LeRobot's step applies to ``key`` (IDENTITY: passes through), its config checked.

    LeRobot normalises an observation only if the step lists it among its features (and in
    normalize_observation_keys when that is set); the action always. A feature without statistics
    passes through whatever its mode.
    """
    where = f"{source} config"
    cfg = (step or {}).get("config") or {}
    norm_map = _norm_map(cfg, "norm_map", where) or fallback_map
    listed = _features(cfg, "features", where)
    keys = _names(cfg, "normalize_observation_keys", where)
    if (
        kind != ACTION
        and step is not None
        and (key not in listed or (keys is not None and key not in keys))
    ):
        return IDENTITY
    return norm_map.get(kind, IDENTITY)


def _feature_norm(
    key: str,
    kind: str,
    step: Mapping[str, Any] | None,
    stats: Mapping[str, Mapping[str, np.ndarray]],
    fallback_map: Mapping[str, str],
    dim: int | None,
    source: str,
) -> FeatureNorm:
    eps = _number((step or {}).get("config") or {}, "eps", DEFAULT_EPS, f"{source} config", True)
    mode = _norm_mode(key, kind, step, fallback_map, source)
    if mode == IDENTITY or not stats.get(key):
        return FeatureNorm(key, mode, eps, {}, dim)
    own = stats[key]
    needed = _NEEDED_STATS[mode]
    missing = [s for s in needed if s not in own]
    if missing:
        raise LeRobotFormatError(
            f"{source}: {key} is normalised with {mode} but its statistics lack {missing} "
            f"(present: {sorted(own)})"
        )
    for name in needed:
        if own[name].ndim != 1:
            raise LeRobotFormatError(
                f"{source}: {key}.{name} must be one vector, got shape {list(own[name].shape)}"
            )
    kept = {s: own[s] for s in needed}
    widths = {v.size for v in kept.values()}
    if len(widths) != 1 or (dim is not None and widths != {dim}):
        raise LeRobotFormatError(
            f"{source}: {key} statistics have widths {sorted(widths)} but the feature has {dim}"
        )
    if mode == MEAN_STD:
        if (kept["std"] < 0).any():
            raise LeRobotFormatError(f"{source}: {key}.std is negative")
    else:  # a range: its low end may not lie above its high end
        low, high = needed
        above = np.flatnonzero(kept[low] > kept[high]).tolist()
        if above:
            raise LeRobotFormatError(
                f"{source}: {key}.{low} lies above {key}.{high} at dims {above}"
            )
    return FeatureNorm(key, mode, eps, kept, widths.pop())


def relative_action_mask(
    action_dim: int, names: Sequence[str] | None, exclude: Sequence[str] | None
) -> tuple[bool, ...]:
    """Which action dims LeRobot's relative-actions step makes relative to the state
    (RelativeActionsProcessorStep._build_mask): a dim whose name equals or contains one of
    ``exclude`` (case-insensitive) stays absolute; without names every dim is relative."""
    tokens = [t.lower() for t in exclude or [] if t]
    mask = [True] * action_dim
    if tokens and names:
        for i, name in enumerate(names[:action_dim]):
            lowered = name.lower()
            mask[i] = not any(t == lowered or t in lowered for t in tokens)
    return tuple(mask)


def _relative_mask(
    step: Mapping[str, Any] | None,
    config: Mapping[str, Any],
    action_dim: int,
    config_path: Path,
    pre_path: Path,
) -> tuple[tuple[bool, ...], str]:
    """LeRobot main's relative actions: which action dims get the raw state added back."""
    if step is not None:
        cfg = step.get("config") or {}
        source = f"{PREPROCESSOR_FILENAME} {RELATIVE_STEP}"
        where = f"{pre_path} {RELATIVE_STEP} config"
        enabled = _flag(cfg, "enabled", False, where)
        exclude, names = _names(cfg, "exclude_joints", where), _names(cfg, "action_names", where)
    else:
        source = CONFIG_FILENAME
        enabled = _flag(config, "use_relative_actions", False, config_path)
        exclude = _names(config, "relative_exclude_joints", config_path)
        names = _names(config, "action_feature_names", config_path)
    if not enabled:
        return (), f"absolute actions ({source})"
    mask = relative_action_mask(action_dim, names, exclude)
    absolute = [i for i, m in enumerate(mask) if not m]
    return tuple(mask), (
        f"relative actions ({source}): the raw state is added back on dims "
        f"{[i for i, m in enumerate(mask) if m]}"
        + (f", absolute dims {absolute}" if absolute else "")
    )


def read_lerobot(ckpt_dir: Path, version: str = "auto") -> LeRobotSpec:
    """Everything a LeRobot pi05 folder says about inputs, outputs and sampling.

    ``version``: "auto" (from the files, see `conventions.lerobot_conventions`), "0.4" or "main".
    Every field read is checked here, before any weight is: its type, its range, widths against
    ``max_state_dim`` / ``max_action_dim`` and the statistics, and every file a step names.

    Raises:
        LeRobotFormatError: unreadable files, a missing statistics file, a field of the wrong type
            or out of range (the message names the file and the field), features or statistics
            that do not fit, or a variant this package does not run (MEM, other time periods,
            normalised images).
    """
    ckpt_dir = Path(ckpt_dir)
    config_path = ckpt_dir / CONFIG_FILENAME
    pre_path, post_path = ckpt_dir / PREPROCESSOR_FILENAME, ckpt_dir / POSTPROCESSOR_FILENAME
    config = read_json(config_path)
    if not isinstance(config, dict):
        raise LeRobotFormatError(f"{config_path} must hold a JSON object")
    for flag in ("use_proprioceptive_memory", "use_visual_memory"):
        if _flag(config, flag, False, config_path):
            raise LeRobotFormatError(
                f"{config_path}: {flag} is true (LeRobot's MEM variant), which pi0.5 here does "
                "not run"
            )
    periods = tuple(
        _number(config, name, default, config_path, positive=True)
        for name, default in zip(("min_period", "max_period"), DEFAULT_TIME_PERIODS, strict=True)
    )
    if periods != DEFAULT_TIME_PERIODS:
        raise LeRobotFormatError(
            f"{config_path}: min_period/max_period {periods} differ from pi0.5's "
            f"{DEFAULT_TIME_PERIODS}, which this model's time embedding uses"
        )
    inputs = _features(config, "input_features", config_path)
    outputs = _features(config, "output_features", config_path)
    empty = _integer(config, "empty_cameras", 0, config_path, minimum=0)
    cameras = [k for k, v in inputs.items() if v["type"] == VISUAL]
    cameras += [
        key
        for key in (f"{IMAGE_PREFIX}empty_camera_{i}" for i in range(empty))
        if key not in cameras
    ]
    if not cameras:
        raise LeRobotFormatError(f"{config_path}: input_features name no VISUAL (camera) feature")
    max_state_dim = _integer(config, "max_state_dim", DEFAULT_MAX_DIM, config_path)
    max_action_dim = _integer(config, "max_action_dim", DEFAULT_MAX_DIM, config_path)
    action_dim = _width(outputs.get(ACTION_KEY))
    if action_dim is None:
        action_dim = max_action_dim  # LeRobot's validate_features default
    if action_dim > max_action_dim:
        raise LeRobotFormatError(
            f"{config_path}: output_features['{ACTION_KEY}'] has {action_dim} dims, more than "
            f"max_action_dim {max_action_dim} (actions are zero-padded to max_action_dim)"
        )
    state_dim = _width(inputs.get(STATE_KEY))
    chunk = _integer(config, "chunk_size", 50, config_path)
    n_action_steps = _integer(config, "n_action_steps", chunk, config_path)
    if n_action_steps > chunk:
        raise LeRobotFormatError(
            f"{config_path}: n_action_steps {n_action_steps} exceeds chunk_size {chunk}"
        )
    num_inference_steps = _integer(config, "num_inference_steps", 10, config_path)
    resolution = _shape(
        config.get("image_resolution", [224, 224]), "image_resolution", config_path, 2
    )
    max_length = _integer(config, "tokenizer_max_length", 200, config_path)
    fallback_map = {
        **DEFAULT_NORMALIZATION,
        **_norm_map(config, "normalization_mapping", config_path),
    }

    files = [CONFIG_FILENAME]
    notes = [
        f"config.json: cameras {cameras} (input_features VISUAL order"
        + (f" + {empty} empty_cameras" if empty else "")
        + f"), state {state_dim} dims, action {action_dim} dims (output_features), chunk_size "
        f"{chunk}, n_action_steps {n_action_steps}"
    ]
    pre_steps, post_steps = (
        _steps(ckpt_dir, PREPROCESSOR_FILENAME),
        _steps(ckpt_dir, POSTPROCESSOR_FILENAME),
    )
    pre_source = f"{pre_path} {NORMALIZER_STEP}"
    post_source = f"{post_path} {UNNORMALIZER_STEP}"
    normalizer = _step(pre_steps, NORMALIZER_STEP, pre_path)
    unnormalizer = _step(post_steps, UNNORMALIZER_STEP, post_path)
    tokenizer = _step(pre_steps, TOKENIZER_STEP, pre_path)
    if tokenizer is not None:  # the processor's max_length is the one LeRobot tokenizes with
        where = f"{pre_path} {TOKENIZER_STEP} config"
        max_length = _integer(tokenizer.get("config") or {}, "max_length", max_length, where)
    relative_step = _step(pre_steps, RELATIVE_STEP, pre_path)
    relative, relative_note = _relative_mask(
        relative_step, config, action_dim, config_path, pre_path
    )
    pre_stats = _read_stats(ckpt_dir, normalizer, pre_source) if normalizer else {}
    post_stats = _read_stats(ckpt_dir, unnormalizer, post_source) if unnormalizer else {}
    for step in (normalizer, unnormalizer):
        if step and step.get("state_file"):
            files.append(step["state_file"])
    files += [
        f for f in (PREPROCESSOR_FILENAME, POSTPROCESSOR_FILENAME) if (ckpt_dir / f).is_file()
    ]
    # Images enter the model as [0, 1] -> [-1, 1]; LeRobot's statistics on them are not applied.
    for camera in cameras:
        mode = _norm_mode(camera, VISUAL, normalizer, fallback_map, pre_source)
        if mode != IDENTITY and pre_stats.get(camera):
            raise LeRobotFormatError(
                f"{pre_source}: {camera} is normalised with {mode} (norm_map VISUAL); pi0.5 here "
                "takes images as they are (IDENTITY)"
            )
    state_norm = _feature_norm(
        STATE_KEY, STATE, normalizer, pre_stats, fallback_map, state_dim, pre_source
    )
    # Actions are unnormalised by the postprocessor; without one, the preprocessor's copy.
    action_step, action_stats, action_source = (
        (unnormalizer, post_stats, post_source)
        if unnormalizer is not None
        else (normalizer, pre_stats, pre_source)
    )
    action_norm = _feature_norm(
        ACTION_KEY, ACTION, action_step, action_stats, fallback_map, action_dim, action_source
    )
    # The state is zero-padded to max_state_dim (LeRobot 0.4's prompt): it may not be wider.
    state_width = state_dim if state_dim is not None else state_norm.dim
    if state_width is not None and state_width > max_state_dim:
        found = "input_features['observation.state']" if state_dim is not None else pre_source
        raise LeRobotFormatError(
            f"{config_path}: max_state_dim {max_state_dim} is below the state's {state_width} dims "
            f"({found}); the state is zero-padded to max_state_dim"
        )
    if not normalizer and not unnormalizer:
        notes.append("no processor statistics: state and actions pass through unnormalised")
    notes += [f"state {state_norm.describe()}", f"actions {action_norm.describe()}"]
    notes.append(relative_note)
    told_main = [
        why
        for why, told in (
            (f"{CONFIG_FILENAME} has use_relative_actions", "use_relative_actions" in config),
            (f"{PREPROCESSOR_FILENAME} has a {RELATIVE_STEP} step", relative_step is not None),
        )
        if told
    ]
    conventions = lerobot_conventions(version, told_main, max_state_dim)
    notes.append(conventions.reason)
    return LeRobotSpec(
        cameras=tuple(cameras),
        empty_cameras=empty,
        state_dim=state_dim,
        action_dim=action_dim,
        chunk_size=chunk,
        n_action_steps=n_action_steps,
        num_inference_steps=num_inference_steps,
        max_state_dim=max_state_dim,
        max_action_dim=max_action_dim,
        tokenizer_max_length=max_length,
        image_resolution=(resolution[0], resolution[1]),
        state_norm=state_norm,
        action_norm=action_norm,
        relative_actions=relative,
        conventions=conventions,
        files=tuple(files),
        notes=tuple(notes),
    )


# -- loading --------------------------------------------------------------------------------------


def lerobot_model_config(
    mapped: Mapping[str, tuple[str, tuple[int, ...]]], spec: LeRobotSpec
) -> Pi05Config:
    """The model of a LeRobot folder: the preset whose tensors match (with the file's
    ``max_action_dim``), denoising ``chunk_size`` tokens, ``tokenizer_max_length`` prompt tokens
    and one image slot per camera.

    Raises:
        LeRobotFormatError: no action projection, a max_action_dim that config.json contradicts,
            tensors that match no preset, or an image_resolution the model does not have.
    """
    shape = mapped.get("action_in_proj.weight", ("", ()))[1]
    if len(shape) != 2:
        raise LeRobotFormatError(
            "model.safetensors has no action_in_proj.weight [width, max_action_dim]"
        )
    max_action_dim = int(shape[1])
    if max_action_dim != spec.max_action_dim:
        raise LeRobotFormatError(
            f"config.json max_action_dim {spec.max_action_dim} but the tensors have "
            f"{max_action_dim} (action_in_proj.weight {list(shape)})"
        )
    candidates = [dataclasses.replace(p, action_dim=max_action_dim) for p in PRESETS.values()]
    try:
        preset = infer_config(mapped, candidates)
    except CheckpointError as exc:
        raise LeRobotFormatError(f"LeRobot tensors (openpi names) fit no model: {exc}") from exc
    size = preset.vision.image_size
    if spec.image_resolution != (size, size):
        raise LeRobotFormatError(
            f"config.json image_resolution {list(spec.image_resolution)} but the vision tower "
            f"takes {size}x{size}"
        )
    return dataclasses.replace(
        preset,
        action_horizon=spec.chunk_size,
        max_token_len=spec.tokenizer_max_length,
        num_image_slots=len(spec.cameras),
    )


def load_lerobot_checkpoint(
    ckpt_dir: Path,
    reason: str,
    config: Pi05Config | None = None,
    device: str | torch.device = "cpu",
    dtype: DTypeLike = torch.float32,
    version: str = "auto",
) -> LoadedCheckpoint:
    """Load a LeRobot pi05 folder as it is (see `loader.load_checkpoint`, its one entry).

    Raises:
        CheckpointError (LeRobotFormatError): what `read_lerobot`, `weight_plan` and
            `lerobot_model_config` refuse, or tensors that do not fit (all listed at once).
    """
    dtype = as_dtype(dtype)
    weights = ckpt_dir / MODEL_FILENAME
    spec = read_lerobot(ckpt_dir, version)  # every config and processor field, before the weights
    header = read_safetensors_header(weights)
    plan, mapped = weight_plan(header)
    source = "given explicitly"
    if config is None:
        config = lerobot_model_config(mapped, spec)
        source = (
            f"LeRobot config.json: the tensors match preset {config.name!r} with max_action_dim "
            f"{config.action_dim}; chunk_size {config.action_horizon}, tokenizer_max_length "
            f"{config.max_token_len}, {config.num_image_slots} cameras"
        )
    with torch.device("meta"):
        probe = Pi05Model(config)
    problems = find_tensor_problems(mapped, expected_file_tensors(probe))
    if problems:
        raise LeRobotFormatError(
            f"{weights} (LeRobot names mapped onto openpi's) does not fit the {config.name!r} "
            "model:\n" + "\n".join(problems)
        )
    model = build_model(config, device, dtype, spec.conventions.keep_float32)
    stream_weights(weights, model, plan)
    model.eval().requires_grad_(False)
    for note in spec.notes:
        logger.info("%s: %s", ckpt_dir, note)
    return LoadedCheckpoint(
        model,
        config,
        {"state": spec.state_norm, "actions": spec.action_norm},
        "",
        ckpt_dir,
        source,
        format="lerobot",
        format_reason=reason,
        conventions=spec.conventions,
        lerobot=spec,
    )
