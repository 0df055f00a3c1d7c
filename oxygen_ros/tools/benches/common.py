"""What every bench shares: the model and run arguments, the random-weight policy wrapped in
``--robot``'s transforms, synthetic frames, the engine settings of the GPU fast path, the printed
table and the ``--json`` file."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from oxygen_ros.engine import EngineConfig
from oxygen_ros.policy_io.robots import ROBOTS, robot_adapter
from oxygen_ros.tools.benches.workloads import synthetic_observations
from oxygen_ros.tools.make_checkpoint import random_policy


def common_args(parser: argparse.ArgumentParser, preset: str) -> None:
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
        help="robot transforms around the model (policy_io/robots.py; default generic: none)",
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


def workload_args(parser: argparse.ArgumentParser, frames: int) -> None:
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


def print_table(rows: list[dict[str, object]], columns: list[str]) -> None:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"
        return str(v)

    table = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c), *(len(t[i]) for t in table)]) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=False)))
    for t in table:
        print("  ".join(v.rjust(w) for v, w in zip(t, widths, strict=False)))


def make_policy(args: argparse.Namespace):
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


def make_observations(args: argparse.Namespace, policy, cameras: int | None = None):
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
    return synthetic_observations(cameras, state_dim=robot_state_dim(policy))


def robot_state_dim(policy) -> int:
    return policy.robot.state_dim or 7


def fast_path(args: argparse.Namespace) -> dict[str, bool]:
    """The EngineConfig switches of the GPU fast path given on the command line."""
    return {
        "static_shapes": args.static_shapes,
        "cuda_graphs": args.cuda_graphs,
        "gpu_preprocess": args.gpu_preprocess,
    }


def path_name(config: EngineConfig) -> str:
    return "cuda-graphs" if config.cuda_graphs else "static" if config.static_shapes else "dynamic"


def write_json(path: Path | None, data: dict[str, object]) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str))
        print(f"wrote {path}")


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    return EngineConfig(
        num_steps=args.steps,
        seed=args.seed,
        decode_steps_per_frame=args.decode_steps,
        default_max_tokens=args.tokens,
        **fast_path(args),
        **overrides,
    )
