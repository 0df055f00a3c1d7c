"""Model sizes of a preset, and checks of a checkpoint directory (``oxygen-model-info``).

``--preset NAME`` prints parameter counts and KV-cache sizes; the model is built on PyTorch's meta
device, so even the full pi05 preset costs no memory.

``--checkpoint DIR`` checks a checkpoint directory the way the node would load it, without reading a
single weight: which format it is in (openpi's layout or a LeRobot pi05 folder, and the files that
say so), the safetensors header (tensor names and shapes) against the presets, the config it
resolves to, the norm stats and their dimensions, and the tokenizer and its vocabulary. Every check
prints OK or FAIL with the reason; the exit code is 1 when any check fails.

Example::

    oxygen-model-info --preset pi05
    oxygen-model-info --preset tiny --json
    oxygen-model-info --checkpoint /models/pi05_droid_pytorch \\
        --tokenizer /models/paligemma_tokenizer.model
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from oxygen_ros.checkpoints.conventions import LEROBOT_VERSIONS
from oxygen_ros.checkpoints.core import (
    CONFIG_FILENAME,
    MODEL_FILENAME,
    TOKENIZER_FILENAME,
    CheckpointError,
    expected_file_tensors,
    find_tensor_problems,
    read_config,
    read_safetensors_header,
)
from oxygen_ros.checkpoints.lerobot import lerobot_model_config, read_lerobot, weight_plan
from oxygen_ros.checkpoints.loader import detect_format
from oxygen_ros.checkpoints.norm_stats import NormStatsError, load_norm_stats
from oxygen_ros.checkpoints.openpi import (
    ASSETS_DIRNAME,
    load_checkpoint_norm_stats,
    resolve_asset_id,
    resolve_config,
)
from oxygen_ros.model.config import PRESETS, Pi05Config, get_preset
from oxygen_ros.model.pi05 import Pi05Model
from oxygen_ros.policy_io.prompts import DEFAULT_FORMAT, PromptFormat, preset
from oxygen_ros.policy_io.prompts import PRESETS as PROMPT_PRESETS
from oxygen_ros.policy_io.tokenizer import Pi05Tokenizer, TokenizerError

_PG = "paligemma_with_expert.paligemma.model."
# (label, parameter-name prefixes), in the order printed; every parameter falls in exactly one.
COMPONENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("vision_tower", (_PG + "vision_tower.",)),
    ("projector", (_PG + "multi_modal_projector.",)),
    ("backbone_embeddings", (_PG + "language_model.embed_tokens.",)),
    ("backbone_layers", (_PG + "language_model.layers.", _PG + "language_model.norm.")),
    ("expert_layers", ("paligemma_with_expert.gemma_expert.model.",)),
    (
        "action_time_projections",
        ("action_in_proj.", "action_out_proj.", "time_mlp_in.", "time_mlp_out."),
    ),
)


def parameter_counts(config: Pi05Config) -> dict[str, int]:
    """Parameters per component (see `COMPONENTS`), plus ``other`` if any, and ``total``."""
    with torch.device("meta"):
        model = Pi05Model(config)
    counts = {label: 0 for label, _ in COMPONENTS}
    other = 0
    for name, param in model.named_parameters():
        label = next((lbl for lbl, prefixes in COMPONENTS if name.startswith(prefixes)), None)
        if label is None:
            other += param.numel()
        else:
            counts[label] += param.numel()
    if other:
        counts["other"] = other
    counts["total"] = sum(counts.values())
    return counts


def prompt_format_info(fmt: PromptFormat) -> dict[str, Any]:
    """What a prompt format feeds the model: its pieces, which are shared / causal, its kinds."""
    return {
        "name": fmt.name,
        "source": fmt.source,
        "action": list(fmt.action),
        "action_no_state": list(fmt.action_no_state) if fmt.action_no_state else None,
        "subtask_action": list(fmt.subtask_action) if fmt.subtask_action else None,
        "shared_pieces": fmt.causal_from,
        "causal_prompt": fmt.causal_prompt,
        "same_frame_exact": fmt.same_frame_exact,
        "kinds": {
            kind: {
                "text": list(spec.text),
                "reads": spec.reads,
                "max_tokens": spec.max_tokens,
                "suppress": [list(r) for r in spec.suppress],
                "ours": spec.ours,
            }
            for kind, spec in fmt.kinds.items()
        },
    }


def model_info(
    config: Pi05Config, cameras: Sequence[int] = (1, 2, 3), prompt_format: str = DEFAULT_FORMAT
) -> dict[str, Any]:
    """Everything the CLI prints, as a JSON-ready dict."""
    counts = parameter_counts(config)
    prefix_lengths = {n: n * config.image_tokens + config.max_token_len for n in cameras}
    kv = {"bfloat16": config.kv_bytes_per_token(2), "float32": config.kv_bytes_per_token(4)}
    return {
        "preset": config.name,
        "parameters": counts,
        # openpi's file also stores the action expert's unused LM head (vocab x expert width).
        "openpi_file_parameters": counts["total"] + config.vocab_size * config.expert.width,
        "kv_bytes_per_token": kv,
        "prefix_tokens": {str(n): length for n, length in prefix_lengths.items()},
        "prefix_kv_bytes_bfloat16": {
            str(n): length * kv["bfloat16"] for n, length in prefix_lengths.items()
        },
        "note": "prefix = cameras x image tokens + max_token_len prompt tokens "
        "(an upper bound: padding is dropped)",
        "prompt_format": prompt_format_info(preset(prompt_format)),
    }


def format_info(info: dict[str, Any]) -> str:
    """Human-readable table of `model_info`."""
    lines: list[str] = [f"preset {info['preset']}", "parameters:"]
    for label, count in info["parameters"].items():
        lines.append(f"  {label:<25} {count:>15,}  ({count / 1e6:,.2f} M)")
    lines.append(
        f"  {'openpi_file_total':<25} {info['openpi_file_parameters']:>15,}"
        "  (+ the unused expert lm_head)"
    )
    kv = info["kv_bytes_per_token"]
    lines.append(f"KV cache per prefix token: {kv['bfloat16']:,} B bf16, {kv['float32']:,} B fp32")
    for cams, length in info["prefix_tokens"].items():
        size = info["prefix_kv_bytes_bfloat16"][cams]
        lines.append(f"  {cams} camera(s): prefix {length} tokens, KV {size / 2**20:,.2f} MiB bf16")
    fmt = info["prompt_format"]
    lines.append(f"prompt format {fmt['name']} ({fmt['source']})")
    lines.append(f"  action prompt: {fmt['action']!r}")
    if fmt["subtask_action"]:
        exact = "exact" if fmt["same_frame_exact"] else "re-prefill only"
        lines.append(
            f"  subtask-conditioned: {fmt['subtask_action']!r}, shared pieces "
            f"{fmt['shared_pieces']} (same_frame {exact})"
        )
    for kind, spec in fmt["kinds"].items():
        ours = ", ours (no public checkpoint trained on it)" if spec["ours"] else ""
        lines.append(f"  {kind}: {spec['text']!r} reads {spec['reads']}{ours}")
    return "\n".join(lines)


# -- checking a checkpoint directory -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Check:
    """One check of a checkpoint directory: what was checked, whether it passed, and why."""

    name: str
    ok: bool
    detail: str


def _check_weights(ckpt_dir: Path) -> tuple[Check, dict[str, tuple[str, tuple[int, ...]]] | None]:
    try:
        header = read_safetensors_header(ckpt_dir / MODEL_FILENAME)
    except CheckpointError as exc:
        return Check("weights", False, str(exc)), None
    dtypes = collections.Counter(dtype for dtype, _ in header.values())
    summary = ", ".join(f"{count} {dtype}" for dtype, count in sorted(dtypes.items()))
    return Check("weights", True, f"{MODEL_FILENAME}: {len(header)} tensors ({summary})"), header


def _describe(config: Pi05Config) -> str:
    preset = PRESETS.get(config.name)
    if preset == config:
        return f"preset {config.name!r}"
    horizon, tokens = config.action_horizon, config.max_token_len
    if (
        preset is not None
        and dataclasses.replace(preset, action_horizon=horizon, max_token_len=tokens) == config
    ):
        return f"preset {config.name!r} with action_horizon {horizon}, max_token_len {tokens}"
    return f"config {config.name!r} (not equal to any preset)"


def _check_config(
    ckpt_dir: Path, header: dict[str, Any] | None, preset: str | None
) -> tuple[Check, Pi05Config | None]:
    """The config the loader would use (`resolve_config`), or --preset."""
    stored_path = ckpt_dir / CONFIG_FILENAME
    try:
        stored = read_config(stored_path) if stored_path.is_file() else None
    except CheckpointError as exc:
        return Check("config", False, str(exc)), None
    if preset is not None:
        config = get_preset(preset)
        note = ""
        if stored is not None and stored != config:
            note = f"; {CONFIG_FILENAME} holds {_describe(stored)}, overridden"
        return Check("config", True, f"{_describe(config)} (given with --preset{note})"), config
    if header is None and stored is None:
        return Check(
            "config", False, f"no {CONFIG_FILENAME} and no readable weights to infer it from"
        ), None
    try:
        resolved = resolve_config(ckpt_dir, header or {})
    except CheckpointError as exc:
        return Check("config", False, str(exc)), None
    return Check(
        "config", True, f"{_describe(resolved.config)} ({resolved.source})"
    ), resolved.config


def _check_tensors(header: dict[str, Any] | None, config: Pi05Config | None) -> Check:
    if header is None or config is None:
        return Check("tensors", False, "not compared: needs readable weights and a config")
    with torch.device("meta"):
        expected = expected_file_tensors(Pi05Model(config))
    problems = find_tensor_problems(header, expected)
    if problems:
        return Check(
            "tensors", False, f"do not fit the {config.name!r} model:\n" + "\n".join(problems)
        )
    return Check(
        "tensors",
        True,
        f"all {len(expected)} tensors the {config.name!r} model needs, names and shapes match",
    )


def _check_norm_stats(ckpt_dir: Path, config: Pi05Config | None, asset_id: str | None) -> Check:
    try:
        asset_id = resolve_asset_id(ckpt_dir, asset_id)
    except (CheckpointError, ValueError) as exc:
        return Check("norm stats", False, str(exc))
    path = ckpt_dir / ASSETS_DIRNAME / asset_id / "norm_stats.json"
    try:
        if config is not None:
            stats = load_checkpoint_norm_stats(ckpt_dir, asset_id, config)
        else:
            stats = load_norm_stats(path)
    except (CheckpointError, NormStatsError, FileNotFoundError) as exc:
        return Check("norm stats", False, str(exc))
    dims = f"state {stats['state'].dim} dims, actions {stats['actions'].dim} dims"
    if config is None:
        return Check(
            "norm stats", True, f"{ASSETS_DIRNAME}/{asset_id}: {dims} (model unknown: not compared)"
        )
    return Check(
        "norm stats",
        True,
        f"{ASSETS_DIRNAME}/{asset_id}: {dims} (model action_dim {config.action_dim})",
    )


def _check_tokenizer(ckpt_dir: Path, config: Pi05Config | None, tokenizer: Path | None) -> Check:
    path = tokenizer if tokenizer is not None else ckpt_dir / TOKENIZER_FILENAME
    if tokenizer is None and not path.is_file():
        return Check(
            "tokenizer",
            False,
            f"no {TOKENIZER_FILENAME} in {ckpt_dir}; pass --tokenizer "
            "(PaliGemma's paligemma_tokenizer.model for openpi checkpoints)",
        )
    try:
        loaded = Pi05Tokenizer(path)
    except (FileNotFoundError, TokenizerError) as exc:
        return Check("tokenizer", False, str(exc))
    if config is None:
        return Check(
            "tokenizer", True, f"{path}: {loaded.vocab_size} pieces (model unknown: not compared)"
        )
    if loaded.vocab_size > config.vocab_size:
        return Check(
            "tokenizer",
            False,
            f"{path}: {loaded.vocab_size} pieces but the model's vocabulary has "
            f"{config.vocab_size} ids: the extra ids have no embedding",
        )
    relation = "=" if loaded.vocab_size == config.vocab_size else "<"
    return Check(
        "tokenizer",
        True,
        f"{path}: {loaded.vocab_size} pieces {relation} model vocabulary {config.vocab_size}",
    )


def _lerobot_checks(
    ckpt_dir: Path,
    header: dict[str, Any] | None,
    preset: str | None,
    tokenizer: Path | None,
    version: str,
) -> list[Check]:
    """config, tensors and statistics of a LeRobot pi05 folder (`checkpoints.lerobot`)."""
    try:
        spec = read_lerobot(ckpt_dir, version)
    except CheckpointError as exc:
        return [
            Check("config", False, str(exc)),
            _check_tensors(None, None),
            Check("norm stats", False, "not read: config.json or the processor files failed"),
            _check_tokenizer(ckpt_dir, None, tokenizer),
        ]
    config, mapped, config_check = None, None, None
    try:
        if header is not None:
            _, mapped = weight_plan(header)
        if preset is not None:
            config = get_preset(preset)
            config_check = Check("config", True, f"{_describe(config)} (given with --preset)")
        elif mapped is not None:
            config = lerobot_model_config(mapped, spec)
            config_check = Check(
                "config",
                True,
                f"{_describe(config)}: LeRobot config.json "
                + "; ".join(spec.notes[:1] + spec.notes[-1:]),
            )
    except CheckpointError as exc:
        config_check = Check("config", False, str(exc))
    if config_check is None:
        config_check = Check("config", False, "no readable weights to infer the model from")
    stats = Check("norm stats", True, "; ".join(spec.notes[1:-1]))
    return [
        config_check,
        _check_tensors(mapped, config),
        stats,
        _check_tokenizer(ckpt_dir, config, tokenizer),
    ]


def check_checkpoint(
    ckpt_dir: Path,
    preset: str | None = None,
    tokenizer: Path | None = None,
    asset_id: str | None = None,
    lerobot_version: str = "auto",
) -> list[Check]:
    """Every check of ``ckpt_dir`` (see the module docstring); reads headers only, never weights.

    The first check says which format the folder is in (openpi or LeRobot) and why. A check that
    needs an earlier one's result (the tensors need the config) fails with "not compared" when
    that one failed, so the list always has the same six entries.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return [Check("directory", False, f"checkpoint directory not found: {ckpt_dir}")]
    try:
        detected = detect_format(ckpt_dir)
    except CheckpointError as exc:
        return [Check("format", False, str(exc))]
    weights, header = _check_weights(ckpt_dir)
    found = Check("format", True, detected.reason)
    if detected.name == "lerobot":
        return [
            found,
            weights,
            *_lerobot_checks(ckpt_dir, header, preset, tokenizer, lerobot_version),
        ]
    config_check, config = _check_config(ckpt_dir, header, preset)
    return [
        found,
        weights,
        config_check,
        _check_tensors(header, config),
        _check_norm_stats(ckpt_dir, config, asset_id),
        _check_tokenizer(ckpt_dir, config, tokenizer),
    ]


def format_checks(ckpt_dir: Path, checks: Sequence[Check]) -> str:
    """One line per check (OK/FAIL, name, reason; multi-line reasons indented) and a summary."""
    lines = [f"checkpoint {ckpt_dir}"]
    for check in checks:
        first, *rest = check.detail.splitlines() or [""]
        lines.append(f"{'OK' if check.ok else 'FAIL':<5} {check.name}: {first}")
        lines.extend(f"        {line}" for line in rest)
    failed = [c.name for c in checks if not c.ok]
    lines.append(
        f"{len(checks) - len(failed)} of {len(checks)} checks passed"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oxygen-model-info", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="model size to describe; with --checkpoint: the config to check against",
    )
    parser.add_argument(
        "--checkpoint",
        type=Path,
        metavar="DIR",
        help="check a checkpoint directory without loading its weights",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        metavar="PATH",
        help=f"with --checkpoint: sentencepiece model (default DIR/{TOKENIZER_FILENAME})",
    )
    parser.add_argument(
        "--asset-id",
        metavar="ID",
        help=f"with --checkpoint: norm stats from DIR/{ASSETS_DIRNAME}/ID (default: the only one)",
    )
    parser.add_argument(
        "--prompt-format",
        default=DEFAULT_FORMAT,
        choices=list(PROMPT_PRESETS),
        help="with --preset: the prompt format to describe (default openpi)",
    )
    parser.add_argument(
        "--lerobot-version",
        choices=LEROBOT_VERSIONS,
        default="auto",
        help="with a LeRobot checkpoint: its version's input conventions (default: from the files)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    if args.checkpoint is None:
        if args.preset is None:
            parser.error("give --preset NAME or --checkpoint DIR")
        if args.tokenizer is not None or args.asset_id is not None:
            parser.error("--tokenizer and --asset-id need --checkpoint")
        info = model_info(get_preset(args.preset), prompt_format=args.prompt_format)
        print(json.dumps(info, indent=2) if args.json else format_info(info))
        return 0
    checks = check_checkpoint(
        args.checkpoint, args.preset, args.tokenizer, args.asset_id, args.lerobot_version
    )
    if args.json:
        print(json.dumps([dataclasses.asdict(c) for c in checks], indent=2))
    else:
        print(format_checks(args.checkpoint, checks))
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
