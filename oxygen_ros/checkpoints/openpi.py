"""pi0.5 checkpoints in openpi's PyTorch layout: saved, resolved and loaded.

    ckpt_dir/
      model.safetensors                   weights, openpi's state-dict names
      assets/<asset_id>/norm_stats.json   quantile stats of state and actions
      oxygen_config.json                  optional: our Pi05Config (absent in openpi checkpoints)
      config.json                         optional: what openpi's converter writes (its
                                          action_horizon / max_token_len are read)
      tokenizer.model                     optional: sentencepiece model (written for tiny/small)

The model's config is resolved from the files (`resolve_config`), the norm stats from the asset
(`resolve_asset_id`); tensors are checked and streamed by the common core (`checkpoints.core`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..model.config import Pi05Config
from ..model.pi05 import Pi05Model
from .core import (
    CONFIG_FILENAME,
    MODEL_FILENAME,
    CheckpointError,
    DTypeLike,
    LoadedCheckpoint,
    PathLike,
    as_dtype,
    build_model,
    config_to_dict,
    expected_file_tensors,
    find_tensor_problems,
    infer_config,
    module_to_file_key,
    read_config,
    read_safetensors_header,
    stream_weights,
)
from .norm_stats import NormStats, NormStatsError, load_norm_stats, save_norm_stats

logger = logging.getLogger(__name__)

OPENPI_CONFIG_FILENAME = "config.json"  # by openpi's examples/convert_jax_model_to_pytorch.py
OPENPI_CONFIG_FIELDS = ("action_horizon", "max_token_len")  # what tensor shapes do not fix
ASSETS_DIRNAME = "assets"


# -- saving ----------------------------------------------------------------------------------------


def save_checkpoint(
    model: nn.Module,
    ckpt_dir: PathLike,
    norm_stats: Mapping[str, NormStats],
    asset_id: str = "robot",
    config: Pi05Config | None = None,
) -> Path:
    """Write ``model`` (and its config and norm stats) in openpi's PyTorch checkpoint layout.

    The config defaults to ``model.config``. Tensors are saved at their current dtypes.
    Returns ``ckpt_dir``.
    """
    ckpt_dir = Path(ckpt_dir)
    _check_asset_id(asset_id)
    config = config if config is not None else getattr(model, "config", None)
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        module_to_file_key(k): v.detach().to("cpu").contiguous()
        for k, v in model.state_dict().items()
    }
    tmp = ckpt_dir / (MODEL_FILENAME + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # safetensors creates files 0600; a checkpoint is meant to be shared
    os.replace(tmp, ckpt_dir / MODEL_FILENAME)
    if config is not None:
        (ckpt_dir / CONFIG_FILENAME).write_text(
            json.dumps(config_to_dict(config), indent=2) + "\n", encoding="utf-8"
        )
    save_norm_stats(ckpt_dir / ASSETS_DIRNAME / asset_id / "norm_stats.json", norm_stats)
    return ckpt_dir


def _check_asset_id(asset_id: str) -> None:
    """A relative path below ``assets/``: one or more plain names (openpi's LIBERO asset id is
    ``physical-intelligence/libero``)."""
    parts = asset_id.split("/") if asset_id else []
    if (
        not parts
        or "\\" in asset_id
        or asset_id.startswith("/")
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise ValueError(
            f"asset_id must be a relative path of plain directory names (e.g. droid or "
            f"physical-intelligence/libero), got {asset_id!r}"
        )


def openpi_markers(ckpt_dir: Path) -> list[str]:
    """The files that mark ``ckpt_dir`` as openpi's layout: ``oxygen_config.json`` and every
    ``assets/**/norm_stats.json`` (relative paths)."""
    found = []
    if (ckpt_dir / CONFIG_FILENAME).is_file():
        found.append(CONFIG_FILENAME)
    assets = ckpt_dir / ASSETS_DIRNAME
    if assets.is_dir():
        found += sorted(str(p.relative_to(ckpt_dir)) for p in assets.rglob("norm_stats.json"))
    return found


def load_openpi_checkpoint(
    ckpt_dir: Path,
    reason: str,
    config: Pi05Config | None = None,
    device: str | torch.device = "cpu",
    dtype: DTypeLike = torch.float32,
    asset_id: str | None = None,
    robot_horizon: int | None = None,
    preferred_asset_id: str | None = None,
) -> LoadedCheckpoint:
    """Load a checkpoint directory in openpi's PyTorch layout (see `loader.load_checkpoint`, its
    one entry; ``reason``: the files that decided the format).

    The config comes from `resolve_config` (``robot_horizon``: the horizon the robot's checkpoints
    were trained with, used when no config file says).

    ``asset_id`` selects ``assets/<asset_id>/norm_stats.json`` (nested ids such as
    ``physical-intelligence/libero`` too); if omitted, the single one present is used, or
    ``preferred_asset_id`` (the robot's openpi asset id) when there are several.

    ``dtype`` follows openpi: bfloat16 keeps the parameters listed in `KEEP_FLOAT32_SELECTORS` and
    the action/time projections in float32.

    Raises:
        CheckpointError: missing/corrupt files, any missing, unexpected, mis-shaped or non-float
            tensor (all listed at once), unusable norm stats or an undeterminable config.
    """
    dtype = as_dtype(dtype)
    weights = ckpt_dir / MODEL_FILENAME
    header = read_safetensors_header(weights)
    resolved = resolve_config(ckpt_dir, header, config, robot_horizon)
    config = resolved.config
    asset_id = resolve_asset_id(ckpt_dir, asset_id, preferred_asset_id)
    norm_stats = load_checkpoint_norm_stats(ckpt_dir, asset_id, config)

    with torch.device("meta"):
        probe = Pi05Model(config)
    problems = find_tensor_problems(header, expected_file_tensors(probe))
    if problems:
        raise CheckpointError(
            f"{weights} does not fit the {config.name!r} model:\n" + "\n".join(problems)
        )

    model = build_model(config, device, dtype)
    stream_weights(weights, model)
    model.eval().requires_grad_(False)
    return LoadedCheckpoint(
        model,
        config,
        norm_stats,
        asset_id,
        ckpt_dir,
        resolved.source,
        format_reason=reason,
    )


@dataclasses.dataclass(frozen=True)
class ResolvedConfig:
    config: Pi05Config
    source: str  # what decided it, in words (logged; shown by oxygen-model-info)


def read_openpi_config(ckpt_dir: Path) -> dict[str, int]:
    """``action_horizon`` / ``max_token_len`` from openpi's ``config.json``, those present; {}
    without the file.

    Raises:
        CheckpointError: an unreadable file, not a JSON object, or a value that is not a positive
            integer.
    """
    path = ckpt_dir / OPENPI_CONFIG_FILENAME
    if not path.is_file():
        return {}
    try:
        written = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(written, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(written).__name__}")
    fields = {}
    for name in OPENPI_CONFIG_FIELDS:
        value = written.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{path}: {name} must be a positive integer, got {value!r}")
        fields[name] = value
    return fields


def resolve_config(
    ckpt_dir: Path,
    header: Mapping[str, tuple[str, tuple[int, ...]]],
    config: Pi05Config | None = None,
    robot_horizon: int | None = None,
) -> ResolvedConfig:
    """The config a checkpoint loads with, and what decided it (logged).

    An explicit ``config`` wins (with a warning if oxygen_config.json disagrees); else
    oxygen_config.json; else the preset whose tensor names and shapes match the file exactly (an
    openpi pi0.5 checkpoint resolves to ``pi05``). Shapes fix neither ``action_horizon`` nor
    ``max_token_len`` (a fine-tune is trained with its own: pi05_droid 15, pi05_libero 10), so
    for a preset they come from openpi's config.json when it holds them, the horizon else from
    ``robot_horizon`` (the robot adapter's), else the preset's own.

    Raises:
        CheckpointError: an unreadable config file or no single matching preset.
    """
    config_path = ckpt_dir / CONFIG_FILENAME
    stored = read_config(config_path) if config_path.is_file() else None
    if config is not None:
        if stored is not None and stored != config:
            logger.warning(
                "using the given config %r; %s holds a different one (%r)",
                config.name,
                config_path,
                stored.name,
            )
        resolved = ResolvedConfig(config, "given explicitly")
    elif stored is not None:
        resolved = ResolvedConfig(stored, f"from {CONFIG_FILENAME}")
    else:
        resolved = _preset_with_openpi_fields(ckpt_dir, infer_config(header), robot_horizon)
    logger.info("%s: config %r, %s", ckpt_dir, resolved.config.name, resolved.source)
    horizon = resolved.config.action_horizon
    if robot_horizon is not None and horizon != robot_horizon:
        logger.warning(
            "%s: the model denoises %d action tokens, the robot's checkpoints were trained with %d",
            ckpt_dir,
            horizon,
            robot_horizon,
        )
    return resolved


def _preset_with_openpi_fields(
    ckpt_dir: Path, preset: Pi05Config, robot_horizon: int | None
) -> ResolvedConfig:
    fields = read_openpi_config(ckpt_dir)
    sources = [f"{k} {v} from openpi's {OPENPI_CONFIG_FILENAME}" for k, v in fields.items()]
    if "action_horizon" not in fields:
        if robot_horizon is not None:
            fields["action_horizon"] = robot_horizon
            sources.append(f"action_horizon {robot_horizon} from the robot adapter")
        else:
            sources.append(f"action_horizon {preset.action_horizon} from the preset")
    source = f"no {CONFIG_FILENAME}: the tensor shapes match it; " + ", ".join(sources)
    return ResolvedConfig(dataclasses.replace(preset, **fields), source)


def find_asset_ids(ckpt_dir: Path) -> list[str]:
    """Every ``<asset_id>`` with an ``assets/<asset_id>/norm_stats.json``, at any depth (openpi's
    LIBERO id is ``physical-intelligence/libero``), sorted."""
    assets = ckpt_dir / ASSETS_DIRNAME
    if not assets.is_dir():
        return []
    return sorted(
        p.parent.relative_to(assets).as_posix()
        for p in assets.rglob("norm_stats.json")
        if p.parent != assets
    )


def resolve_asset_id(ckpt_dir: Path, asset_id: str | None, preferred: str | None = None) -> str:
    """``asset_id`` checked; else the single asset with norm stats; else, among several,
    ``preferred`` (the robot's openpi asset id, e.g. ``droid``) when it is one of them.

    Raises:
        CheckpointError: no norm stats, or several assets and none chosen.
    """
    assets = ckpt_dir / ASSETS_DIRNAME
    if asset_id is not None:
        _check_asset_id(asset_id)
        return asset_id
    found = find_asset_ids(ckpt_dir)
    if len(found) == 1:
        return found[0]
    if not found:
        raise CheckpointError(
            f"no norm stats in {assets} (expected {ASSETS_DIRNAME}/<asset_id>/norm_stats.json)"
        )
    if preferred in found:
        logger.info("%s: several assets %s; using the robot's %r", assets, found, preferred)
        return preferred
    raise CheckpointError(f"several assets in {assets}: {found}; pass asset_id=")


def load_checkpoint_norm_stats(
    ckpt_dir: Path, asset_id: str, config: Pi05Config
) -> dict[str, NormStats]:
    """``assets/<asset_id>/norm_stats.json``, checked against the model's ``action_dim``.

    Raises:
        CheckpointError: a missing or unusable file, or stats wider than the model.
    """
    path = ckpt_dir / ASSETS_DIRNAME / asset_id / "norm_stats.json"
    try:
        stats = load_norm_stats(path)
    except (FileNotFoundError, NormStatsError) as exc:
        raise CheckpointError(str(exc)) from exc
    for key in ("state", "actions"):
        if stats[key].dim > config.action_dim:
            raise CheckpointError(
                f"{path}: {key} stats have {stats[key].dim} dims but the model's action_dim is "
                f"{config.action_dim}"
            )
    return stats
