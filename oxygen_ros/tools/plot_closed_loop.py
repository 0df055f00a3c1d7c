"""oxygen-plot-closed-loop: success, chunk-switch jump and jerk against inference delay, one line
per chunk continuity mode, from an ``oxygen-bench closed-loop --json`` or ``oxygen-bench
rtc-curve --json`` file (the RTC paper's figure).

    oxygen-plot-closed-loop BENCH.json --out success_vs_delay.png

Left: success rate with its Wilson 95 % interval as error bars (the expert and the random-weight
floor, when the bench ran them, as dashed lines). Middle: the commanded reference's jump at a
chunk switch. Right: RMS jerk of the executed arm trajectory. Delays are in controller steps
(action_dt).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

# the benches' continuity rows, in legend order (closed-loop's identity is rtc-curve's guided)
MODES = ("none", "identity", "guided", "trained")


def curves(rows: list[dict]) -> dict[str, list[dict]]:
    """The bench rows with a continuity mode and a delay, per mode, by delay."""
    by_mode: dict[str, list[dict]] = {}
    for row in rows:
        mode, delay = row.get("continuity"), row.get("delay_steps")
        if mode and delay is not None and math.isfinite(float(delay)):
            by_mode.setdefault(mode, []).append(row)
    ordered = sorted(by_mode, key=lambda m: MODES.index(m) if m in MODES else len(MODES))
    return {mode: sorted(by_mode[mode], key=lambda r: r["delay_steps"]) for mode in ordered}


def plot(data: dict, out: Path) -> Path:
    """Write the figure for bench JSON ``data`` to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data.get("rows", [])
    lines = curves(rows)
    if not lines:
        raise ValueError(
            "no continuity rows with a delay in the bench JSON (run none/identity/...)"
        )
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4))
    for index, (mode, points) in enumerate(lines.items()):
        dodge = 0.06 * (index - (len(lines) - 1) / 2)  # overlapping points stay visible
        delays = [p["delay_steps"] + dodge for p in points]
        success = [p["success"] for p in points]
        below = [p["success"] - p["ci_low"] for p in points]
        above = [p["ci_high"] - p["success"] for p in points]
        left.errorbar(delays, success, yerr=[below, above], marker="o", capsize=3, label=mode)
        middle.plot(delays, [p["switch_jump_rad"] for p in points], marker="o", label=mode)
        right.plot(delays, [p["jerk_rms"] for p in points], marker="o", label=mode)
    for row in rows:
        if row["setting"] in ("expert", "random"):
            left.axhline(row["success"], linestyle="--", linewidth=1, color="grey")
            left.annotate(row["setting"], (0, row["success"]), fontsize=8, color="grey")
    n = data.get("episodes_per_setting", "?")
    left.set(xlabel="inference delay (controller steps)", ylabel="success rate", ylim=(-0.05, 1.05))
    left.set_title(f"success vs delay (N = {n} per point, 95 % Wilson CI)")
    middle.set(xlabel="inference delay (controller steps)", ylabel="mean switch jump (rad)")
    middle.set_title("commanded jump at a chunk switch")
    right.set(xlabel="inference delay (controller steps)", ylabel="RMS jerk (rad/s³)")
    right.set_title("jerk of the executed trajectory")
    for ax in (left, middle, right):
        ax.grid(alpha=0.3)
        ax.legend(title="chunk continuity")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="oxygen-plot-closed-loop",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("bench_json", type=Path, help="an oxygen-bench closed-loop --json file")
    parser.add_argument("--out", type=Path, default=Path("success_vs_delay.png"))
    args = parser.parse_args(argv)
    try:
        written = plot(json.loads(args.bench_json.read_text()), args.out)
    except (OSError, ValueError) as exc:
        print(f"oxygen-plot-closed-loop: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
