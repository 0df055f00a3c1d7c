"""``oxygen-bench rtc-curve``: success against inference delay, one line per chunk continuity
mode, as the real-time chunking papers plot it, from ``sim-policy``'s episodes (no ROS).

Every point is ``sim-policy --continuity MODE --delay-steps D`` (the chunk reaches the arm ``D``
frames after its observation, the next observation is taken as it arrives) over the same
``--episodes`` layouts and noise of ``--seed``, the checkpoint loaded once. The JSON's ``rows``
are in ``closed-loop``'s row format (``continuity``, ``delay_steps``, ``success`` with its Wilson
interval, ``switch_jump_rad``, ``jerk_rms``), so ``oxygen-plot-closed-loop`` draws either
bench's; ``--plot`` draws it here. The JSON is rewritten after every point: a stopped run keeps
what it measured.

    oxygen-bench rtc-curve --episodes 60 --json rtc_curve.json --plot rtc_curve.png
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

from oxygen_ros.policy_io.prompts import resolve_format
from oxygen_ros.tools.benches import sim_policy
from oxygen_ros.tools.benches.common import print_table, write_json
from oxygen_ros.tools.benches.subtask_modes import CONTINUITY, chunk_source

HELP = "success vs inference delay per RTC mode (sim-policy's episodes): the RTC papers' plot"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sim_policy.add_arguments(parser)
    parser.description = __doc__
    parser.set_defaults(episodes=60, subtask="oracle", noise_layouts=0)
    parser.add_argument(
        "--modes", nargs="+", default=list(CONTINUITY), choices=CONTINUITY, help="lines"
    )
    parser.add_argument(
        "--delays", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="delay steps (points)"
    )
    parser.add_argument("--plot", type=Path, help="write the figure here (PNG)")


def point_args(args: argparse.Namespace, mode: str, delay: int) -> argparse.Namespace:
    """``sim-policy``'s arguments for one point."""
    point = copy.copy(args)
    point.continuity, point.delay_steps, point.execute_steps = mode, delay, 0
    point.noise_layouts = 0
    return point


def row(summary: dict[str, Any], mode: str, delay: int) -> dict[str, Any]:
    """One point as a ``closed-loop`` row."""
    low, high = summary["ci95"]
    return {
        "setting": f"{mode}/d{delay}",
        "continuity": mode,
        "delay_steps": delay,
        "episodes": summary["episodes"],
        "successes": summary["successes"],
        "success": summary["success_rate"],
        "ci_low": low,
        "ci_high": high,
        "wrong_cube": summary["wrong_cube"],
        "timeouts": summary["timeouts"],
        "closest_tip_to_cube_m": summary["closest_tip_to_cube_m"],
        "switch_jump_rad": summary["switch_jump_rad"],
        "switch_jump_rad_p95": summary["switch_jump_rad_p95"],
        "jerk_rms": summary["jerk_rms"],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from oxygen_ros.sim.episode import Simulation

    points = [(mode, delay) for mode in args.modes for delay in args.delays]
    for mode, delay in points:
        sim_policy.check_arguments(point_args(args, mode, delay))
    if args.subtask == "predicted":
        raise SystemExit("oxygen-bench rtc-curve: --subtask predicted is sim-policy's alone")
    policy = sim_policy.make_source(point_args(args, "none", 0)).policy
    sim = Simulation(episode_timeout_s=sim_policy.episode_timeout_s(args))
    result: dict[str, Any] = {
        "bench": "rtc-curve",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "episodes_per_setting": args.episodes,
        "rows": [],
        "runs": {},
    }
    try:
        for mode, delay in points:
            point = point_args(args, mode, delay)
            plan = sim_policy.timing(point)
            try:
                source = chunk_source(
                    args.subtask, policy, resolve_format(args.prompt_format), args.num_steps,
                    args.subtask_every, args.action_dt, sim_policy.continuity_of(point),
                    delay * args.action_dt,
                )  # fmt: skip
            except ValueError as exc:
                raise SystemExit(f"oxygen-bench rtc-curve: --modes {mode}: {exc}") from None
            episodes = sim_policy.run_rounds(sim, source, point, plan)
            summary = sim_policy.summarise(episodes, args.subtask)
            result["rows"].append(row(summary, mode, delay))
            result["runs"][f"{mode}/d{delay}"] = episodes
            print_table(result["rows"][-1:], list(result["rows"][-1]))
            write_json(args.json, result)
    finally:
        sim.world.close()
    print_table(result["rows"], ["setting", "successes", "episodes", "switch_jump_rad"])
    if args.plot:
        from oxygen_ros.tools.plot_closed_loop import plot

        print(f"wrote {plot(result, args.plot)}")
    return result
