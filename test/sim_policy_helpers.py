"""What the ``oxygen-bench sim-policy`` tests share: the shipped checkpoint, held-out layouts, the
bench's own argument parser, and a headless simulation."""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco's first import, as oxygen_ros.sim does

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

from oxygen_ros.policy_io.prompts import resolve_format  # noqa: E402
from oxygen_ros.tools.benches import sim_policy  # noqa: E402

CHECKPOINT = Path(__file__).resolve().parents[1] / "models" / "sim_so101"
HELDOUT_SEED = 4242  # closed-loop round seed whose layouts no shipped demonstration used
FORMAT = resolve_format("openpi_subtask")


def bench_args(*argv: str) -> argparse.Namespace:
    """``oxygen-bench sim-policy`` arguments for the shipped checkpoint."""
    parser = argparse.ArgumentParser()
    sim_policy.add_arguments(parser)
    return parser.parse_args(["--checkpoint", str(CHECKPOINT), *argv])


def touch_simulation():
    """A headless simulation with touch's 8 s episodes (close its world when done)."""
    from oxygen_ros.sim.episode import Simulation

    return Simulation(episode_timeout_s=8.0)
