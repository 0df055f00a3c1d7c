"""``oxygen-bench hierarchy``: pi0.5's subtask: none vs decoded per call (PR #942) vs in the
slack (same_frame), on the same frames."""

from __future__ import annotations

import argparse

import torch

from oxygen_ros.engine import EngineConfig
from oxygen_ros.tools.benches import common
from oxygen_ros.tools.benches.hierarchy_workload import run_hierarchy

HELP = "pi0.5's subtask: none vs decoded per call (PR #942) vs in the slack (same_frame)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``hierarchy`` subcommand's arguments."""
    common.common_args(parser, "tiny")
    parser.set_defaults(threads=1)  # as the node (torch_threads 1): steadier on a shared CPU
    parser.add_argument("--frames", type=int, default=60, help="measured frames per mode")
    parser.add_argument("--warmup", type=int, default=5, help="unmeasured frames per mode")
    parser.add_argument(
        "--prompt-format",
        default="openpi_subtask",
        choices=["openpi_subtask", "opentau", "brunofang"],
        help="a format where same_frame is exact",
    )
    parser.add_argument(
        "--subtask-period-s", type=float, default=0.5, help="oxygen: seconds between subtasks"
    )
    parser.add_argument(
        "--subtask-tokens", type=int, default=0, help="subtask token limit (0: the format's, 64)"
    )
    parser.add_argument(
        "--period-ms",
        type=float,
        default=0.0,
        help="oxygen: tick period (0: twice the none mode's median action path)",
    )


def run(args: argparse.Namespace) -> dict[str, object]:
    """The three modes of ``hierarchy_workload`` on the same frames, one run; the targets as
    ratios."""
    policy = common.make_policy(args)
    config = EngineConfig(
        num_steps=args.steps,
        seed=args.seed,
        prompt_format=args.prompt_format,
        subtask_conditioning="same_frame",
        subtask_period_s=args.subtask_period_s,
        subtask_max_tokens=args.subtask_tokens,
        **common.fast_path(args),
    )
    modes, period = run_hierarchy(
        policy,
        common.make_observations(args, policy),
        config,
        args.frames,
        args.warmup,
        args.period_ms * 1e-3 or None,
    )
    none, per_call, oxygen = modes["none"], modes["per_call"], modes["oxygen"]
    vs_none = oxygen["frames_per_s"] / none["frames_per_s"]
    vs_per_call = oxygen["frames_per_s"] / per_call["frames_per_s"]
    print(
        f"hierarchy: preset={args.preset} robot={args.robot} device={args.device} "
        f"format={args.prompt_format} "
        f"frames={args.frames} (interleaved frame by frame) threads={torch.get_num_threads()} "
        f"subtask_period={args.subtask_period_s:g} s oxygen tick period={period * 1e3:.1f} ms"
    )
    columns = [
        "frames_per_s",
        "p50_action_ms",
        "p99_action_ms",
        "wall_frames_per_s",
        "tokens_per_s",
        "staleness_p50_ms",
        "staleness_p99_ms",
        "subtasks",
        "conditioned_after_first",
        "mean_subtask_tokens",
        "static_fallbacks",
    ]
    common.print_table(
        [{"metric": c, **{name: modes[name][c] for name in modes}} for c in columns],
        ["metric", *modes],
    )
    print(
        f"oxygen / none action rate {vs_none:.2f}x (target >= 0.95); oxygen / per_call "
        f"{vs_per_call:.1f}x (target >= 5 on tiny); chunks after the first subtask conditioned: "
        f"{oxygen['conditioned_after_first']:.0%}"
    )
    out = {
        "preset": args.preset,
        "robot": args.robot,
        "device": args.device,
        "workload": vars(args) | {"json": str(args.json)},
        "oxygen_period_ms": period * 1e3,
        "modes": modes,
        "oxygen_vs_none": vs_none,
        "oxygen_vs_per_call": vs_per_call,
    }
    common.write_json(args.json, out)
    return out
