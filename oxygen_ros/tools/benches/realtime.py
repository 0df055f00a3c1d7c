"""``oxygen-bench realtime``: OxyGen under a paced timer, language decoded in the slack."""

from __future__ import annotations

import argparse

import torch

from oxygen_ros.engine import OxygenEngine
from oxygen_ros.tools.benches import common
from oxygen_ros.tools.benches.workloads import Workload, run_realtime, weight_bytes

HELP = "OxyGen under a paced timer, language in the slack"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``realtime`` subcommand's arguments."""
    common.common_args(parser, "tiny")
    common.workload_args(parser, 200)
    parser.add_argument("--rate-hz", type=float, default=60.0)


def run(args: argparse.Namespace) -> dict[str, object]:
    policy = common.make_policy(args)
    cuda = policy.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # not the weight-init scratch: weights + KV + run
    engine = OxygenEngine(
        policy, common.engine_config(args, decode_mode="deadline", max_active_requests=32)
    )
    try:
        result = run_realtime(
            engine,
            common.make_observations(args, policy),
            Workload(args.frames, args.warmup, args.requests_per_frame, args.tokens),
            args.rate_hz,
        )
        result["path"] = common.path_name(engine.config)
        result["robot"] = args.robot
        result["kv_capacity_bytes"] = engine.memory()["capacity_bytes"]
    finally:
        engine.close()
    result["weight_bytes"] = weight_bytes(policy)
    if cuda:
        result["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated()
    common.print_table([result], list(result))
    common.write_json(args.json, result)
    return result
