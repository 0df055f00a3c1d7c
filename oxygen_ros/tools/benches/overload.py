"""``oxygen-bench overload``: action latency with no language vs. far more requests than KV
memory holds."""

from __future__ import annotations

import argparse

from oxygen_ros.engine import OxygenEngine
from oxygen_ros.engine.frames import max_prefix_tokens
from oxygen_ros.engine.metrics import percentile
from oxygen_ros.tools.benches import common
from oxygen_ros.tools.benches.workloads import Workload, submit_due

HELP = "many concurrent requests, small KV memory"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``overload`` subcommand's arguments."""
    common.common_args(parser, "tiny")
    common.workload_args(parser, 100)
    parser.add_argument("--kv-prefixes", type=int, default=4, help="KV capacity in frame prefixes")


def run(args: argparse.Namespace) -> dict[str, object]:
    """Action latency with no language vs. with far more requests than KV memory can hold."""
    policy = common.make_policy(args)
    observations = common.make_observations(args, policy)
    capacity = args.kv_prefixes * max_prefix_tokens(policy)
    rows = []
    for label, rate in (("action only", 0.0), ("overloaded", args.requests_per_frame)):
        engine = OxygenEngine(
            policy,
            common.engine_config(
                args, decode_mode="fixed", kv_capacity_tokens=capacity, max_wait_frames=5
            ),
        )
        engine.warm_up(observations[0])
        refused = 0
        action_ms: list[float] = []
        workload, due = Workload(requests_per_frame=rate, max_tokens=args.tokens), 0.0
        for i in range(args.warmup + args.frames):
            due = submit_due(engine, due, workload)
            result = engine.step(observations[i % len(observations)])
            refused += sum(d.finish_reason == "refused" for d in result.deltas)
            if i >= args.warmup:
                action_ms.append(result.stats.prefill_ms + result.stats.action_ms)
        rows.append(
            {
                "run": label,
                "action_p50_ms": percentile(action_ms, 50),
                "action_p99_ms": percentile(action_ms, 99),
                "refused": refused,
                "tokens": engine.tokens_generated,
                "peak_kv_bytes": engine.memory()["peak_bytes"],
                "kv_capacity_bytes": engine.memory()["capacity_bytes"],
            }
        )
        engine.close()
    common.print_table(rows, list(rows[0]))
    out = {"rows": rows}
    common.write_json(args.json, out)
    return out
