"""``oxygen-bench summary``: one table from the JSON of one scripts/gpu_bench.sh run, each figure
next to its target, and what is missing: a measurement whose step failed or ran past its limit
(the script's ``steps.tsv`` says how each step ended) and every target left without a figure."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from oxygen_ros.tools.benches import common

# Issue 6 targets on one H200 with the pi05 preset; issue 29's serving target (any preset).
TARGETS = {
    "action_2cam_p99_ms": 10.0,
    "oxygen_speedup_vs_isolated": 3.7,
    "realtime_frames_per_s": 60.0,
    "realtime_p99_frame_ms": 1000.0 / 60.0,
    "realtime_tokens_per_s": 1000.0,
    "realtime_mean_active_requests": 8.0,
    "serve_4clients_speedup_vs_separate": 1.5,
}
# the measurements of one run, in the script's order (each NAME.json, written by step NAME)
MEASUREMENTS = ("action", "engines", "realtime", "hierarchy", "serve")
STEPS_FILE = "steps.tsv"  # scripts/gpu_bench.sh: one "name<TAB>exit status<TAB>seconds" a step
TIMED_OUT = (124, 137)  # timeout(1)'s exit status, and SIGKILL's after its --kill-after


HELP = "combine the JSON of one gpu_bench.sh run, check targets, say what is missing"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``summary`` subcommand's arguments."""
    parser.add_argument(
        "--dir",
        type=Path,
        required=True,
        help=f"folder with {', '.join(f'{m}.json' for m in MEASUREMENTS)} (any may be missing)",
    )
    parser.add_argument(
        "--json", type=Path, help="write the summary here (default DIR/summary.json)"
    )


def run(args: argparse.Namespace) -> dict[str, object]:
    """One table from a run's measurements, each figure next to its target, then what is
    missing and why."""
    loaded = {name: load(args.dir, name) for name in MEASUREMENTS}
    figures: dict[str, object] = {}
    for name, collect in COLLECTORS.items():
        if loaded[name]:
            figures.update(collect(loaded[name]))
    checks = check_targets(figures)
    missing = missing_measurements(args.dir, loaded)
    print(f"summary of {args.dir} (targets: issue 6, pi05 on one H200; issue 29, serving)")
    if figures:
        common.print_table(
            [{"figure": k, "value": v} for k, v in figures.items()], ["figure", "value"]
        )
    else:
        print("  no figures: no measurement finished")
    for key, check in checks.items():
        sign = ">=" if not key.endswith("_ms") else "<="
        print(
            f"  {'MET ' if check['met'] else 'MISS'} {key} = {check['value']:.2f} (target {sign} "
            f"{check['target']:.1f})"
        )
    unmeasured = [key for key in TARGETS if key not in checks]
    for name, why in missing.items():
        print(f"  MISSING {name}: {why}")
    for key in unmeasured:
        print(f"  MISSING target {key}: no figure")
    out = {"figures": figures, "targets": checks, "missing": missing, "unmeasured": unmeasured}
    common.write_json(args.json or args.dir / "summary.json", out)
    return out


def load(folder: Path, name: str) -> dict[str, object] | None:
    """``folder/name.json``, or None when the step wrote none (or half of one)."""
    path = folder / f"{name}.json"
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def step_status(folder: Path) -> dict[str, tuple[int, int]]:
    """How each step of the run ended, from the script's steps file: name -> (exit, seconds)."""
    path = folder / STEPS_FILE
    if not path.is_file():
        return {}
    status = {}
    for line in path.read_text().splitlines():
        fields = line.split("\t")
        if len(fields) >= 3 and fields[1].isdigit() and fields[2].isdigit():
            status[fields[0]] = (int(fields[1]), int(fields[2]))
    return status


def missing_measurements(
    folder: Path, loaded: dict[str, dict[str, object] | None]
) -> dict[str, str]:
    """name -> why there is no figure of it: the step ran past its limit, failed, or did not run."""
    status = step_status(folder)
    missing = {}
    for name, data in loaded.items():
        if data:
            continue
        if name not in status:
            missing[name] = f"no {name}.json (the step did not run)"
            continue
        code, seconds = status[name]
        how = (
            f"ran past its time limit after {seconds} s"
            if code in TIMED_OUT
            else f"exit {code} after {seconds} s"
        )
        missing[name] = f"the step {how}; no {name}.json (see {name}.log)"
    return missing


def check_targets(figures: dict[str, object]) -> dict[str, dict[str, object]]:
    """Each target with a finite figure: its value, the target and whether it is met."""
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
    return checks


def action_figures(action: dict) -> dict[str, object]:
    figures: dict[str, object] = {}
    for row in action["rows"]:
        figures[f"action_{row['cameras']}cam_{row['path']}_p50_ms"] = row["p50_ms"]
        figures[f"action_{row['cameras']}cam_{row['path']}_p99_ms"] = row["p99_ms"]
    fast = [r for r in action["rows"] if r["cameras"] == 2 and r["path"] != "dynamic"] or [
        r for r in action["rows"] if r["cameras"] == 2
    ]
    if fast:
        figures["action_2cam_p99_ms"] = fast[-1]["p99_ms"]
    return figures


def engines_figures(engines: dict) -> dict[str, object]:
    figures: dict[str, object] = {}
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
    return figures


def realtime_figures(realtime: dict) -> dict[str, object]:
    keys = (
        "frames_per_s",
        "p99_frame_ms",
        "deadline_misses",
        "tokens_per_s",
        "mean_active_requests",
        "max_active_requests",
        "peak_gpu_memory_bytes",
    )
    return {f"realtime_{key}": realtime[key] for key in keys if key in realtime}


def hierarchy_figures(hierarchy: dict) -> dict[str, object]:
    return {
        f"hierarchy_{mode}_frames_per_s": row["frames_per_s"]
        for mode, row in hierarchy["modes"].items()
    }


def serve_figures(serve: dict) -> dict[str, object]:
    """Per client count: aggregate frames/s of one shared server and of as many separate ones,
    their ratio, the worst client p99 and the deadline misses."""
    figures: dict[str, object] = {}
    for row in serve["rows"]:
        n = row["clients"]
        figures[f"serve_{n}clients_shared_frames_per_s"] = row["shared"]["frames_per_s"]
        figures[f"serve_{n}clients_separate_frames_per_s"] = row["separate"]["frames_per_s"]
        figures[f"serve_{n}clients_speedup_vs_separate"] = row["speedup_vs_separate"]
        figures[f"serve_{n}clients_shared_worst_p99_ms"] = row["shared"]["worst_p99_ms"]
        figures[f"serve_{n}clients_shared_deadline_misses"] = row["shared"]["deadline_misses"]
    return figures


# measurement -> the figures it gives
COLLECTORS = {
    "action": action_figures,
    "engines": engines_figures,
    "realtime": realtime_figures,
    "hierarchy": hierarchy_figures,
    "serve": serve_figures,
}
