"""``oxygen-bench``: measure the engines side by side, the model's parts, a paced real-time loop,
overload, and a long soak. Every subcommand prints a table; ``--json`` writes the numbers.

    oxygen-bench engines --preset small            # the paper's workload, all engines, one run
    oxygen-bench model --preset small              # prefill / denoise step / decode step ms
    oxygen-bench realtime --rate-hz 60             # OxyGen under a 60 Hz timer
    oxygen-bench overload --requests-per-frame 8   # KV exhausted: refusals, action latency
    oxygen-bench soak --frames 20000               # KV and RSS drift over a long run
    oxygen-bench soak --inject-faults              # ... a fault every 500 ticks, rotating stages
    oxygen-bench action --preset pi05 --device cuda --dtype bfloat16 --cuda-graphs
                                                   # prefill + chunk latency, 1/2/3 cameras
    oxygen-bench summary --dir OUT                 # combine action/engines/realtime JSON
    oxygen-bench continuity --preset small         # chunk switches: none/identity/vjp/trained
    oxygen-bench hierarchy --preset tiny           # subtasks: none vs per call vs in the slack

Robots: ``--robot droid|libero|aloha|generic`` wraps the random-weight model in that robot's openpi
transforms (model/robots.py), as the node's ``robot`` parameter does: its state width and state
transform, the state in the prompt or not, its action width and output transform, its camera
slots and trained horizon (``aloha`` needs 14 action dims: ``--preset small`` or larger).

GPU fast path: ``--static-shapes`` runs the fixed-shape steps (engine/static_paths.py),
``--cuda-graphs`` captures them in CUDA graphs, ``--gpu-preprocess`` resizes images on the device,
``--init device`` draws random weights on the device (seconds for pi05). scripts/gpu_bench.sh runs
the whole GPU measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.engine import ENGINES, EngineConfig, OxygenEngine, make_engine
from oxygen_ros.engine.faults import STAGES, FaultInjector, InjectedFault
from oxygen_ros.engine.frames import max_prefix_tokens, timed_action
from oxygen_ros.engine.metrics import percentile
from oxygen_ros.engine.scheduler import make_pool, make_runner
from oxygen_ros.model.config import IMAGE_SLOTS
from oxygen_ros.model.robots import ROBOTS, robot_adapter
from oxygen_ros.tools.cli import positive_int
from oxygen_ros.tools.continuity_workload import Replanner, continuity_metrics
from oxygen_ros.tools.hierarchy_workload import run_hierarchy
from oxygen_ros.tools.make_checkpoint import random_policy
from oxygen_ros.tools.workloads import (
    FrameSamples,
    Workload,
    compare_engines,
    component_times,
    run_frames,
    run_realtime,
    submit_due,
    synthetic_observations,
    time_ms,
    weight_bytes,
)


def _common(parser: argparse.ArgumentParser, preset: str) -> None:
    parser.add_argument("--preset", default=preset, help="model preset (tiny, small, pi05)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads (0 = torch default)"
    )
    parser.add_argument(
        "--robot",
        default="generic",
        choices=list(ROBOTS),
        help="robot transforms around the model (model/robots.py; default generic: none)",
    )
    parser.add_argument(
        "--cameras", type=int, default=2, help="camera images per frame (at most the robot's)"
    )
    parser.add_argument("--steps", type=int, default=10, help="flow-matching denoising steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write results as JSON here")
    parser.add_argument(
        "--static-shapes", action="store_true", help="fixed-shape prefill/action/decode steps"
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="capture the fixed-shape steps in CUDA graphs (CUDA only)",
    )
    parser.add_argument(
        "--gpu-preprocess", action="store_true", help="resize/scale images on the model device"
    )
    parser.add_argument(
        "--init", default="cpu", choices=["cpu", "device"], help="where random weights are drawn"
    )


def _workload_args(parser: argparse.ArgumentParser, frames: int) -> None:
    parser.add_argument(
        "--frames", type=int, default=frames, help="measured frames (after warm-up)"
    )
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--requests-per-frame", type=float, default=1.0, help="language arrival rate"
    )
    parser.add_argument("--tokens", type=int, default=30, help="max tokens per request")
    parser.add_argument(
        "-k",
        "--decode-steps",
        type=int,
        default=5,
        help="OxyGen decode steps per frame (fixed mode)",
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="oxygen-bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command")
    engines = sub.add_parser("engines", help="all engines on the paper's workload")
    _common(engines, "small")
    _workload_args(engines, 50)
    engines.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    # per round; OxyGen's batch is steady after 30 tokens / k=5 = 6 frames
    engines.set_defaults(warmup=6)
    engines.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="interleaved rounds: each engine runs frames/rounds frames (after its warm-up) per "
        "round, so drifting machine speed hits every engine alike (default 3)",
    )
    engines.add_argument("--plot", type=Path, help="write a PNG bar chart here")
    model = sub.add_parser("model", help="prefill, denoise-step and decode-step latency")
    _common(model, "small")
    model.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    model.add_argument("--repeats", type=int, default=5)
    realtime = sub.add_parser("realtime", help="OxyGen under a paced timer, language in the slack")
    _common(realtime, "tiny")
    _workload_args(realtime, 200)
    realtime.add_argument("--rate-hz", type=float, default=60.0)
    overload = sub.add_parser("overload", help="many concurrent requests, small KV memory")
    _common(overload, "tiny")
    _workload_args(overload, 100)
    overload.add_argument(
        "--kv-prefixes", type=int, default=4, help="KV capacity in frame prefixes"
    )
    soak = sub.add_parser("soak", help="long run: KV and RSS must return to baseline")
    _common(soak, "tiny")
    _workload_args(soak, 20_000)
    soak.add_argument(
        "--rate-hz", type=float, default=30.0, help="deadline for miss counting (not paced)"
    )
    soak.add_argument(
        "--inject-faults",
        action="store_true",
        help="inject a fault (engine/faults.py) every --fault-every ticks, rotating over the "
        "engine's stages",
    )
    soak.add_argument(
        "--fault-every", type=positive_int, default=500, help="ticks between injected faults"
    )
    action = sub.add_parser(
        "action", help="action path alone (prefill + chunk) for 1, 2, 3 cameras"
    )
    _common(action, "small")
    action.add_argument("--repeats", type=int, default=30)
    action.add_argument("--warmup", type=int, default=3)
    action.add_argument(
        "--camera-counts",
        type=int,
        nargs="+",
        help="camera counts to time (default: 1 up to the robot's cameras, 3 for generic)",
    )
    action.add_argument(
        "--no-dynamic", action="store_true", help="skip the eager (dynamic-shape) reference"
    )
    continuity = sub.add_parser(
        "continuity",
        help="chunk switch discontinuity, jerk and action cost: none / identity / vjp / trained",
    )
    _common(continuity, "tiny")
    # as the node (torch_threads 1): steadier latency on a shared CPU
    continuity.set_defaults(threads=1)
    continuity.add_argument(
        "--frames", type=int, default=300, help="replanned frames per mode (after warm-up)"
    )
    continuity.add_argument(
        "--warmup", type=int, default=5, help="frames not counted (latency estimate settles)"
    )
    continuity.add_argument(
        "--rate-hz", type=float, default=20.0, help="replanning rate (a new chunk per tick)"
    )
    continuity.add_argument(
        "--action-dt", type=float, default=0.02, help="seconds between actions of a chunk"
    )
    continuity.add_argument(
        "--execution-horizon",
        type=int,
        default=0,
        help="RTC guided steps at most (0: the whole overlap)",
    )
    continuity.add_argument("--max-guidance-weight", type=float, default=5.0, help="RTC beta")
    continuity.add_argument(
        "--schedule", default="exp", choices=["exp", "linear"], help="RTC soft-mask schedule"
    )
    continuity.add_argument(
        "--modes",
        nargs="+",
        default=list(CONTINUITY_BENCH_MODES),
        choices=CONTINUITY_BENCH_MODES,
        help="continuity modes, run in interleaved rounds (none first: the cost reference)",
    )
    continuity.add_argument(
        "--rounds", type=positive_int, default=3, help="interleaved rounds the frames are split in"
    )
    continuity.add_argument(
        "--training-max-delay",
        type=int,
        default=0,
        help="trained mode: the rtc_training_max_delay it assumes (0: half the horizon); random "
        "weights were never trained for it, so it measures cost and mechanics only",
    )
    hierarchy = sub.add_parser(
        "hierarchy",
        help="pi0.5's subtask: none vs decoded per call (PR #942) vs in the slack (same_frame)",
    )
    _common(hierarchy, "tiny")
    hierarchy.set_defaults(threads=1)  # as the node (torch_threads 1): steadier on a shared CPU
    hierarchy.add_argument("--frames", type=int, default=60, help="measured frames per mode")
    hierarchy.add_argument("--warmup", type=int, default=5, help="unmeasured frames per mode")
    hierarchy.add_argument(
        "--prompt-format",
        default="openpi_subtask",
        choices=["openpi_subtask", "opentau", "brunofang"],
        help="a format where same_frame is exact",
    )
    hierarchy.add_argument(
        "--subtask-period-s", type=float, default=0.5, help="oxygen: seconds between subtasks"
    )
    hierarchy.add_argument(
        "--subtask-tokens", type=int, default=0, help="subtask token limit (0: the format's, 64)"
    )
    hierarchy.add_argument(
        "--period-ms",
        type=float,
        default=0.0,
        help="oxygen: tick period (0: twice the none mode's median action path)",
    )
    summary = sub.add_parser(
        "summary", help="combine action/engines/realtime JSON of one run, check targets"
    )
    summary.add_argument(
        "--dir",
        type=Path,
        required=True,
        help="folder with action.json, engines.json, realtime.json",
    )
    summary.add_argument(
        "--json", type=Path, help="write the summary here (default DIR/summary.json)"
    )
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["engines", *(argv or [])])
    return args


def _print_table(rows: list[dict[str, object]], columns: list[str]) -> None:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"
        return str(v)

    table = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=False)))
    for t in table:
        print("  ".join(v.rjust(w) for v, w in zip(t, widths, strict=False)))


def _policy(args: argparse.Namespace):
    """The random-weight policy of ``--preset`` wrapped in ``--robot``'s transforms (generic: 7
    action dims)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    robot = robot_adapter(args.robot)
    try:
        return random_policy(
            args.preset,
            args.device,
            args.dtype,
            args.seed,
            action_dim=None if robot.action_dim else 7,
            init=args.init,
            robot=robot.name,
        )
    except ValueError as exc:  # a robot the preset cannot serve, a device torch cannot use
        raise SystemExit(f"oxygen-bench: {exc}") from exc


def _observations(args: argparse.Namespace, policy, cameras: int | None = None):
    """Synthetic frames with ``cameras`` (default ``--cameras``) images and the policy's robot
    state width (generic: 7).

    Raises:
        SystemExit: more cameras than the robot was trained with.
    """
    cameras = args.cameras if cameras is None else cameras
    robot = policy.robot
    if robot.slots and cameras > len(robot.slots):
        raise SystemExit(
            f"oxygen-bench: robot {robot.name} was trained with {len(robot.slots)} cameras "
            f"({', '.join(robot.slots)}), not {cameras}"
        )
    return synthetic_observations(cameras, state_dim=_state_dim(policy))


def _state_dim(policy) -> int:
    return policy.robot.state_dim or 7


def _fast_path(args: argparse.Namespace) -> dict[str, bool]:
    """The EngineConfig switches of the GPU fast path given on the command line."""
    return {
        "static_shapes": args.static_shapes,
        "cuda_graphs": args.cuda_graphs,
        "gpu_preprocess": args.gpu_preprocess,
    }


def _path_name(config: EngineConfig) -> str:
    return "cuda-graphs" if config.cuda_graphs else "static" if config.static_shapes else "dynamic"


def _write_json(path: Path | None, data: dict[str, object]) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str))
        print(f"wrote {path}")


def bench_engines(args: argparse.Namespace) -> dict[str, object]:
    policy = _policy(args)
    observations = _observations(args, policy)
    config = EngineConfig(
        num_steps=args.steps,
        decode_mode="fixed",
        decode_steps_per_frame=args.decode_steps,
        seed=args.seed,
        **_fast_path(args),
    )
    workload = Workload(args.frames, args.warmup, args.requests_per_frame, args.tokens)
    print(
        f"workload: preset={args.preset} robot={args.robot} device={args.device} "
        f"dtype={args.dtype} cameras={args.cameras} steps={args.steps} "
        f"k={args.decode_steps} requests/frame={args.requests_per_frame} tokens={args.tokens} "
        f"frames={args.frames} "
        f"in {args.rounds} interleaved round(s), each after {args.warmup} warm-up frames; "
        f"path={_path_name(config)}"
    )
    component_rounds: list[dict[str, float]] = []

    def time_components(name: str, part: FrameSamples) -> None:
        """After OxyGen's part of each round: its components, each alone, in the same time
        window."""
        if name == "oxygen":
            batch = max(1, round(sum(part.active) / len(part.active)))
            repeats = max(5, 20 // args.rounds)
            component_rounds.append(
                component_times(policy, config, observations[0], batch, repeats) | {"batch": batch}
            )

    results, errors = compare_engines(
        lambda name: make_engine(name, policy, config),
        args.engines,
        observations,
        workload,
        args.rounds,
        time_components,
    )
    for name, error in errors.items():
        print(f"{name}: FAILED {error}", file=sys.stderr)
    base = results.get("isolated-sequential", {}).get("frames_per_s")
    rows = []
    for name, r in results.items():
        r["speedup_vs_isolated"] = r["frames_per_s"] / base if base else float("nan")
        rows.append({"engine": name, **r})
    _print_table(
        rows,
        [
            "engine",
            "frames_per_s",
            "speedup_vs_isolated",
            "paper_action_hz",
            "tokens_per_s",
            "p50_frame_ms",
            "p99_frame_ms",
            "peak_kv_bytes",
            "mean_active_requests",
        ],
    )
    checks = _oxygen_checks(args, policy, config, observations, results, component_rounds)
    for line in checks.pop("lines"):
        print(line)
    out = {
        "workload": vars(args) | {"json": str(args.json), "plot": str(args.plot)},
        "engines": results,
        "errors": errors,
        "checks": checks,
    }
    _write_json(args.json, out)
    if args.plot and results:
        _plot(results, args.plot)
    return out


def _oxygen_checks(
    args, policy, config, observations, results, component_rounds
) -> dict[str, object]:
    """Scheduling overhead and language KV overhead of OxyGen, against components timed alone
    (``component_rounds``: one `component_times` per round, taken right after OxyGen's frames)."""
    checks: dict[str, object] = {"lines": []}
    ox = results.get("oxygen")
    if not ox:
        return checks
    parts = {
        key: float(np.median([c[key] for c in component_rounds])) for key in component_rounds[0]
    }
    batch = int(parts["batch"])
    admits = args.requests_per_frame  # new requests per frame, each prefilling its kind text
    alone = (
        parts["prefill_ms"]
        + parts["action_ms"]
        + admits * parts["admit_ms"]
        + args.decode_steps * parts["decode_step_ms"]
    )
    checks["components_ms"] = parts | {"batch": batch, "sum_ms": alone}
    # Medians on both sides: a frame is the sum of the same parts, and on a shared machine the mean
    # of either side is moved by a few outlier frames (GC, other processes).
    checks["frame_over_components"] = ox["p50_frame_ms"] / alone
    action_only = OxygenEngine(policy, config)
    quiet = run_frames(action_only, observations, Workload(10, 2, 0.0, args.tokens))
    action_only.close()
    weights = weight_bytes(policy)
    checks["action_only_peak_kv_bytes"] = quiet["peak_kv_bytes"]
    checks["language_kv_overhead"] = ox["peak_kv_bytes"] / quiet["peak_kv_bytes"] - 1
    checks["language_memory_overhead_incl_weights"] = (weights + ox["peak_kv_bytes"]) / (
        weights + quiet["peak_kv_bytes"]
    ) - 1
    checks["weight_bytes"] = weights
    lines = checks["lines"]
    lines.append(
        f"components alone: prefill {parts['prefill_ms']:.1f} ms + action {parts['action_ms']:.1f} "
        f"ms + {admits:g} x admit {parts['admit_ms']:.1f} ms + "
        f"{args.decode_steps} x decode@{batch} {parts['decode_step_ms']:.1f} ms = {alone:.1f} "
        f"ms (medians over {len(component_rounds)} rounds); "
        f"OxyGen p50 frame {ox['p50_frame_ms']:.1f} ms (mean {ox['mean_frame_ms']:.1f}) -> ratio "
        f"{checks['frame_over_components']:.2f} (target <= 1.10)"
    )
    lines.append(
        f"KV: action-only peak {quiet['peak_kv_bytes'] / 1e6:.2f} MB, with language "
        f"{ox['peak_kv_bytes'] / 1e6:.2f} MB (+{100 * checks['language_kv_overhead']:.0f}% of KV; "
        f"+{100 * checks['language_memory_overhead_incl_weights']:.1f}% "
        f"of weights+KV, weights {weights / 1e6:.0f} MB) at mean batch "
        f"{ox['mean_active_requests']:.1f}"
    )
    for name in ("oxygen", "shared-kv", "naive-parallel"):
        if name in results and "speedup_vs_isolated" in results[name]:
            lines.append(
                f"{name}: {results[name]['speedup_vs_isolated']:.2f}x isolated-sequential frames/s"
            )
    return checks


def _plot(results: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(
        axes,
        ["frames_per_s", "tokens_per_s", "p99_frame_ms"],
        ["frames / s", "tokens / s", "p99 frame ms"],
        strict=False,
    ):
        ax.bar(
            names,
            [results[n][key] for n in names],
            color=["#2a9d8f" if n == "oxygen" else "#8d99ae" for n in names],
        )
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def bench_model(args: argparse.Namespace) -> dict[str, object]:
    """Latency of the model's three operations: prefill (per camera count, then per batch size),
    one denoising step of the action expert, and one batched decode step, each at batch 1/4/16."""
    policy = _policy(args)
    model = policy.model
    rows: list[dict[str, object]] = []

    def record(part: str, batch: int, fn) -> None:
        ms = time_ms(fn, policy, args.repeats)
        rows.append(
            {
                "part": part,
                "batch": batch,
                "p50_ms": percentile(ms, 50),
                "p99_ms": percentile(ms, 99),
            }
        )

    def batched(inputs, batch: int):
        return [
            t.expand(batch, *t.shape[1:])
            for t in (inputs.images, inputs.image_masks, inputs.tokens, inputs.token_masks)
        ]

    for cameras in range(1, len(policy.robot.slots or IMAGE_SLOTS) + 1):
        obs = _observations(args, policy, cameras)[0]
        inputs = policy.encode(obs.images, obs.state, obs.prompt)
        record(f"prefill {cameras} cam", 1, lambda x=inputs: model.prefill(*batched(x, 1)))
    obs = _observations(args, policy)[0]
    inputs = policy.encode(obs.images, obs.state, obs.prompt)
    t = torch.tensor(0.5, device=policy.device)
    for batch in args.batches:
        if batch > 1:
            record(
                f"prefill {args.cameras} cam",
                batch,
                lambda b=batch: model.prefill(*batched(inputs, b)),
            )
        prefix = model.prefill(*batched(inputs, batch))
        noise = torch.randn(
            batch, policy.config.action_horizon, policy.config.action_dim, device=policy.device
        )
        record("denoise step", batch, lambda p=prefix, x=noise: model.denoise_step(p, x, t))
        tokens = torch.zeros(batch, 1, dtype=torch.long, device=policy.device)
        positions = prefix.num_valid[:, None]
        record(
            "decode step",
            batch,
            lambda p=prefix, x=tokens, pos=positions: model.logits(
                model.forward_text(p.context, x, pos).hidden[:, 0]
            ),
        )
    print(
        f"preset={args.preset} robot={args.robot} device={args.device} dtype={args.dtype} "
        f"threads={torch.get_num_threads()}"
    )
    rows.sort(key=lambda r: (str(r["part"]).split()[0], r["batch"]))
    _print_table(rows, ["part", "batch", "p50_ms", "p99_ms"])
    out = {"preset": args.preset, "robot": args.robot, "rows": rows}
    _write_json(args.json, out)
    return out


def _engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    return EngineConfig(
        num_steps=args.steps,
        seed=args.seed,
        decode_steps_per_frame=args.decode_steps,
        default_max_tokens=args.tokens,
        **_fast_path(args),
        **overrides,
    )


def bench_realtime(args: argparse.Namespace) -> dict[str, object]:
    policy = _policy(args)
    cuda = policy.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # not the weight-init scratch: weights + KV + run
    engine = OxygenEngine(
        policy, _engine_config(args, decode_mode="deadline", max_active_requests=32)
    )
    try:
        result = run_realtime(
            engine,
            _observations(args, policy),
            Workload(args.frames, args.warmup, args.requests_per_frame, args.tokens),
            args.rate_hz,
        )
        result["path"] = _path_name(engine.config)
        result["robot"] = args.robot
        result["kv_capacity_bytes"] = engine.memory()["capacity_bytes"]
    finally:
        engine.close()
    result["weight_bytes"] = weight_bytes(policy)
    if cuda:
        result["peak_gpu_memory_bytes"] = torch.cuda.max_memory_allocated()
    _print_table([result], list(result))
    _write_json(args.json, result)
    return result


def bench_action(args: argparse.Namespace) -> dict[str, object]:
    """Latency of the action path alone, observation in, robot actions on the host out: host
    preprocessing, upload, prefill (KV into the pool) and the denoised chunk, per camera count."""
    policy = _policy(args)
    fast = EngineConfig(num_steps=args.steps, seed=args.seed, **_fast_path(args))
    configs = (
        [fast]
        if args.no_dynamic or not fast.uses_static_paths
        else [EngineConfig(num_steps=args.steps, seed=args.seed), fast]
    )
    rows = []
    counts = args.camera_counts or range(1, len(policy.robot.slots or IMAGE_SLOTS) + 1)
    for cameras in counts:
        observations = _observations(args, policy, cameras)
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
                    "path": _path_name(config),
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
    _print_table(
        rows, ["cameras", "path", "p50_ms", "p99_ms", "prefill_p50_ms", "chunk_p50_ms", "repeats"]
    )
    out = {
        "preset": args.preset,
        "robot": args.robot,
        "device": args.device,
        "dtype": args.dtype,
        "rows": rows,
    }
    _write_json(args.json, out)
    return out


def bench_overload(args: argparse.Namespace) -> dict[str, object]:
    """Action latency with no language vs. with far more requests than KV memory can hold."""
    policy = _policy(args)
    observations = _observations(args, policy)
    capacity = args.kv_prefixes * max_prefix_tokens(policy)
    rows = []
    for label, rate in (("action only", 0.0), ("overloaded", args.requests_per_frame)):
        engine = OxygenEngine(
            policy,
            _engine_config(
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
    _print_table(rows, list(rows[0]))
    out = {"rows": rows}
    _write_json(args.json, out)
    return out


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


def bench_soak(args: argparse.Namespace) -> dict[str, object]:
    """A long deadline-mode run: KV back to 0 after close, RSS flat. With --inject-faults, the tick
    loop is the node's (act, then decode even when act failed) and every request's final delta is
    checked: one each, faulted or not."""
    policy = _policy(args)
    observations = _observations(args, policy)
    config = _engine_config(args, decode_mode="deadline")
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
    _print_table(
        [{k: v for k, v in result.items() if not isinstance(v, dict)}],
        [k for k, v in result.items() if not isinstance(v, dict)],
    )
    print(
        f"faults injected per stage: {result['faults_injected']}; counted by the engine: "
        f"{result['faults_by_stage']}"
    )
    _write_json(args.json, result)
    return result


# Issue 6 targets on one H200 with the pi05 preset.
TARGETS = {
    "action_2cam_p99_ms": 10.0,
    "oxygen_speedup_vs_isolated": 3.7,
    "realtime_frames_per_s": 60.0,
    "realtime_p99_frame_ms": 1000.0 / 60.0,
    "realtime_tokens_per_s": 1000.0,
    "realtime_mean_active_requests": 8.0,
}


def bench_summary(args: argparse.Namespace) -> dict[str, object]:
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
    _print_table([{"figure": k, "value": v} for k, v in figures.items()], ["figure", "value"])
    for key, check in checks.items():
        sign = ">=" if not key.endswith("_ms") else "<="
        print(
            f"  {'MET ' if check['met'] else 'MISS'} {key} = {check['value']:.2f} (target {sign} "
            f"{check['target']:.1f})"
        )
    out = {"figures": figures, "targets": checks}
    _write_json(args.json or args.dir / "summary.json", out)
    return out


CONTINUITY_BENCH_MODES = ("none", "identity", "vjp", "trained")


def _continuity_config(args: argparse.Namespace, mode: str, horizon: int) -> EngineConfig:
    """The engine settings of one `bench_continuity` mode."""
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
        **_fast_path(args),
    )


def bench_continuity(args: argparse.Namespace) -> dict[str, object]:
    """The continuity modes on the same moving scene with the node's replanning rule, in
    interleaved rounds: how far the executed command jumps when a new chunk takes over, the
    executed stream's jerk, and what each mode costs on the action path relative to none."""
    if args.frames < 2:
        raise SystemExit("--frames must be >= 2")
    modes = list(dict.fromkeys(args.modes))
    policy = _policy(args)
    horizon = policy.config.action_horizon
    if args.training_max_delay < 0 or args.training_max_delay >= horizon:
        raise SystemExit(f"--training-max-delay must be in [0, {horizon})")
    configs = {mode: _continuity_config(args, mode, horizon) for mode in modes}
    engines = {mode: OxygenEngine(policy, config) for mode, config in configs.items()}
    runs = {}
    try:
        for engine in engines.values():
            engine.warm_up(_observations(args, policy)[0])
        runs = {
            mode: Replanner(e, args.rate_hz, args.cameras, _state_dim(policy), args.action_dt)
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
        f"dtype={args.dtype} path={_path_name(config)} frames={args.frames} in {args.rounds} "
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
    _print_table([{"mode": mode, **row} for mode, row in results.items()], columns)
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
    _write_json(args.json, out)
    return out


def bench_hierarchy(args: argparse.Namespace) -> dict[str, object]:
    """The three modes of ``hierarchy_workload`` on the same frames, one run; the targets as
    ratios."""
    policy = _policy(args)
    config = EngineConfig(
        num_steps=args.steps,
        seed=args.seed,
        prompt_format=args.prompt_format,
        subtask_conditioning="same_frame",
        subtask_period_s=args.subtask_period_s,
        subtask_max_tokens=args.subtask_tokens,
        **_fast_path(args),
    )
    modes, period = run_hierarchy(
        policy,
        _observations(args, policy),
        config,
        args.frames,
        args.warmup,
        args.period_ms * 1e-3 or None,
    )
    none, per_call, oxygen = modes["none"], modes["per_call"], modes["oxygen"]
    vs_none = oxygen["frames_per_s"] / none["frames_per_s"]
    vs_per_call = oxygen["frames_per_s"] / per_call["frames_per_s"]
    print(
        f"hierarchy: preset={args.preset} robot={args.robot} device={args.device} "
        f"format={args.prompt_format} "
        f"frames={args.frames} (interleaved frame by frame) threads={torch.get_num_threads()} "
        f"subtask_period={args.subtask_period_s:g} s oxygen tick period={period * 1e3:.1f} ms"
    )
    columns = [
        "frames_per_s",
        "p50_action_ms",
        "p99_action_ms",
        "wall_frames_per_s",
        "tokens_per_s",
        "staleness_p50_ms",
        "staleness_p99_ms",
        "subtasks",
        "conditioned_after_first",
        "mean_subtask_tokens",
        "static_fallbacks",
    ]
    _print_table(
        [{"metric": c, **{name: modes[name][c] for name in modes}} for c in columns],
        ["metric", *modes],
    )
    print(
        f"oxygen / none action rate {vs_none:.2f}x (target >= 0.95); oxygen / per_call "
        f"{vs_per_call:.1f}x (target >= 5 on tiny); chunks after the first subtask conditioned: "
        f"{oxygen['conditioned_after_first']:.0%}"
    )
    out = {
        "preset": args.preset,
        "robot": args.robot,
        "device": args.device,
        "workload": vars(args) | {"json": str(args.json)},
        "oxygen_period_ms": period * 1e3,
        "modes": modes,
        "oxygen_vs_none": vs_none,
        "oxygen_vs_per_call": vs_per_call,
    }
    _write_json(args.json, out)
    return out


COMMANDS = {
    "engines": bench_engines,
    "model": bench_model,
    "realtime": bench_realtime,
    "overload": bench_overload,
    "soak": bench_soak,
    "action": bench_action,
    "summary": bench_summary,
    "continuity": bench_continuity,
    "hierarchy": bench_hierarchy,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    COMMANDS[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
