"""The current subtask and narration, made from the sim's state (the labels a policy learns from).

The phase of a task is read from what the scene shows, not from what anybody intends: a cube that
slips out of the gripper puts a place task back to "reach", whoever drives the arm. Phases:

* touch: ``reach`` (subtask "touch the red cube") until a finger or the hand touches the cube
  (the task's contact rule), then ``done``;
* place: ``reach`` the cube, ``grasp`` it once the tip is at it, ``carry`` it while it is held
  away from the pad, ``release`` it once it is held over the pad (or lies on it, not yet let go),
  ``done`` when the task succeeded;
* two-step: the phases of its current step (``SceneFacts.step``), so the first step's place
  phases (reach .. release) run into the second step's (its reach: "touch the blue cube, near
  left") and end in the second step's ``done``.

A phase entered at a distance is left only a margin past it (hysteresis): ``grasp`` begins with
the tip within 3 cm of the cube and lasts until it is 4.5 cm away, ``release`` begins when the held
cube's centre crosses the pad's edge and lasts until it is 1 cm back outside. A tip or a cube
dithering on an edge is not a scene that changed, and a subtask flickering with it would flip the
action prompt's condition frame by frame. A labeller that knows no earlier phase (``previous``
None) reads the entering rules alone.

While reaching, the subtask and the narration also say where the cube is, as the robot sees it
("touch the red cube, far left", "reaching for the red cube, far left"): words a policy can only
learn to say by finding the named cube in its camera images, which is what it must find to reach
it, and a subtask that, read back as the action prompt's condition, tells the actions where to go.
While carrying, they say where the pad is the same way ("carry the red cube to the green pad, near
right"): the carry's destination, found in the images as the cube was.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .tasks import PLACE, PLACE_ANGLE, PLACE_RADIUS, TWO_STEP, Task

NEAR_CUBE = 0.03  # the tip this close to the cube's centre is "at" the cube
LEAVE_CUBE = 0.045  # ... and grasping lasts until the tip is this far from it
LEAVE_PAD = 0.01  # releasing lasts until the held cube's centre is this far outside the pad
SIDE_ANGLE = PLACE_ANGLE[1] / 3  # rad from straight ahead: the outer thirds are left and right
FAR_RADIUS = sum(PLACE_RADIUS) / 2  # m from the base: the outer half of the reach is far
PLACES = tuple(f"{d} {s}" for d in ("near", "far") for s in ("left", "centre", "right"))


def place_words(x: float, y: float) -> str:
    """Where a point on the table is, seen from the robot's base: one of :data:`PLACES`."""
    angle = math.atan2(y, x)  # +y is the robot's left
    side = "left" if angle > SIDE_ANGLE else "right" if angle < -SIDE_ANGLE else "centre"
    depth = "far" if math.hypot(x, y) >= FAR_RADIUS else "near"
    return f"{depth} {side}"


_PLACE_SUFFIX = re.compile(r", (near|far) (left|centre|right)$")


def without_place(text: str) -> str:
    """``text`` without the place words a reaching phase appends ("..., far left")."""
    return _PLACE_SUFFIX.sub("", text)


@dataclass(frozen=True)
class SceneFacts:
    """What the language labels need to know about the scene (privileged state)."""

    success: bool
    grasped: str | None  # the colour of the grasped cube
    tip_to_cube: float  # metres from the tip to the task's cube
    # metres from the task's cube's centre out past the pad's nearest edge, at any height
    # (<= 0: over the pad; inf: no pad, or far)
    cube_outside_pad: float
    cube_on_pad: bool  # the task's cube rests on the pad
    cube_place: str = ""  # where the task's cube is (`place_words`); "" leaves it unsaid
    step: int = 0  # a two-step task's current step (0 or 1), which the other facts are about
    pad_place: str = ""  # where the task's pad is (`place_words`); "" leaves it unsaid

    @property
    def cube_over_pad(self) -> bool:
        """The task's cube is within the pad's edges, at any height."""
        return self.cube_outside_pad <= 0.0


@dataclass(frozen=True)
class Phase:
    """A phase of a task, with the texts it is published as."""

    key: str
    subtask: str  # an imperative: "grasp the red cube"
    narration: str  # a sentence about what is happening: "grasping the red cube"


def current_phase(task: Task, facts: SceneFacts, previous: str | None = None) -> Phase:
    """The phase ``task`` is in, given ``facts`` (a two-step task: its current step's) and the key
    of the phase the step was in just before (``previous``; None: the entering rules alone)."""
    if task.kind == TWO_STEP:
        return current_phase(task.steps[facts.step], facts, previous)
    cube = f"the {task.cube} cube"
    where = f", {facts.cube_place}" if facts.cube_place else ""
    reaching = f"reaching for {cube}{where}"
    if task.kind != PLACE:
        if facts.success:
            return Phase("done", f"touch {cube}", f"the gripper is touching {cube}")
        return Phase("reach", f"touch {cube}{where}", reaching)
    pad = f"the {task.pad} pad"
    if facts.success:
        return Phase("done", "done", f"{cube} is on {pad}")
    held = facts.grasped == task.cube
    over_pad = facts.cube_over_pad or (
        previous == "release" and facts.cube_outside_pad <= LEAVE_PAD
    )
    if (held and over_pad) or (not held and facts.cube_on_pad):
        return Phase("release", f"release {cube}", f"releasing {cube} on {pad}")
    if held:
        to_pad = f"{pad}, {facts.pad_place}" if facts.pad_place else pad
        return Phase("carry", f"carry {cube} to {to_pad}", f"carrying {cube} to {to_pad}")
    near = LEAVE_CUBE if previous == "grasp" else NEAR_CUBE
    if facts.tip_to_cube <= near:
        return Phase("grasp", f"grasp {cube}", f"grasping {cube}")
    return Phase("reach", f"reach {cube}{where}", reaching)


def every_phase(task: Task) -> list[Phase]:
    """Every phase :func:`current_phase` can give for ``task``, with the cube at every place and
    unplaced (a tokenizer's corpus must hold all their words); a two-step task's are those of
    both its steps."""
    if task.kind == TWO_STEP:
        return list(dict.fromkeys(phase for step in task.steps for phase in every_phase(step)))
    phases: dict[Phase, None] = {}
    for place in ("", *PLACES):
        for facts in (
            SceneFacts(False, None, math.inf, math.inf, False, place),  # reach
            SceneFacts(False, None, 0.0, math.inf, False, place),  # grasp
            SceneFacts(False, task.cube, 0.0, math.inf, False, place, pad_place=place),  # carry
            SceneFacts(False, task.cube, 0.0, 0.0, False, place),  # release
            SceneFacts(True, None, 0.0, 0.0, True, place),  # done
        ):
            phases[current_phase(task, facts)] = None
    return list(phases)
