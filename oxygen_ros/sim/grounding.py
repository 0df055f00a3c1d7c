"""Grounding scenes rendered from the sim: images whose labels come from the sim's state.

Each seeded layout is seen at the start pose, then at moments along a scripted-expert episode on
it (the arm reaching, a cube carried or set on a pad), both cameras rendered at each, with what the
sim knows there: a :class:`~.questions.GroundingScenes` row, which :mod:`.questions` turns into
questions and answers.

Seeds are kept apart: :data:`TRAIN_SEED0` for training scenes, :data:`HELDOUT_SEED0` for the probe,
neither overlapping the demonstrations' or the benches' (``closed-loop`` and ``sim-policy`` draw
layouts ``seed * 1000 + i`` with seed 777 by default).
"""

from __future__ import annotations

import numpy as np

from .episode import Simulation
from .headless import drive_expert
from .questions import NO_CUBE, GroundingScenes
from .scene import CUBE_COLORS, PAD_COLORS
from .tasks import random_task

TRAIN_SEED0 = 3_000_000
HELDOUT_SEED0 = 9_000_000
SEED_BLOCK = 1_000_000  # each seed range's size: scenes of one range never reach the next
CAMERA_PX = 128


def render_scenes(
    seed0: int,
    layouts: int,
    poses_per_layout: int = 3,
    sim: Simulation | None = None,
    camera_px: int = CAMERA_PX,
) -> GroundingScenes:
    """``layouts`` layouts from seeds ``seed0 ...``, each seen at the start pose and at
    ``poses_per_layout - 1`` moments drawn along an expert episode of a task drawn from the seed.

    Raises:
        ValueError: a seed range that crosses into another range's block.
    """
    if (seed0 + layouts - 1) // SEED_BLOCK != seed0 // SEED_BLOCK:
        raise ValueError(f"seeds {seed0}..{seed0 + layouts - 1} cross a {SEED_BLOCK} block")
    own_sim = sim is None
    sim = sim or Simulation(episode_timeout_s=12.0)
    rows: list[dict] = []
    try:
        for seed in range(seed0, seed0 + layouts):
            rows += _layout_rows(sim, seed, poses_per_layout, camera_px)
    finally:
        if own_sim:
            sim.world.close()
    return GroundingScenes(
        **{
            key: np.stack([r[key] for r in rows])
            for key in ("scene", "wrist", "state", "cubes", "pads", "tip", "grasped", "seeds")
        },
        tasks=[r["task"] for r in rows],
    )


def _layout_rows(sim: Simulation, seed: int, poses: int, camera_px: int) -> list[dict]:
    rng = np.random.default_rng([seed, 11])
    task = random_task(rng)
    sim.reset(task, seed)
    # control steps at which to look: the start, then moments of a typical episode's length
    moments = sorted(set(int(m) for m in rng.integers(10, 400, size=poses - 1)))
    rows = [_snapshot(sim, seed, camera_px)]
    for step, _ in drive_expert(sim):
        if not moments:
            break
        if step == moments[0]:
            rows.append(_snapshot(sim, seed, camera_px))
            moments.pop(0)
    return rows


def _snapshot(sim: Simulation, seed: int, camera_px: int) -> dict:
    world = sim.world
    grasped = NO_CUBE if world.grasped is None else CUBE_COLORS.index(world.grasped)
    return {
        "scene": world.render("scene", camera_px, camera_px),
        "wrist": world.render("wrist", camera_px, camera_px),
        "state": np.append(world.arm_positions(), world.gripper_opening()).astype(np.float32),
        "cubes": np.array([world.cube_position(c) for c in CUBE_COLORS], dtype=np.float32),
        "pads": np.array([world.pad_center(c) for c in PAD_COLORS], dtype=np.float32),
        "tip": world.tip_position().astype(np.float32),
        "grasped": np.int64(grasped),
        "seeds": np.int64(seed),
        "task": sim.task.text if sim.task else "",
    }
