"""``oxygen-bench model``: latency of the model's parts (prefill per camera count and batch, one
denoising step, one batched decode step)."""

from __future__ import annotations

import argparse

import torch

from oxygen_ros.engine.metrics import percentile
from oxygen_ros.model.config import IMAGE_SLOTS
from oxygen_ros.tools.benches import common
from oxygen_ros.tools.benches.workloads import time_ms

HELP = "prefill, denoise-step and decode-step latency"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``model`` subcommand's arguments."""
    common.common_args(parser, "small")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=5)


def run(args: argparse.Namespace) -> dict[str, object]:
    """Latency of the model's three operations: prefill (per camera count, then per batch size),
    one denoising step of the action expert, and one batched decode step, each at batch 1/4/16."""
    policy = common.make_policy(args)
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
        obs = common.make_observations(args, policy, cameras)[0]
        inputs = policy.encode(obs.images, obs.state, obs.prompt)
        record(f"prefill {cameras} cam", 1, lambda x=inputs: model.prefill(*batched(x, 1)))
    obs = common.make_observations(args, policy)[0]
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
    common.print_table(rows, ["part", "batch", "p50_ms", "p99_ms"])
    out = {"preset": args.preset, "robot": args.robot, "rows": rows}
    common.write_json(args.json, out)
    return out
