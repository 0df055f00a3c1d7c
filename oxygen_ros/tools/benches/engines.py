"""``oxygen-bench engines``: every engine on the paper's workload, side by side, in interleaved
rounds; OxyGen's scheduling and language-KV overhead against its components timed alone."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from oxygen_ros.engine import ENGINES, EngineConfig, OxygenEngine, make_engine
from oxygen_ros.tools.benches import common
from oxygen_ros.tools.benches.workloads import (
    FrameSamples,
    Workload,
    compare_engines,
    component_times,
    run_frames,
    weight_bytes,
)
from oxygen_ros.tools.cli import positive_int

HELP = "all engines on the paper's workload"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``engines`` subcommand's arguments."""
    common.common_args(parser, "small")
    common.workload_args(parser, 50)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    # per round; OxyGen's batch is steady after 30 tokens / k=5 = 6 frames
    parser.set_defaults(warmup=6)
    parser.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="interleaved rounds: each engine runs frames/rounds frames (after its warm-up) per "
        "round, so drifting machine speed hits every engine alike (default 3)",
    )
    parser.add_argument("--plot", type=Path, help="write a PNG bar chart here")


def run(args: argparse.Namespace) -> dict[str, object]:
    policy = common.make_policy(args)
    observations = common.make_observations(args, policy)
    config = EngineConfig(
        num_steps=args.steps,
        decode_mode="fixed",
        decode_steps_per_frame=args.decode_steps,
        seed=args.seed,
        **common.fast_path(args),
    )
    workload = Workload(args.frames, args.warmup, args.requests_per_frame, args.tokens)
    print(
        f"workload: preset={args.preset} robot={args.robot} device={args.device} "
        f"dtype={args.dtype} cameras={args.cameras} steps={args.steps} "
        f"k={args.decode_steps} requests/frame={args.requests_per_frame} tokens={args.tokens} "
        f"frames={args.frames} "
        f"in {args.rounds} interleaved round(s), each after {args.warmup} warm-up frames; "
        f"path={common.path_name(config)}"
    )
    component_rounds: list[dict[str, float]] = []

    def time_components(name: str, part: FrameSamples) -> None:
        """After OxyGen's part of each round: its components, each alone, in the same time
        window."""
        if name == "oxygen":
            batch = max(1, round(sum(part.active) / len(part.active)))
            repeats = max(5, 20 // args.rounds)
            component_rounds.append(
                component_times(policy, config, observations[0], batch, repeats) | {"batch": batch}
            )

    results, errors = compare_engines(
        lambda name: make_engine(name, policy, config),
        args.engines,
        observations,
        workload,
        args.rounds,
        time_components,
    )
    for name, error in errors.items():
        print(f"{name}: FAILED {error}", file=sys.stderr)
    base = results.get("isolated-sequential", {}).get("frames_per_s")
    rows = []
    for name, r in results.items():
        r["speedup_vs_isolated"] = r["frames_per_s"] / base if base else float("nan")
        rows.append({"engine": name, **r})
    common.print_table(
        rows,
        [
            "engine",
            "frames_per_s",
            "speedup_vs_isolated",
            "paper_action_hz",
            "tokens_per_s",
            "p50_frame_ms",
            "p99_frame_ms",
            "peak_kv_bytes",
            "mean_active_requests",
        ],
    )
    checks = _oxygen_checks(args, policy, config, observations, results, component_rounds)
    for line in checks.pop("lines"):
        print(line)
    out = {
        "workload": vars(args) | {"json": str(args.json), "plot": str(args.plot)},
        "engines": results,
        "errors": errors,
        "checks": checks,
    }
    common.write_json(args.json, out)
    if args.plot and results:
        _plot(results, args.plot)
    return out


def _oxygen_checks(
    args, policy, config, observations, results, component_rounds
) -> dict[str, object]:
    """Scheduling overhead and language KV overhead of OxyGen, against components timed alone
    (``component_rounds``: one `component_times` per round, taken right after OxyGen's frames)."""
    checks: dict[str, object] = {"lines": []}
    ox = results.get("oxygen")
    if not ox:
        return checks
    parts = {
        key: float(np.median([c[key] for c in component_rounds])) for key in component_rounds[0]
    }
    batch = int(parts["batch"])
    admits = args.requests_per_frame  # new requests per frame, each prefilling its kind text
    alone = (
        parts["prefill_ms"]
        + parts["action_ms"]
        + admits * parts["admit_ms"]
        + args.decode_steps * parts["decode_step_ms"]
    )
    checks["components_ms"] = parts | {"batch": batch, "sum_ms": alone}
    # Medians on both sides: a frame is the sum of the same parts, and on a shared machine the mean
    # of either side is moved by a few outlier frames (GC, other processes).
    checks["frame_over_components"] = ox["p50_frame_ms"] / alone
    action_only = OxygenEngine(policy, config)
    quiet = run_frames(action_only, observations, Workload(10, 2, 0.0, args.tokens))
    action_only.close()
    weights = weight_bytes(policy)
    checks["action_only_peak_kv_bytes"] = quiet["peak_kv_bytes"]
    checks["language_kv_overhead"] = ox["peak_kv_bytes"] / quiet["peak_kv_bytes"] - 1
    checks["language_memory_overhead_incl_weights"] = (weights + ox["peak_kv_bytes"]) / (
        weights + quiet["peak_kv_bytes"]
    ) - 1
    checks["weight_bytes"] = weights
    lines = checks["lines"]
    lines.append(
        f"components alone: prefill {parts['prefill_ms']:.1f} ms + action {parts['action_ms']:.1f} "
        f"ms + {admits:g} x admit {parts['admit_ms']:.1f} ms + "
        f"{args.decode_steps} x decode@{batch} {parts['decode_step_ms']:.1f} ms = {alone:.1f} "
        f"ms (medians over {len(component_rounds)} rounds); "
        f"OxyGen p50 frame {ox['p50_frame_ms']:.1f} ms (mean {ox['mean_frame_ms']:.1f}) -> ratio "
        f"{checks['frame_over_components']:.2f} (target <= 1.10)"
    )
    lines.append(
        f"KV: action-only peak {quiet['peak_kv_bytes'] / 1e6:.2f} MB, with language "
        f"{ox['peak_kv_bytes'] / 1e6:.2f} MB (+{100 * checks['language_kv_overhead']:.0f}% of KV; "
        f"+{100 * checks['language_memory_overhead_incl_weights']:.1f}% "
        f"of weights+KV, weights {weights / 1e6:.0f} MB) at mean batch "
        f"{ox['mean_active_requests']:.1f}"
    )
    for name in ("oxygen", "shared-kv", "naive-parallel"):
        if name in results and "speedup_vs_isolated" in results[name]:
            lines.append(
                f"{name}: {results[name]['speedup_vs_isolated']:.2f}x isolated-sequential frames/s"
            )
    return checks


def _plot(results: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(
        axes,
        ["frames_per_s", "tokens_per_s", "p99_frame_ms"],
        ["frames / s", "tokens / s", "p99 frame ms"],
        strict=False,
    ):
        ax.bar(
            names,
            [results[n][key] for n in names],
            color=["#2a9d8f" if n == "oxygen" else "#8d99ae" for n in names],
        )
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
