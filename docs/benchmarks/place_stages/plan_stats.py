"""Sums up `plan_probe.py`: for the placed, the failed and all episodes, the held cube's offset from
the pad's centre now and at the end of the chunk's plan (1 s), the planned change of its distance
from the centre, the planned height and the share of plans that end outside the pad.

    python docs/benchmarks/place_stages/plan_stats.py NAME   (reads NAME.jsonl and NAME.json)
"""

import json
import math
import statistics
import sys

PAD_HALF = 0.035


def offset(point: list[float]) -> float:
    """How far a point lies from the pad's centre along the pad's edges (the larger of the two)."""
    return max(abs(point[0]), abs(point[1]))


def summary(rows: list[dict], label: str) -> str:
    now = [offset(r["now"]) for r in rows]
    planned = [offset(r["plan"]["10"]) for r in rows]
    radial = sorted(math.hypot(*r["plan"]["10"][:2]) - math.hypot(*r["now"][:2]) for r in rows)
    q = [radial[int(f * len(radial))] for f in (0.25, 0.5, 0.75)]
    return (
        f"{label}: {len(rows)} frames of {len({r['seed'] for r in rows})} episodes; offset now "
        f"{statistics.median(now):.3f} m -> planned at 1 s {statistics.median(planned):.3f} m; "
        f"planned change of the distance from the centre p25/p50/p75 {q[0]:+.3f}/{q[1]:+.3f}/"
        f"{q[2]:+.3f} m; planned height at 1 s "
        f"{statistics.median(r['plan']['10'][2] for r in rows):.3f} m; plans ending outside the "
        f"pad {sum(p > PAD_HALF for p in planned) / len(rows):.2f}"
    )


if __name__ == "__main__":
    name = sys.argv[1]
    with open(f"{name}.jsonl") as lines:
        rows = [json.loads(line) for line in lines]
    with open(f"{name}.json") as bench:
        status = {run["seed"]: run["status"] for run in json.load(bench)["runs"]}
    print(summary([r for r in rows if status[r["seed"]] == "success"], "placed"))
    print(summary([r for r in rows if status[r["seed"]] != "success"], "failed"))
    print(summary(rows, "all"))
