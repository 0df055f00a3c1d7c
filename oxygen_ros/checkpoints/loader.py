"""The one checkpoint loader: which format a folder holds (`detect_format`), then that format's
loader (`load_checkpoint`).

openpi's PyTorch layout is read by `checkpoints.openpi`, a LeRobot ``pi05`` folder by
`checkpoints.lerobot`; both return a `core.LoadedCheckpoint`, and the loader logs which it found.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

from ..model.config import Pi05Config
from .core import CheckpointError, DTypeLike, LoadedCheckpoint, PathLike, as_dtype
from .lerobot import (
    CONFIG_FILENAME,
    POLICY_TYPE,
    POSTPROCESSOR_FILENAME,
    PREPROCESSOR_FILENAME,
    LeRobotFormatError,
    load_lerobot_checkpoint,
    read_json,
)
from .openpi import load_openpi_checkpoint, openpi_markers

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DetectedFormat:
    """Which checkpoint layout a folder holds, and the files that said so."""

    name: str  # "openpi" | "lerobot"
    reason: str


def detect_format(ckpt_dir: Path) -> DetectedFormat:
    """The layout of ``ckpt_dir``, decided from its files alone.

    LeRobot: ``config.json`` with ``"type": "pi05"`` (processor files optional: Hub base models
    such as ``lerobot/pi05_base`` ship bare openpi tensor names and no statistics). openpi:
    anything else (``assets/<asset_id>/norm_stats.json``, optionally ``oxygen_config.json`` or
    openpi's converter ``config.json``, which has no ``"type"``).

    Raises:
        LeRobotFormatError: a config.json that is not a JSON object, another LeRobot policy type
            (pi0, smolvla, ...), LeRobot processor files without a LeRobot config, or a folder
            mixing both layouts; each names the files.
    """
    ckpt_dir = Path(ckpt_dir)
    config_path = ckpt_dir / CONFIG_FILENAME
    written = read_json(config_path) if config_path.is_file() else None
    if written is not None and not isinstance(written, dict):  # both layouts write an object
        raise LeRobotFormatError(
            f"{config_path} must hold a JSON object, got {type(written).__name__}"
        )
    policy_type = written.get("type") if written is not None else None
    processors = [
        name
        for name in (PREPROCESSOR_FILENAME, POSTPROCESSOR_FILENAME)
        if (ckpt_dir / name).is_file()
    ]
    openpi = openpi_markers(ckpt_dir)
    if policy_type is not None:
        if policy_type != POLICY_TYPE:
            raise LeRobotFormatError(
                f"{ckpt_dir}: {CONFIG_FILENAME} says LeRobot policy type {policy_type!r}; only "
                f"{POLICY_TYPE!r} (pi0.5) checkpoints can be loaded"
            )
        if openpi:
            raise LeRobotFormatError(
                f"{ckpt_dir} mixes checkpoint formats: LeRobot ({CONFIG_FILENAME} type "
                f"{POLICY_TYPE!r}{', ' + ', '.join(processors) if processors else ''}) and openpi "
                f"({', '.join(openpi)}); keep one layout per folder"
            )
        parts = [f'{CONFIG_FILENAME} "type": "{POLICY_TYPE}"'] + processors
        return DetectedFormat("lerobot", "LeRobot pi05 folder: " + ", ".join(parts))
    if processors:
        raise LeRobotFormatError(
            f"{ckpt_dir} has LeRobot processor files ({', '.join(processors)}) but no "
            f'{CONFIG_FILENAME} with a "type"; copy the whole pretrained_model/ folder'
        )
    why = ", ".join(openpi) if openpi else "no LeRobot config.json type"
    return DetectedFormat("openpi", f"openpi folder: {why}")


def load_checkpoint(
    ckpt_dir: PathLike,
    config: Pi05Config | None = None,
    device: str | torch.device = "cpu",
    dtype: DTypeLike = torch.float32,
    asset_id: str | None = None,
    robot_horizon: int | None = None,
    preferred_asset_id: str | None = None,
    lerobot_version: str = "auto",
) -> LoadedCheckpoint:
    """Load a checkpoint directory: openpi's PyTorch layout, or a LeRobot pi05 folder.

    The format is decided from the files (`detect_format`); a LeRobot folder is loaded by
    `lerobot.load_lerobot_checkpoint` (``lerobot_version``: "auto", "0.4" or "main", see
    `conventions`), an openpi one by `openpi.load_openpi_checkpoint` (``asset_id``,
    ``robot_horizon`` and ``preferred_asset_id`` apply to it; see there).

    Raises:
        CheckpointError: a missing directory, or what the format's loader refuses (missing/corrupt
            files, any missing, unexpected, mis-shaped or non-float tensor, all listed at once,
            unusable norm stats or an undeterminable config).
    """
    ckpt_dir = Path(ckpt_dir)
    dtype = as_dtype(dtype)
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {ckpt_dir}")
    detected = detect_format(ckpt_dir)
    logger.info("%s: %s", ckpt_dir, detected.reason)
    if detected.name == "lerobot":
        return load_lerobot_checkpoint(
            ckpt_dir, detected.reason, config, device, dtype, lerobot_version
        )
    return load_openpi_checkpoint(
        ckpt_dir,
        detected.reason,
        config,
        device,
        dtype,
        asset_id,
        robot_horizon,
        preferred_asset_id,
    )
