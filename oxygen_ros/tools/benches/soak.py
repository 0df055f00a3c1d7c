"""``oxygen-bench soak``: a long deadline-mode run (optionally with a fault every N ticks): KV
back to 0 after close, RSS flat, one final delta per request."""

from __future__ import annotations

import argparse
import time

from oxygen_ros.engine import EngineConfig, OxygenEngine
from oxygen_ros.engine.faults import STAGES, FaultInjector, InjectedFault
from oxygen_ros.tools.benches import common
from oxygen_ros.tools.benches.workloads import Workload, submit_due
from oxygen_ros.tools.cli import positive_int


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def soak_stages(config: EngineConfig) -> list[str]:
    """The engine stages a soak rotates its faults over (graph replays only on the static paths;
    text publishing is the node's)."""
    return [
        st
        for st in STAGES
        if st != "text_publish" and (st != "graph_replay" or config.uses_static_paths)
    ]


HELP = "long run: KV and RSS must return to baseline"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``soak`` subcommand's arguments."""
    common.common_args(parser, "tiny")
    common.workload_args(parser, 20_000)
    parser.add_argument(
        "--rate-hz", type=float, default=30.0, help="deadline for miss counting (not paced)"
    )
    parser.add_argument(
        "--inject-faults",
        action="store_true",
        help="inject a fault (engine/faults.py) every --fault-every ticks, rotating over the "
        "engine's stages",
    )
    parser.add_argument(
        "--fault-every", type=positive_int, default=500, help="ticks between injected faults"
    )


def run(args: argparse.Namespace) -> dict[str, object]:
    """A long deadline-mode run: KV back to 0 after close, RSS flat. With --inject-faults, the tick
    loop is the node's (act, then decode even when act failed) and every request's final delta is
    checked: one each, faulted or not."""
    policy = common.make_policy(args)
    observations = common.make_observations(args, policy)
    config = common.engine_config(args, decode_mode="deadline")
    injector = FaultInjector()
    engine = OxygenEngine(policy, config, faults=injector)
    stages = soak_stages(config)
    period = 1.0 / args.rate_hz
    workload = Workload(requests_per_frame=args.requests_per_frame, max_tokens=args.tokens)
    due, misses = 0.0, 0
    submitted: list[int] = []
    finals: dict[int, int] = {}
    chunkless_faulted = chunkless_unfaulted = 0
    kv_start = rss_start = 0

    def count_finals(deltas) -> None:
        for d in deltas:
            if d.final:
                finals[d.request_id] = finals.get(d.request_id, 0) + 1

    started = time.perf_counter()
    for i in range(args.warmup + args.frames):
        measured = i - args.warmup
        if measured == 0:
            kv_start, rss_start = engine.memory()["bytes_in_use"], _rss_bytes()
        if args.inject_faults and measured > 0 and measured % args.fault_every == 0:
            injector.fail_next(stages[(measured // args.fault_every - 1) % len(stages)])
        due = submit_due(engine, due, workload, submitted)
        tick = time.perf_counter()
        try:
            engine.act(observations[i % len(observations)])
        except InjectedFault:
            chunkless_faulted += 1
        except Exception as error:
            # a real fault: must not happen, counted and survived like the node
            chunkless_unfaulted += 1
            print(f"  tick {i}: act raised {type(error).__name__}: {error}", flush=True)
        count_finals(engine.decode(until=tick + period))
        misses += measured >= 0 and time.perf_counter() > tick + period
        if (i + 1) % 2000 == 0:
            print(
                f"{i + 1} ticks, KV {engine.memory()['bytes_in_use'] / 1e6:.2f} MB, RSS "
                f"{_rss_bytes() / 1e6:.0f} MB, faults {dict(injector.raised)}",
                flush=True,
            )
    kv_running = engine.memory()["bytes_in_use"]
    count_finals(engine.decode(max_steps=10_000))
    count_finals(engine.close())
    rss_end = _rss_bytes()
    result = {
        "ticks": args.frames,
        "wall_s": time.perf_counter() - started,
        "requests_submitted": len(submitted),
        "requests_finished": sum(finals.values()),
        "requests_without_one_final": sum(finals.get(r, 0) != 1 for r in submitted),
        "faults_injected": dict(injector.raised),
        "faults_by_stage": dict(engine.faults_by_stage),
        "ticks_without_chunk_faulted": chunkless_faulted,
        "ticks_without_chunk_unfaulted": chunkless_unfaulted,
        "kv_bytes_start": kv_start,
        "kv_bytes_end_running": kv_running,
        "kv_bytes_after_close": engine.memory()["bytes_in_use"],
        "live_segments_after_close": engine.memory()["live_segments"],
        "rss_start_mb": rss_start / 1e6,
        "rss_end_mb": rss_end / 1e6,
        "rss_drift_mb": (rss_end - rss_start) / 1e6,
        "deadline_misses": misses,
        "deadline_ms": period * 1e3,
    }
    common.print_table(
        [{k: v for k, v in result.items() if not isinstance(v, dict)}],
        [k for k, v in result.items() if not isinstance(v, dict)],
    )
    print(
        f"faults injected per stage: {result['faults_injected']}; counted by the engine: "
        f"{result['faults_by_stage']}"
    )
    common.write_json(args.json, result)
    return result
