"""Grounding scenes rendered from the sim: images whose labels come from the sim's state.

Each seeded layout is seen at the start pose, then at moments along an episode on it, both cameras
rendered at each, with what the sim knows there: a :class:`~.questions.GroundingScenes` row, which
:mod:`.questions` turns into questions and answers (the sim's own subtask among them). The episode
that moves the arm is one of the :data:`VIEWS`, drawn per layout:

* :data:`ALONG`: the scripted expert doing the layout's task (the arm reaching, a cube carried);
* :data:`DART`: the same with the expert's plans drifting (:class:`~.expert.ArmPerturbation`), the
  poses a policy that is slightly off reaches;
* :data:`OFF_COURSE`: the expert heading for another cube than the task's, as a policy that went
  for the wrong one; the labels (the subtask above all) stay the task's.

Seeds are kept apart: :data:`TRAIN_SEED0` for training scenes, :data:`HELDOUT_SEED0` for the probe,
neither overlapping the demonstrations' or the benches' (``closed-loop`` and ``sim-policy`` draw
layouts ``seed * 1000 + i`` with seed 777 by default). Rendering runs in ``workers`` processes,
each with its own simulator, over disjoint seed ranges: the result does not depend on their count.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import numpy as np

from .episode import Simulation
from .headless import drive_expert
from .questions import NO_CUBE, START, GroundingScenes
from .scene import CUBE_COLORS, PAD_COLORS
from .tasks import PLACE, TOUCH, Task, random_task

TRAIN_SEED0 = 3_000_000
HELDOUT_SEED0 = 9_000_000
SEED_BLOCK = 1_000_000  # each seed range's size: scenes of one range never reach the next
CAMERA_PX = 128
ALONG, DART, OFF_COURSE = "along", "dart", "off_course"
VIEWS = (ALONG, DART, OFF_COURSE)
DART_RAD = 0.05  # the drift of DART views: larger than the demonstrations' 0.03, to spread poses
# control steps (at 100 Hz) over which the moments are drawn: most of an expert episode of the
# kind (touch 1.3-2.4 s, place 4-6 s); an off-course touch ends sooner, at the other cube
MOMENT_SPAN = {TOUCH: 170, PLACE: 500}
OFF_COURSE_TOUCH_SPAN = 110


def render_scenes(
    seed0: int,
    layouts: int,
    poses_per_layout: int = 3,
    views: tuple[str, ...] = (ALONG,),
    camera_px: int = CAMERA_PX,
    workers: int = 1,
) -> GroundingScenes:
    """``layouts`` layouts from seeds ``seed0 ...``, each seen at the start pose and at
    ``poses_per_layout - 1`` moments along an episode of a view drawn from ``views`` (and a task
    drawn from the seed), rendered in ``workers`` processes.

    Raises:
        ValueError: a seed range that crosses into another range's block, an unknown view or a
            worker count below 1.
    """
    if (seed0 + layouts - 1) // SEED_BLOCK != seed0 // SEED_BLOCK:
        raise ValueError(f"seeds {seed0}..{seed0 + layouts - 1} cross a {SEED_BLOCK} block")
    unknown = sorted(set(views) - set(VIEWS))
    if unknown or not views:
        raise ValueError(f"views must be some of {VIEWS}, got {list(views)}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    bounds = np.linspace(seed0, seed0 + layouts, min(workers, layouts) + 1).astype(int)
    ranges = [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    jobs = [(a, b, poses_per_layout, tuple(views), camera_px) for a, b in ranges]
    if len(jobs) == 1:
        return _render_range(*jobs[0])
    with ProcessPoolExecutor(len(jobs), mp_context=get_context("spawn")) as pool:
        parts = list(pool.map(_render_range, *zip(*jobs, strict=True)))
    return GroundingScenes.concatenate(parts)


def _render_range(
    first: int, stop: int, poses: int, views: tuple[str, ...], camera_px: int
) -> GroundingScenes:
    sim = Simulation(episode_timeout_s=12.0)
    rows: list[dict] = []
    try:
        for seed in range(first, stop):
            rows += _layout_rows(sim, seed, poses, views, camera_px)
    finally:
        sim.world.close()
    arrays = ("scene", "wrist", "state", "cubes", "pads", "tip", "grasped", "seeds")
    return GroundingScenes(
        **{key: np.stack([r[key] for r in rows]) for key in arrays},
        tasks=[r["task"] for r in rows],
        subtasks=[r["subtask"] for r in rows],
        views=[r["view"] for r in rows],
    )


def _layout_rows(
    sim: Simulation, seed: int, poses: int, views: tuple[str, ...], camera_px: int
) -> list[dict]:
    rng = np.random.default_rng([seed, 11])
    task = random_task(rng)
    sim.reset(task, seed)
    rows = [_snapshot(sim, seed, START, camera_px)]
    if poses == 1:
        return rows
    view = views[int(rng.integers(len(views)))]
    span = MOMENT_SPAN[task.kind]
    if view == OFF_COURSE and task.kind == TOUCH:
        span = OFF_COURSE_TOUCH_SPAN
    # control steps at which to look past the start (fewer if the episode ends first)
    moments = sorted(set(int(m) for m in rng.integers(10, span, size=poses - 1)))
    drift = DART_RAD if view == DART else 0.0
    expert_task = _decoy(task, rng) if view == OFF_COURSE else None
    moving = drive_expert(
        sim, perturbation_rad=drift, expert_task=expert_task, perturbation_seed=seed
    )
    for step, _ in moving:
        if step == moments[0]:
            rows.append(_snapshot(sim, seed, view, camera_px))
            moments.pop(0)
            if not moments:
                break
    return rows


def _decoy(task: Task, rng: np.random.Generator) -> Task:
    """The task with another cube, drawn from ``rng``: what an off-course reach goes for."""
    others = [c for c in CUBE_COLORS if c != task.cube]
    return dataclasses.replace(task, cube=others[int(rng.integers(len(others)))])


def _snapshot(sim: Simulation, seed: int, view: str, camera_px: int) -> dict:
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
        "subtask": sim.phase.subtask if sim.phase else "",
        "view": view,
    }
