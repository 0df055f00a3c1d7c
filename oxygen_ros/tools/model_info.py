"""Parameter counts and KV-cache sizes of a model preset (``oxygen-model-info``).

The model is built on PyTorch's meta device, so even the full pi05 preset costs no memory.

Example::

    oxygen-model-info --preset pi05
    oxygen-model-info --preset tiny --json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from oxygen_ros.model.config import PRESETS, Pi05Config, get_preset
from oxygen_ros.model.pi05 import Pi05Model

_PG = "paligemma_with_expert.paligemma.model."
# (label, parameter-name prefixes), in the order printed; every parameter falls in exactly one.
COMPONENTS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
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


def parameter_counts(config: Pi05Config) -> Dict[str, int]:
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


def model_info(config: Pi05Config, cameras: Sequence[int] = (1, 2, 3)) -> Dict[str, Any]:
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
    }


def format_info(info: Dict[str, Any]) -> str:
    """Human-readable table of `model_info`."""
    lines: List[str] = [f"preset {info['preset']}", "parameters:"]
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
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="oxygen-model-info", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS), help="model size")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    info = model_info(get_preset(args.preset))
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
