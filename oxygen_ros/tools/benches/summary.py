"""``oxygen-bench summary``: one table from the action / engines / realtime JSON of one run,
each figure next to its target."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from oxygen_ros.tools.benches import common

# Issue 6 targets on one H200 with the pi05 preset.
TARGETS = {
    "action_2cam_p99_ms": 10.0,
    "oxygen_speedup_vs_isolated": 3.7,
    "realtime_frames_per_s": 60.0,
    "realtime_p99_frame_ms": 1000.0 / 60.0,
    "realtime_tokens_per_s": 1000.0,
    "realtime_mean_active_requests": 8.0,
}


HELP = "combine action/engines/realtime JSON of one run, check targets"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``summary`` subcommand's arguments."""
    parser.add_argument(
        "--dir",
        type=Path,
        required=True,
        help="folder with action.json, engines.json, realtime.json",
    )
    parser.add_argument(
        "--json", type=Path, help="write the summary here (default DIR/summary.json)"
    )


def run(args: argparse.Namespace) -> dict[str, object]:
    """One table from the three GPU measurements, each figure next to its target."""

    def load(name: str) -> dict[str, object] | None:
        path = args.dir / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    action, engines, realtime = load("action"), load("engines"), load("realtime")
    figures: dict[str, object] = {}
    if action:
        for row in action["rows"]:
            figures[f"action_{row['cameras']}cam_{row['path']}_p50_ms"] = row["p50_ms"]
            figures[f"action_{row['cameras']}cam_{row['path']}_p99_ms"] = row["p99_ms"]
        fast = [r for r in action["rows"] if r["cameras"] == 2 and r["path"] != "dynamic"] or [
            r for r in action["rows"] if r["cameras"] == 2
        ]
        if fast:
            figures["action_2cam_p99_ms"] = fast[-1]["p99_ms"]
    if engines:
        for name, r in engines["engines"].items():
            figures[f"engines_{name}_frames_per_s"] = r["frames_per_s"]
            figures[f"engines_{name}_tokens_per_s"] = r["tokens_per_s"]
            figures[f"engines_{name}_speedup_vs_isolated"] = r.get("speedup_vs_isolated")
        if "oxygen" in engines["engines"]:
            figures["oxygen_speedup_vs_isolated"] = engines["engines"]["oxygen"].get(
                "speedup_vs_isolated"
            )
        for name, error in engines.get("errors", {}).items():
            figures[f"engines_{name}_error"] = error
    if realtime:
        for key in (
            "frames_per_s",
            "p99_frame_ms",
            "deadline_misses",
            "tokens_per_s",
            "mean_active_requests",
            "max_active_requests",
            "peak_gpu_memory_bytes",
        ):
            if key in realtime:
                figures[f"realtime_{key}"] = realtime[key]
    checks = {}
    for key, target in TARGETS.items():
        value = figures.get(key)
        if isinstance(value, (int, float)) and value == value:
            higher_is_better = not key.endswith("_ms")
            checks[key] = {
                "value": value,
                "target": target,
                "met": value >= target if higher_is_better else value <= target,
            }
    print(f"summary of {args.dir} (targets: issue 6, pi05 on one H200)")
    common.print_table([{"figure": k, "value": v} for k, v in figures.items()], ["figure", "value"])
    for key, check in checks.items():
        sign = ">=" if not key.endswith("_ms") else "<="
        print(
            f"  {'MET ' if check['met'] else 'MISS'} {key} = {check['value']:.2f} (target {sign} "
            f"{check['target']:.1f})"
        )
    out = {"figures": figures, "targets": checks}
    common.write_json(args.json or args.dir / "summary.json", out)
    return out
