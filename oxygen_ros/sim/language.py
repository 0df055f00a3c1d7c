"""The current subtask and narration, made from the sim's state (the labels a policy learns from).

The phase of a task is read from what the scene shows, not from what anybody intends: a cube that
slips out of the gripper puts a place task back to "reach", whoever drives the arm. Phases:

* touch: ``reach`` (subtask "touch the red cube") until the tip touches the cube, then ``done``;
* place: ``reach`` the cube, ``grasp`` it once the tip is at it, ``carry`` it while it is held
  away from the pad, ``release`` it once it is held over the pad (or lies on it, not yet let go),
  ``done`` when the task succeeded.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tasks import PLACE, Task

NEAR_CUBE = 0.03  # the tip this close to the cube's centre is "at" the cube


@dataclass(frozen=True)
class SceneFacts:
    """What the language labels need to know about the scene (privileged state)."""

    success: bool
    grasped: str | None  # the colour of the grasped cube
    tip_to_cube: float  # metres from the tip to the task's cube
    cube_over_pad: bool  # the task's cube is within the pad's edges, at any height
    cube_on_pad: bool  # ... and rests on it


@dataclass(frozen=True)
class Phase:
    """A phase of a task, with the texts it is published as."""

    key: str
    subtask: str  # an imperative: "grasp the red cube"
    narration: str  # a sentence about what is happening: "grasping the red cube"


def current_phase(task: Task, facts: SceneFacts) -> Phase:
    """The phase ``task`` is in, given ``facts``."""
    cube = f"the {task.cube} cube"
    if task.kind != PLACE:
        if facts.success:
            return Phase("done", f"touch {cube}", f"the gripper is touching {cube}")
        return Phase("reach", f"touch {cube}", f"reaching for {cube}")
    pad = f"the {task.pad} pad"
    if facts.success:
        return Phase("done", "done", f"{cube} is on {pad}")
    held = facts.grasped == task.cube
    if (held and facts.cube_over_pad) or (not held and facts.cube_on_pad):
        return Phase("release", f"release {cube}", f"releasing {cube} on {pad}")
    if held:
        return Phase("carry", f"carry {cube} to {pad}", f"carrying {cube} to {pad}")
    if facts.tip_to_cube <= NEAR_CUBE:
        return Phase("grasp", f"grasp {cube}", f"grasping {cube}")
    return Phase("reach", f"reach {cube}", f"reaching for {cube}")
