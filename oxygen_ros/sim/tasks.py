"""Tasks: their texts, seeded random layouts, and geometric success.

Two kinds, each decided by its text alone:

* ``touch the {color} cube``: a finger or the hand is in contact with the named cube (MuJoCo's
  contacts), the other two cubes present; the episode's first contact with any cube decides, so
  touching another cube first fails (:func:`touch_verdict`). The old rule, the gripper's tip (the
  site between the fingers) within :data:`TOUCH_DISTANCE` of the cube's centre
  (:func:`tip_touches`), is kept for comparison with earlier tables: it misses a hand resting on
  the cube's top (tip ~3.1-3.3 cm away) and passes a tip beside the cube that touches nothing;
* ``put the {color} cube on the {color} pad``: the cube rests on the pad (its centre above the
  pad within the pad's edges, its bottom on the pad's top, not moving) and the gripper has let go.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .scene import CUBE_COLORS, CUBE_SIZE, PAD_COLORS, PAD_HALF, PAD_THICKNESS

TOUCH = "touch"
PLACE = "place"
TASK_KINDS = (TOUCH, PLACE)

TOUCH_DISTANCE = 0.03  # old rule: tip to the cube's centre (the cube's half edge is 0.015)
RESTING_SPEED = 0.02  # m/s: a cube slower than this rests
ON_PAD_HEIGHT_TOLERANCE = 0.004

# where objects are placed: a sector in front of the arm, within comfortable reach
PLACE_RADIUS = (0.15, 0.27)
PLACE_ANGLE = (-0.85, 0.85)
MIN_CUBE_GAP = 0.065  # between cube centres
MIN_PAD_GAP = 0.10  # between pad centres
MIN_CUBE_PAD_GAP = 0.075  # cube centre to pad centre: no cube starts on a pad

_TOUCH_RE = re.compile(r"touch the (\w+) cube")
_PLACE_RE = re.compile(r"put the (\w+) cube on the (\w+) pad")


class TaskError(ValueError):
    """A task text the sim does not know, or a layout it cannot make."""


@dataclass(frozen=True)
class Task:
    """One task: its kind, the cube it is about and, to place, the pad."""

    kind: str
    cube: str
    pad: str = ""

    @property
    def text(self) -> str:
        if self.kind == TOUCH:
            return f"touch the {self.cube} cube"
        return f"put the {self.cube} cube on the {self.pad} pad"


def parse_task(text: str) -> Task:
    """The task a text names; TaskError for any other text."""
    normalised = " ".join(text.lower().strip().rstrip(".").split())
    match = _TOUCH_RE.fullmatch(normalised)
    if match:
        return _checked(Task(TOUCH, match.group(1)))
    match = _PLACE_RE.fullmatch(normalised)
    if match:
        return _checked(Task(PLACE, match.group(1), match.group(2)))
    raise TaskError(
        f"unknown task {text!r}: expected 'touch the <cube> cube' or "
        f"'put the <cube> cube on the <pad> pad' (cubes {', '.join(CUBE_COLORS)}; "
        f"pads {', '.join(PAD_COLORS)})"
    )


def _checked(task: Task) -> Task:
    if task.cube not in CUBE_COLORS:
        raise TaskError(f"no {task.cube} cube in the scene (cubes: {', '.join(CUBE_COLORS)})")
    if task.kind == PLACE and task.pad not in PAD_COLORS:
        raise TaskError(f"no {task.pad} pad in the scene (pads: {', '.join(PAD_COLORS)})")
    return task


def random_task(rng: np.random.Generator, kind: str | None = None) -> Task:
    """A task drawn from ``rng``: of ``kind`` when given, else either kind."""
    kind = kind or TASK_KINDS[int(rng.integers(len(TASK_KINDS)))]
    if kind not in TASK_KINDS:
        raise TaskError(f"unknown task kind {kind!r} (kinds: {', '.join(TASK_KINDS)})")
    cube = CUBE_COLORS[int(rng.integers(len(CUBE_COLORS)))]
    if kind == TOUCH:
        return Task(TOUCH, cube)
    return Task(PLACE, cube, PAD_COLORS[int(rng.integers(len(PAD_COLORS)))])


@dataclass(frozen=True)
class Layout:
    """Where an episode's objects start: cube centres (x, y) and yaws, pad centres (x, y)."""

    cubes: dict[str, tuple[float, float, float]]  # colour -> (x, y, yaw)
    pads: dict[str, tuple[float, float]]


def random_layout(rng: np.random.Generator, max_tries: int = 1000) -> Layout:
    """Pads and cubes at random within reach, none overlapping (rejection sampling)."""
    for _ in range(max_tries):
        pads = [_sample_point(rng) for _ in PAD_COLORS]
        cubes = [_sample_point(rng) for _ in CUBE_COLORS]
        if _far_apart(pads, pads, MIN_PAD_GAP) and _far_apart(cubes, cubes, MIN_CUBE_GAP):
            if all(_distance(c, p) >= MIN_CUBE_PAD_GAP for c in cubes for p in pads):
                return Layout(
                    cubes={
                        color: (x, y, float(rng.uniform(0, math.pi / 2)))
                        for color, (x, y) in zip(CUBE_COLORS, cubes, strict=True)
                    },
                    pads=dict(zip(PAD_COLORS, pads, strict=True)),
                )
    raise TaskError(f"no layout without overlaps in {max_tries} tries")


def _sample_point(rng: np.random.Generator) -> tuple[float, float]:
    radius = rng.uniform(*PLACE_RADIUS)
    angle = rng.uniform(*PLACE_ANGLE)
    return (float(radius * math.cos(angle)), float(radius * math.sin(angle)))


def _distance(a: tuple[float, float], b: tuple[float, float]) -> float:
    return math.hypot(a[0] - b[0], a[1] - b[1])


def _far_apart(a: list, b: list, gap: float) -> bool:
    return all(_distance(p, q) >= gap for i, p in enumerate(a) for q in b[i + 1 :])


# ----------------------------------------------------------------------------------------------
# Success, on the world's state
# ----------------------------------------------------------------------------------------------


def cube_on_pad(cube_pos: np.ndarray, cube_speed: float, pad_xy: tuple[float, float]) -> bool:
    """Whether a cube at ``cube_pos`` (its centre) moving at ``cube_speed`` rests on the pad."""
    inside = abs(cube_pos[0] - pad_xy[0]) <= PAD_HALF and abs(cube_pos[1] - pad_xy[1]) <= PAD_HALF
    resting_height = PAD_THICKNESS + CUBE_SIZE / 2
    on_top = abs(cube_pos[2] - resting_height) <= ON_PAD_HEIGHT_TOLERANCE
    return inside and on_top and cube_speed < RESTING_SPEED


def touch_verdict(cube: str, touched_first: Iterable[str]) -> bool | None:
    """The contact rule, given the cubes the gripper touched at its first contact with any:
    True when ``cube`` is among them (touching it together with another counts), False when
    only others are, None when it has touched none yet."""
    first = set(touched_first)
    if not first:
        return None
    return cube in first


def tip_touches(tip: np.ndarray, cube_pos: np.ndarray) -> bool:
    """The old touch rule, kept for comparison: whether the gripper's tip is within
    :data:`TOUCH_DISTANCE` of the cube's centre."""
    return float(np.linalg.norm(np.asarray(tip) - np.asarray(cube_pos))) <= TOUCH_DISTANCE
