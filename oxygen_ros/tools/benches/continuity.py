"""``oxygen-bench continuity``: chunk-switch discontinuity, jerk and action cost of the
continuity modes (none / identity / vjp / trained) on one moving scene."""

from __future__ import annotations

import argparse

from oxygen_ros.engine import EngineConfig, OxygenEngine
from oxygen_ros.engine.metrics import percentile
from oxygen_ros.tools.benches import common
from oxygen_ros.tools.benches.continuity_workload import Replanner, continuity_metrics
from oxygen_ros.tools.cli import positive_int

CONTINUITY_BENCH_MODES = ("none", "identity", "vjp", "trained")


def _continuity_config(args: argparse.Namespace, mode: str, horizon: int) -> EngineConfig:
    """The engine settings of one continuity mode of `run`."""
    max_delay = args.training_max_delay or horizon // 2
    return EngineConfig(
        num_steps=args.steps,
        seed=args.seed,
        chunk_continuity="none" if mode == "none" else "rtc",
        action_dt=args.action_dt,
        rtc_execution_horizon=args.execution_horizon,
        rtc_max_guidance_weight=args.max_guidance_weight,
        rtc_schedule=args.schedule,
        rtc_guidance="vjp" if mode == "vjp" else "identity",
        rtc_training_max_delay=max_delay if mode == "trained" else 0,
        **common.fast_path(args),
    )


HELP = "chunk switch discontinuity, jerk and action cost: none / identity / vjp / trained"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``continuity`` subcommand's arguments."""
    common.common_args(parser, "tiny")
    # as the node (torch_threads 1): steadier latency on a shared CPU
    parser.set_defaults(threads=1)
    parser.add_argument(
        "--frames", type=int, default=300, help="replanned frames per mode (after warm-up)"
    )
    parser.add_argument(
        "--warmup", type=int, default=5, help="frames not counted (latency estimate settles)"
    )
    parser.add_argument(
        "--rate-hz", type=float, default=20.0, help="replanning rate (a new chunk per tick)"
    )
    parser.add_argument(
        "--action-dt", type=float, default=0.02, help="seconds between actions of a chunk"
    )
    parser.add_argument(
        "--execution-horizon",
        type=int,
        default=0,
        help="RTC guided steps at most (0: the whole overlap)",
    )
    parser.add_argument("--max-guidance-weight", type=float, default=5.0, help="RTC beta")
    parser.add_argument(
        "--schedule", default="exp", choices=["exp", "linear"], help="RTC soft-mask schedule"
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=list(CONTINUITY_BENCH_MODES),
        choices=CONTINUITY_BENCH_MODES,
        help="continuity modes, run in interleaved rounds (none first: the cost reference)",
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=3, help="interleaved rounds the frames are split in"
    )
    parser.add_argument(
        "--training-max-delay",
        type=int,
        default=0,
        help="trained mode: the rtc_training_max_delay it assumes (0: half the horizon); random "
        "weights were never trained for it, so it measures cost and mechanics only",
    )


def run(args: argparse.Namespace) -> dict[str, object]:
    """The continuity modes on the same moving scene with the node's replanning rule, in
    interleaved rounds: how far the executed command jumps when a new chunk takes over, the
    executed stream's jerk, and what each mode costs on the action path relative to none."""
    if args.frames < 2:
        raise SystemExit("--frames must be >= 2")
    modes = list(dict.fromkeys(args.modes))
    policy = common.make_policy(args)
    horizon = policy.config.action_horizon
    if args.training_max_delay < 0 or args.training_max_delay >= horizon:
        raise SystemExit(f"--training-max-delay must be in [0, {horizon})")
    configs = {mode: _continuity_config(args, mode, horizon) for mode in modes}
    engines = {mode: OxygenEngine(policy, config) for mode, config in configs.items()}
    runs = {}
    try:
        for engine in engines.values():
            engine.warm_up(common.make_observations(args, policy)[0])
        runs = {
            mode: Replanner(
                e, args.rate_hz, args.cameras, common.robot_state_dim(policy), args.action_dt
            )
            for mode, e in engines.items()
        }
        total = args.warmup + args.frames
        for r in range(args.rounds):
            block = total * (r + 1) // args.rounds - total * r // args.rounds
            for run in runs.values():
                run.run(block)
    finally:
        for engine in engines.values():
            engine.close()
    results: dict[str, dict[str, float]] = {}
    for mode, run in runs.items():
        results[mode] = continuity_metrics(run.chunks, args.action_dt, skip=args.warmup) | {
            "action_ms_p50": percentile(run.action_ms[args.warmup :], 50),
            "action_ms_p99": percentile(run.action_ms[args.warmup :], 99),
            "action_cpu_ms_p50": percentile(run.action_cpu_ms[args.warmup :], 50),
        }
        continuity = engines[mode].continuity
        if continuity is not None:
            results[mode]["trained_fallbacks"] = continuity.trained_fallbacks
    reference = results.get("none")
    for row in results.values():
        if reference is not None:
            row["action_cost_vs_none"] = row["action_ms_p50"] / reference["action_ms_p50"]
            row["action_cpu_vs_none"] = row["action_cpu_ms_p50"] / reference["action_cpu_ms_p50"]
            row["switch_cut_vs_none"] = reference["switch_discontinuity_p50"] / max(
                row["switch_discontinuity_p50"], 1e-12
            )
    config = next(iter(configs.values()))
    print(
        f"continuity: preset={args.preset} robot={args.robot} device={args.device} "
        f"dtype={args.dtype} path={common.path_name(config)} frames={args.frames} in {args.rounds} "
        f"interleaved rounds rate={args.rate_hz:g} Hz action_dt={args.action_dt:g} s "
        f"horizon={horizon} steps={args.steps} guided: schedule={args.schedule} "
        f"beta={args.max_guidance_weight:g} "
        f"execution_horizon={args.execution_horizon or 'overlap'}"
        + (
            f"; trained: rtc_training_max_delay={configs['trained'].rtc_training_max_delay}"
            if "trained" in configs
            else ""
        )
    )
    columns = [
        "mode",
        "switch_discontinuity_p50",
        "switch_discontinuity_p99",
        "jerk_rms",
        "action_ms_p50",
        "action_ms_p99",
        "action_cost_vs_none",
        "action_cpu_vs_none",
        "switch_cut_vs_none",
        "switches_past_previous_end",
    ]
    common.print_table([{"mode": mode, **row} for mode, row in results.items()], columns)
    print(
        "action_cost_vs_none: wall-clock p50 ratio; action_cpu_vs_none: the same in the process's "
        "CPU time (the cost without the waits of a CPU shared with other work)"
    )
    if "trained" in results:
        print(
            "trained: random weights were never trained with a clean prefix; the row measures "
            "the mode's cost and mechanics (the frozen steps are the previous chunk), not the "
            "quality of a trained checkpoint"
            + (
                f"; {results['trained']['trained_fallbacks']} chunks fell back to identity "
                "guidance (delay above the maximum)"
                if results["trained"].get("trained_fallbacks")
                else ""
            )
        )
    late = {m: r["switches_past_previous_end"] for m, r in results.items() if m != "none"}
    if any(late.values()):
        print(
            f"switches after the previous chunk had ended: {late} (latency beyond horizon x "
            f"action_dt = {horizon * args.action_dt:g} s): raise --action-dt or lower the latency"
        )
    out = {
        "preset": args.preset,
        "device": args.device,
        "workload": vars(args) | {"json": str(args.json)},
        "modes": results,
    }
    common.write_json(args.json, out)
    return out
