"""Write a random-weight pi0.5 checkpoint of any preset (``oxygen-make-checkpoint``).

The directory has openpi's PyTorch layout plus our self-description::

    DIR/model.safetensors  DIR/assets/<asset_id>/norm_stats.json  DIR/oxygen_config.json
    DIR/tokenizer.model    (tiny/small only: a trained sentencepiece model of the preset's vocab)

Weights come from `init_random_weights` (deterministic per seed); the norm stats are plausible
per-joint quantiles (q01 about -1.5, q99 about 1.5, different for every joint). The ``pi05`` preset
writes the full 3.3B-parameter model (~13 GB in float32) and therefore needs ``--force``.

Example::

    oxygen-make-checkpoint --preset tiny --out /tmp/tiny_ckpt --seed 0
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.checkpoints.core import (
    TOKENIZER_FILENAME,
    as_dtype,
    build_model,
    init_random_weights,
)
from oxygen_ros.checkpoints.lerobot_writer import lerobot_stats, write_lerobot_folder
from oxygen_ros.checkpoints.norm_stats import NormStats
from oxygen_ros.checkpoints.openpi import save_checkpoint
from oxygen_ros.model.config import PRESETS, Pi05Config, get_preset
from oxygen_ros.model.device import resolve_device
from oxygen_ros.policy_io.policy import Pi05Policy
from oxygen_ros.policy_io.robots import robot_adapter
from oxygen_ros.policy_io.tokenizer import Pi05Tokenizer
from oxygen_ros.tools.tiny_tokenizer import train_tiny_tokenizer

logger = logging.getLogger(__name__)

# Checkpoints larger than this need force=True / --force.
LARGE_CHECKPOINT_BYTES = 2 * 1024**3
# PaliGemma's vocabulary: such a model needs the real paligemma_tokenizer.model, not a tiny one.
PALIGEMMA_VOCAB_SIZE = 257_152


def synthetic_norm_stats(dim: int, seed: int) -> dict[str, NormStats]:
    """Plausible quantile stats for ``state`` and ``actions`` of a ``dim``-joint robot."""
    rng = np.random.default_rng(seed)
    stats = {}
    for key in ("state", "actions"):
        center = rng.uniform(-0.3, 0.3, dim)
        half_range = rng.uniform(1.0, 2.0, dim)
        q01, q99 = center - half_range, center + half_range
        mean = center + rng.uniform(-0.1, 0.1, dim)
        std = half_range / 2.33  # a normal's 1%/99% quantiles lie 2.33 std from its mean
        stats[key] = NormStats(mean=mean, std=std, q01=q01, q99=q99)
    return stats


# The LeRobot folder `--format lerobot` writes: names matching config/lerobot_pi05.yaml (an SO-101).
LEROBOT_CAMERAS = ("observation.images.front", "observation.images.wrist")
LEROBOT_STATE_DIM = 6


def make_lerobot_checkpoint(out_dir: Path, preset: str, seed: int = 0) -> Path:
    """A random-weight ``preset`` written as a LeRobot 0.4 pi05 folder (tiny/small only) with a
    tiny tokenizer: what ``config/lerobot_pi05.yaml`` expects (two cameras, a 6-dim state and
    action), for trying ``robot:=lerobot`` without a trained checkpoint."""
    if preset not in RANDOM_WEIGHT_PRESETS:
        raise ValueError(f"--format lerobot writes presets {RANDOM_WEIGHT_PRESETS}, not {preset!r}")
    # LeRobot's default tokenizer_max_length: its 0.4.x prompts carry 32 zero-padded state bins
    config = dataclasses.replace(get_preset(preset), max_token_len=200)
    model = build_model(config, "cpu", torch.float32)
    init_random_weights(model, seed)
    dim = min(LEROBOT_STATE_DIM, config.action_dim)
    stats = synthetic_norm_stats(dim, seed)
    write_lerobot_folder(
        out_dir,
        model,
        {
            "observation.state": lerobot_stats(stats["state"]),
            "action": lerobot_stats(stats["actions"]),
        },
        cameras=LEROBOT_CAMERAS,
        state_dim=dim,
        action_dim=dim,
    )
    train_tiny_tokenizer(Path(out_dir) / TOKENIZER_FILENAME, config.vocab_size)
    return Path(out_dir)


def checkpoint_bytes(config: Pi05Config, dtype: torch.dtype = torch.float32) -> int:
    """Size of the weights file for ``config`` at ``dtype`` (computed on the meta device)."""
    model = build_model(config, "meta", dtype)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def make_checkpoint(
    out_dir: Path,
    preset: str,
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    tokenizer_out: Path | None = None,
    asset_id: str = "robot",
    force: bool = False,
) -> Path:
    """Write a random-weight checkpoint of ``preset`` to ``out_dir``; return ``out_dir``.

    For presets with a small vocabulary a tokenizer is trained and written to ``tokenizer_out``
    (default ``out_dir/tokenizer.model``).

    Raises:
        ValueError: unknown preset, a checkpoint over 2 GiB without ``force``, or ``tokenizer_out``
            for a preset that needs PaliGemma's real tokenizer.
    """
    out_dir = Path(out_dir)
    config = get_preset(preset)
    dtype = as_dtype(dtype)
    size = checkpoint_bytes(config, dtype)
    if size > LARGE_CHECKPOINT_BYTES and not force:
        raise ValueError(
            f"preset {preset!r} writes {size / 1e9:.1f} GB of weights; "
            "pass force=True (--force) to do it anyway"
        )
    if size > LARGE_CHECKPOINT_BYTES:
        logger.warning("writing %.1f GB of random weights for preset %r", size / 1e9, preset)
    if config.vocab_size == PALIGEMMA_VOCAB_SIZE and tokenizer_out is not None:
        raise ValueError(
            f"preset {preset!r} uses PaliGemma's {PALIGEMMA_VOCAB_SIZE}-token vocabulary; "
            "no tiny tokenizer can stand in"
        )

    model = build_model(config, "cpu", dtype)
    init_random_weights(model, seed)
    save_checkpoint(
        model,
        out_dir,
        synthetic_norm_stats(config.action_dim, seed),
        asset_id=asset_id,
        config=config,
    )
    if config.vocab_size != PALIGEMMA_VOCAB_SIZE:
        train_tiny_tokenizer(tokenizer_out or out_dir / TOKENIZER_FILENAME, config.vocab_size)
    else:
        logger.info(
            "preset %r needs PaliGemma's real tokenizer (paligemma_tokenizer.model); none written",
            preset,
        )
    return out_dir


CACHE_ENV = "OXYGEN_ROS_CACHE"
RANDOM_WEIGHT_PRESETS = ("tiny", "small")
RANDOM_WEIGHTS_SEED = 0


def cache_dir() -> Path:
    """``$OXYGEN_ROS_CACHE``, else ``$XDG_CACHE_HOME/oxygen_ros``, else ``~/.cache/oxygen_ros``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "oxygen_ros"


def random_checkpoint(preset: str, root: Path | None = None) -> Path:
    """The cached random-weight checkpoint of ``preset`` under ``root`` (default :func:`cache_dir`),
    generated on first use.

    Generation writes into a temporary sibling directory and renames it into place, so concurrent
    users never see a half-written checkpoint.

    Raises:
        ValueError: ``preset`` is not one that is cached (tiny, small).
    """
    if preset not in RANDOM_WEIGHT_PRESETS:
        raise ValueError(
            f"random weights are cached only for presets {RANDOM_WEIGHT_PRESETS}, not {preset!r}"
        )
    parent = (root or cache_dir()) / "checkpoints"
    target = parent / f"random-{preset}-seed{RANDOM_WEIGHTS_SEED}"
    if (target / "model.safetensors").is_file():
        return target
    parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=parent))
    try:
        make_checkpoint(scratch / "ckpt", preset, RANDOM_WEIGHTS_SEED)
        try:
            os.rename(scratch / "ckpt", target)
        except OSError:
            # lost a race only if the winner finished
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="oxygen-make-checkpoint", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS), help="model size")
    parser.add_argument("--out", required=True, type=Path, help="checkpoint directory to write")
    parser.add_argument(
        "--seed", type=int, default=0, help="weight and norm-stats seed (default 0)"
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weights dtype; bfloat16 follows openpi (norms, embeddings, projections stay float32)",
    )
    parser.add_argument(
        "--tokenizer-out",
        type=Path,
        default=None,
        help="where to write the tokenizer (default DIR/tokenizer.model)",
    )
    parser.add_argument(
        "--asset-id",
        default="robot",
        help="norm stats go to DIR/assets/<asset-id>/ (default robot)",
    )
    parser.add_argument(
        "--force", action="store_true", help="allow checkpoints over 2 GiB (the pi05 preset)"
    )
    parser.add_argument(
        "--format",
        choices=("openpi", "lerobot"),
        default="openpi",
        help="openpi's layout (default) or a LeRobot pi05 folder (tiny/small; the names of "
        "config/lerobot_pi05.yaml)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:
        if args.format == "lerobot":
            out = make_lerobot_checkpoint(args.out, args.preset, args.seed)
        else:
            out = make_checkpoint(
                args.out,
                args.preset,
                args.seed,
                dtype=as_dtype(args.dtype),
                tokenizer_out=args.tokenizer_out,
                asset_id=args.asset_id,
                force=args.force,
            )
    except ValueError as exc:
        print(f"oxygen-make-checkpoint: error: {exc}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(
        f"wrote {args.preset} checkpoint (seed {args.seed}, {args.dtype}) to {out} "
        f"({size / 1e6:.1f} MB)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())


def random_policy(
    preset: str,
    device: str = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    action_dim: int | None = None,
    tokenizer_dir: Path | None = None,
    init: str = "cpu",
    robot: str = "generic",
):
    """A random-weight policy of any preset built in memory (benchmarks; nothing written but a
    tiny tokenizer, cached in ``tokenizer_dir``).

    Presets with PaliGemma's vocabulary get the 512-piece tiny tokenizer too: text then only uses
    its first 512 ids, which changes nothing about the cost of a decode step.

    init: "cpu" draws the weights on the CPU (identical on every device; minutes for ``pi05``);
    "device" draws them where the model lives (seconds on a GPU; other values than "cpu").
    robot: the robot adapter (`oxygen_ros.policy_io.robots`) whose transforms wrap the model, as
    `load_policy` does for a checkpoint: its trained horizon replaces the preset's (as for an
    openpi checkpoint without a config file), its action width is the policy's, and the synthetic
    norm stats cover its state and action widths.

    Raises:
        ValueError: an unknown preset, robot or init, or a robot the preset cannot serve (e.g.
            ALOHA's 14 action dims on the tiny preset's 8); DeviceUnavailable: ``device``.
    """
    if init not in ("cpu", "device"):
        raise ValueError(f"init must be 'cpu' or 'device', got {init!r}")
    resolve_device(device)
    adapter = robot_adapter(robot)
    config = get_preset(preset)
    if adapter.action_horizon is not None:
        config = dataclasses.replace(config, action_horizon=adapter.action_horizon)
    if adapter.action_dim is not None and adapter.action_dim > config.action_dim:
        raise ValueError(
            f"robot {adapter.name} has {adapter.action_dim} action dims but preset {preset!r} "
            f"only {config.action_dim}; use a larger preset (small, pi05)"
        )
    model = build_model(config, device, as_dtype(dtype))
    init_random_weights(model, seed, on_device=init == "device")
    vocab = min(config.vocab_size, 512)
    tokenizer_dir = Path(tokenizer_dir or Path.home() / ".cache" / "oxygen_ros")
    path = tokenizer_dir / f"tiny_tokenizer_{vocab}.model"
    if not path.is_file():
        tokenizer_dir.mkdir(parents=True, exist_ok=True)
        train_tiny_tokenizer(path, vocab)
    widths = (action_dim or adapter.action_dim or config.action_dim, adapter.state_dim or 0)
    stats = synthetic_norm_stats(max(widths), seed)
    return Pi05Policy(
        model.eval().requires_grad_(False), Pi05Tokenizer(path), stats, action_dim, adapter
    )
