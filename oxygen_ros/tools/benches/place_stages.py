"""Where a place episode gets to, stage by stage, and what each close of the gripper did.

A place succeeds only through every stage (reach the cube, close on it, hold it, carry it over the
pad, let go), so a success rate alone does not say which stage fails. :class:`PlaceStages` watches
one episode from the sim's privileged state after every control step and records:

* the furthest of the sim's own phases (``reach``, ``grasp`` once the tip is at the cube,
  ``carry`` while held away from the pad, ``release`` while held over it, ``done``);
* every close: the moment the gripper is commanded closed (the sim's grasp rule,
  ``World.gripper_closing``), where the tip is then (its height above the cube's centre, its
  distance beside it, its speed), and over the next :data:`CLOSE_WINDOW_S` the most fingers that
  touched the cube and whether it was held (the weld needs both fingers while closed). The
  scripted expert closes with the tip 2 mm above the centre, at rest;
* every release of the held cube: whether it was over the pad then.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from oxygen_ros.sim.tasks import Task

PHASES = ("reach", "grasp", "carry", "release", "done")
CLOSE_WINDOW_S = 1.0  # a close's outcome: the fingers and the hold within this long after it


@dataclasses.dataclass
class Close:
    """One close of the gripper and what it did."""

    time_s: float
    tip_above_cube_m: float
    tip_beside_cube_m: float
    tip_speed_m_s: float
    fingers_touching: int = 0  # the most fingers on the cube within the window
    held: bool = False  # the cube was held within the window

    def record(self) -> dict[str, Any]:
        return {
            "tip_above_cube_m": round(self.tip_above_cube_m, 4),
            "tip_beside_cube_m": round(self.tip_beside_cube_m, 4),
            "tip_speed_m_s": round(self.tip_speed_m_s, 4),
            "fingers_touching": self.fingers_touching,
            "held": self.held,
        }


class PlaceStages:
    """One place episode's stages; call :meth:`observe` after every control step."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.furthest = 0
        self.closes: list[Close] = []
        self.releases = self.releases_over_pad = 0
        self._closing = self._holding = False
        self._tip: np.ndarray | None = None
        self._time_s = 0.0

    def observe(self, sim) -> None:
        """Take in the state ``sim`` is in after a control step."""
        world, facts = sim.world, sim.facts()
        self.furthest = max(self.furthest, PHASES.index(sim.phase.key))
        tip, cube = world.tip_position(), world.cube_position(self.task.cube)
        dt = sim.now_s - self._time_s
        speed = 0.0 if self._tip is None or dt <= 0 else float(np.linalg.norm(tip - self._tip)) / dt
        self._tip, self._time_s = tip, sim.now_s
        held = facts.grasped == self.task.cube
        if world.gripper_closing and not self._closing:
            offset = tip - cube
            self.closes.append(
                Close(sim.now_s, float(offset[2]), float(np.hypot(*offset[:2])), speed)
            )
        if self._holding and not held:
            self.releases += 1
            self.releases_over_pad += facts.cube_over_pad
        self._closing, self._holding = world.gripper_closing, held
        for close in self.closes:
            if sim.now_s - close.time_s <= CLOSE_WINDOW_S:
                close.fingers_touching = max(
                    close.fingers_touching, world.fingers_touching(self.task.cube)
                )
                close.held |= held

    def record(self) -> dict[str, Any]:
        return {
            "furthest_phase": PHASES[self.furthest],
            "held": any(close.held for close in self.closes),
            "releases": self.releases,
            "releases_over_pad": self.releases_over_pad,
            "closes": [close.record() for close in self.closes],
        }


def summarise(stages: list[dict[str, Any]]) -> dict[str, Any]:
    """Over episodes' :meth:`PlaceStages.record`: how many reached at least each phase, how many
    held the cube and let go over the pad, and the closes' outcomes and tip at the close."""
    closes = [close for episode in stages for close in episode["closes"]]

    def median(key: str) -> float:
        return float(np.median([close[key] for close in closes])) if closes else float("nan")

    return {
        "episodes": len(stages),
        "reached_phase": {
            phase: sum(PHASES.index(e["furthest_phase"]) >= index for e in stages)
            for index, phase in enumerate(PHASES)
        },
        "held_episodes": sum(e["held"] for e in stages),
        "released_over_pad_episodes": sum(e["releases_over_pad"] > 0 for e in stages),
        "closes": len(closes),
        "closes_both_fingers": sum(close["fingers_touching"] == 2 for close in closes),
        "closes_held": sum(close["held"] for close in closes),
        "close_tip_above_cube_m_p50": median("tip_above_cube_m"),
        "close_tip_beside_cube_m_p50": median("tip_beside_cube_m"),
        "close_tip_speed_m_s_p50": median("tip_speed_m_s"),
    }
