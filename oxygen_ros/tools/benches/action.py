"""``oxygen-bench action``: the action path alone (host preprocessing, upload, prefill, chunk)
per camera count, eager and on the GPU fast path."""

from __future__ import annotations

import argparse
import time

from oxygen_ros.engine import EngineConfig
from oxygen_ros.engine.base import make_pool, make_runner
from oxygen_ros.engine.frames import timed_action
from oxygen_ros.engine.metrics import percentile
from oxygen_ros.model.config import IMAGE_SLOTS
from oxygen_ros.tools.benches import common

HELP = "action path alone (prefill + chunk) for 1, 2, 3 cameras"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``action`` subcommand's arguments."""
    common.common_args(parser, "small")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--camera-counts",
        type=int,
        nargs="+",
        help="camera counts to time (default: 1 up to the robot's cameras, 3 for generic)",
    )
    parser.add_argument(
        "--no-dynamic", action="store_true", help="skip the eager (dynamic-shape) reference"
    )


def run(args: argparse.Namespace) -> dict[str, object]:
    """Latency of the action path alone, observation in, robot actions on the host out: host
    preprocessing, upload, prefill (KV into the pool) and the denoised chunk, per camera count."""
    policy = common.make_policy(args)
    fast = EngineConfig(num_steps=args.steps, seed=args.seed, **common.fast_path(args))
    configs = (
        [fast]
        if args.no_dynamic or not fast.uses_static_paths
        else [EngineConfig(num_steps=args.steps, seed=args.seed), fast]
    )
    rows = []
    counts = args.camera_counts or range(1, len(policy.robot.slots or IMAGE_SLOTS) + 1)
    for cameras in counts:
        observations = common.make_observations(args, policy, cameras)
        for config in configs:
            pool = make_pool(policy, config)
            runner = make_runner(policy, pool, config)
            if config.cuda_graphs:
                runner.warm_up(observations[0], num_steps=config.num_steps)
            total: list[float] = []
            prefill: list[float] = []
            action: list[float] = []
            for i in range(args.warmup + args.repeats):
                start = time.perf_counter()
                frame, chunk = timed_action(
                    policy,
                    pool,
                    observations[i % len(observations)],
                    i,
                    config.seed,
                    config.num_steps,
                    time.perf_counter,
                    runner,
                )
                elapsed = (time.perf_counter() - start) * 1e3
                pool.release(frame.segment)
                if i >= args.warmup:
                    total.append(elapsed)
                    prefill.append(chunk.prefill_ms)
                    action.append(chunk.action_ms)
            rows.append(
                {
                    "cameras": cameras,
                    "path": common.path_name(config),
                    "p50_ms": percentile(total, 50),
                    "p99_ms": percentile(total, 99),
                    "prefill_p50_ms": percentile(prefill, 50),
                    "chunk_p50_ms": percentile(action, 50),
                    "repeats": args.repeats,
                }
            )
    print(
        f"action path: preset={args.preset} robot={args.robot} device={args.device} "
        f"dtype={args.dtype} "
        f"steps={args.steps} (observation -> robot actions on the host)"
    )
    common.print_table(
        rows, ["cameras", "path", "p50_ms", "p99_ms", "prefill_p50_ms", "chunk_p50_ms", "repeats"]
    )
    out = {
        "preset": args.preset,
        "robot": args.robot,
        "device": args.device,
        "dtype": args.dtype,
        "rows": rows,
    }
    common.write_json(args.json, out)
    return out
