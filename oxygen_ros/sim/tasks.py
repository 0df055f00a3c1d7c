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

And one kind made of two of them, done in order (:data:`TWO_STEP`, never drawn by
:func:`random_task` without a kind, so seeds drawn before it keep their tasks):

* ``put the {c1} cube on the {p1} pad, then touch the {c2} cube`` (c1 != c2);
* ``put the {c1} cube on the {p1} pad, then put the {c2} cube on the {p2} pad`` (c1 != c2,
  p1 != p2).

A two-step task's first step is a place (``cube``, ``pad``), its second (``then``) a touch or a
place; :attr:`Task.steps` gives both as ordinary tasks. The episode scores them in order
(:mod:`.episode`): the second counts only once the first has, and the first cube must stay on
its pad (:func:`cube_left_pad`).
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
TASK_KINDS = (TOUCH, PLACE)  # what random_task draws without a kind
TWO_STEP = "two_step"
ALL_TASK_KINDS = (*TASK_KINDS, TWO_STEP)

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
_TWO_STEP_RE = re.compile(r"(put the \w+ cube on the \w+ pad),? then (.+)")


class TaskError(ValueError):
    """A task text the sim does not know, or a layout it cannot make."""


@dataclass(frozen=True)
class Task:
    """One task: its kind, the cube it is about and, to place, the pad. A two-step task's
    ``cube`` and ``pad`` are its first step's (a place) and ``then`` is its second step."""

    kind: str
    cube: str
    pad: str = ""
    then: Task | None = None  # two-step only: the step after the first

    @property
    def text(self) -> str:
        if self.kind == TOUCH:
            return f"touch the {self.cube} cube"
        if self.kind == TWO_STEP and self.then is not None:
            return f"{self.steps[0].text}, then {self.then.text}"
        return f"put the {self.cube} cube on the {self.pad} pad"

    @property
    def steps(self) -> tuple[Task, ...]:
        """The ordinary tasks done one after the other: the task itself unless two-step."""
        if self.kind == TWO_STEP and self.then is not None:
            return (Task(PLACE, self.cube, self.pad), self.then)
        return (self,)


def two_step(first: Task, then: Task) -> Task:
    """The two-step task ``first`` (a place), then ``then`` (a touch or a place).

    Raises:
        TaskError: not one of the two forms, the same cube twice or the same pad twice.
    """
    if first.kind != PLACE or then.kind not in TASK_KINDS:
        raise TaskError(
            f"a two-step task is a place, then a touch or a place; got {first.kind} then "
            f"{then.kind}"
        )
    if then.cube == first.cube:
        raise TaskError(f"two-step task names the {first.cube} cube twice (two cubes needed)")
    if then.kind == PLACE and then.pad == first.pad:
        raise TaskError(f"two-step task names the {first.pad} pad twice (one cube per pad)")
    return Task(TWO_STEP, first.cube, first.pad, then)


def parse_task(text: str) -> Task:
    """The task a text names; TaskError for any other text."""
    normalised = " ".join(text.lower().strip().rstrip(".").split())
    match = _TWO_STEP_RE.fullmatch(normalised)
    if match:
        return two_step(_parse_one(match.group(1), text), _parse_one(match.group(2), text))
    return _parse_one(normalised, text)


def _parse_one(normalised: str, text: str) -> Task:
    """The touch or place task of a normalised text (``text``: the whole, for the error)."""
    match = _TOUCH_RE.fullmatch(normalised)
    if match:
        return _checked(Task(TOUCH, match.group(1)))
    match = _PLACE_RE.fullmatch(normalised)
    if match:
        return _checked(Task(PLACE, match.group(1), match.group(2)))
    raise TaskError(
        f"unknown task {text!r}: expected 'touch the <cube> cube', "
        f"'put the <cube> cube on the <pad> pad' or 'put the <cube> cube on the <pad> pad, then "
        f"<touch or put ...>' (cubes {', '.join(CUBE_COLORS)}; pads {', '.join(PAD_COLORS)})"
    )


def _checked(task: Task) -> Task:
    if task.cube not in CUBE_COLORS:
        raise TaskError(f"no {task.cube} cube in the scene (cubes: {', '.join(CUBE_COLORS)})")
    if task.kind == PLACE and task.pad not in PAD_COLORS:
        raise TaskError(f"no {task.pad} pad in the scene (pads: {', '.join(PAD_COLORS)})")
    return task


def random_task(rng: np.random.Generator, kind: str | None = None) -> Task:
    """A task drawn from ``rng``: of ``kind`` when given, else touch or place (never two-step,
    so that the seeds drawn before it existed keep their tasks)."""
    kind = kind or TASK_KINDS[int(rng.integers(len(TASK_KINDS)))]
    if kind not in ALL_TASK_KINDS:
        raise TaskError(f"unknown task kind {kind!r} (kinds: {', '.join(ALL_TASK_KINDS)})")
    if kind == TWO_STEP:
        return _random_two_step(rng)
    cube = CUBE_COLORS[int(rng.integers(len(CUBE_COLORS)))]
    if kind == TOUCH:
        return Task(TOUCH, cube)
    return Task(PLACE, cube, PAD_COLORS[int(rng.integers(len(PAD_COLORS)))])


def _random_two_step(rng: np.random.Generator) -> Task:
    """Either two-step form, equally likely, its cubes and pads drawn without repeats."""
    cubes = [CUBE_COLORS[int(i)] for i in rng.permutation(len(CUBE_COLORS))[:2]]
    pads = [PAD_COLORS[int(i)] for i in rng.permutation(len(PAD_COLORS))]
    first = Task(PLACE, cubes[0], pads[0])
    then = Task(TOUCH, cubes[1]) if rng.integers(2) == 0 else Task(PLACE, cubes[1], pads[1])
    return two_step(first, then)


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
    return cube_on_pad_top(cube_pos, pad_xy) and cube_speed < RESTING_SPEED


def cube_left_pad(cube_pos: np.ndarray, pad_xy: tuple[float, float]) -> bool:
    """Whether a cube placed on the pad has left it: its centre outside the pad's edges or off
    the resting height (lifted, tipped, fallen); moving on the pad is not leaving it."""
    return not cube_on_pad_top(cube_pos, pad_xy)


def cube_on_pad_top(cube_pos: np.ndarray, pad_xy: tuple[float, float]) -> bool:
    """Whether a cube's centre is within the pad's edges at the height of a cube lying on it."""
    inside = abs(cube_pos[0] - pad_xy[0]) <= PAD_HALF and abs(cube_pos[1] - pad_xy[1]) <= PAD_HALF
    resting_height = PAD_THICKNESS + CUBE_SIZE / 2
    return inside and abs(cube_pos[2] - resting_height) <= ON_PAD_HEIGHT_TOLERANCE


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
