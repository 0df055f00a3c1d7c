"""Where a place episode gets to, stage by stage, and what each close of the gripper did.

A place succeeds only through every stage (reach the cube, close on it, hold it, carry it over the
pad, let go), so a success rate alone does not say which stage fails. :class:`PlaceStages` watches
one episode from the sim's privileged state after every control step and records:

* the furthest of the sim's own phases (``reach``, ``grasp`` once the tip is at the cube,
  ``carry`` while held away from the pad, ``release`` while held over it, ``done``);
* every close: the moment the gripper is commanded closed (the sim's grasp rule,
  ``World.gripper_closing``), where the tip is then (its height above the cube's centre, its
  distance beside it, its speed), how far the fingers' closing axis is turned from the cube's
  faces (0: square on, pi/4: on its edges), and over the next :data:`CLOSE_WINDOW_S` the most
  fingers that touched the cube and whether it was held (the weld needs both fingers while
  closed). The scripted expert closes with the tip 2 mm above the centre, at rest, square on;
* while the cube is held over the pad: for how long, and how low its bottom came above the pad's
  top (the expert lowers it to rest there, 0 m, and holds over the pad ~1.5 s);
* every release of the held cube: whether it was over the pad then, its centre's distance from
  the pad's centre and its bottom's height above the pad's top;
* every chunk computed while the cube is held over the pad (the sim's ``release`` phase), given to
  :meth:`PlaceStages.plan`: where its last step would put the cube (forward kinematics of the
  planned arm, the cube kept at its offset from the tip) against where it is. The expert's plan
  from there ends over the pad's centre; a plan that carries the cube on past the pad's edge is
  an aim the actions lack, whatever the gripper does.

Over episodes (:func:`summarise`), ``ended_at`` puts each episode at the stage it got furthest
to: never at the cube, at it but never holding it, held but never over the pad, over the pad and
let go off it, never let go, let go over the pad but not placed, placed.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from oxygen_ros.sim.expert import off_faces_rad
from oxygen_ros.sim.scene import ARM_JOINTS, CUBE_SIZE, PAD_HALF, PAD_THICKNESS
from oxygen_ros.sim.tasks import Task

PHASES = ("reach", "grasp", "carry", "release", "done")
# where a place episode can end, stage by stage (`ended_at`)
ENDINGS = (
    "never at the cube",
    "never held",
    "never over the pad",
    "let go off the pad",
    "never let go",
    "let go over the pad, not placed",
    "placed",
)
# the ending of an episode whose furthest phase says it alone (a release's depends on its let-gos)
ENDING_OF_PHASE = {
    "reach": "never at the cube",
    "grasp": "never held",
    "carry": "never over the pad",
    "done": "placed",
}
CLOSE_WINDOW_S = 1.0  # a close's outcome: the fingers and the hold within this long after it


@dataclasses.dataclass
class Close:
    """One close of the gripper and what it did."""

    time_s: float
    tip_above_cube_m: float
    tip_beside_cube_m: float
    tip_speed_m_s: float
    off_faces_rad: float  # the closing axis turned from the cube's faces (`expert.off_faces_rad`)
    fingers_touching: int = 0  # the most fingers on the cube within the window
    held: bool = False  # the cube was held within the window

    def record(self) -> dict[str, Any]:
        return {
            "tip_above_cube_m": round(self.tip_above_cube_m, 4),
            "tip_beside_cube_m": round(self.tip_beside_cube_m, 4),
            "tip_speed_m_s": round(self.tip_speed_m_s, 4),
            "off_faces_rad": round(self.off_faces_rad, 4),
            "fingers_touching": self.fingers_touching,
            "held": self.held,
        }


@dataclasses.dataclass
class Release:
    """One release of the held cube."""

    over_pad: bool
    from_pad_centre_m: float  # the cube's centre from the pad's, on the table
    above_pad_m: float  # the cube's bottom above the pad's top

    def record(self) -> dict[str, Any]:
        return {
            "over_pad": self.over_pad,
            "from_pad_centre_m": round(self.from_pad_centre_m, 4),
            "above_pad_m": round(self.above_pad_m, 4),
        }


@dataclasses.dataclass
class ReleaseAim:
    """Where one chunk, computed while the cube is held over the pad, would take it."""

    from_centre_m: float  # the cube's centre from the pad's, on the table, now
    planned_from_centre_m: float  # ... at the chunk's last step
    planned_above_pad_m: float  # the cube's bottom above the pad's top at the chunk's last step
    planned_off_pad: bool  # the chunk's last step has the cube's centre past the pad's edge

    def record(self) -> dict[str, Any]:
        return {
            "from_centre_m": round(self.from_centre_m, 4),
            "planned_from_centre_m": round(self.planned_from_centre_m, 4),
            "planned_above_pad_m": round(self.planned_above_pad_m, 4),
            "planned_off_pad": self.planned_off_pad,
        }


class PlaceStages:
    """One place episode's stages; call :meth:`observe` after every control step."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.furthest = 0
        self.closes: list[Close] = []
        self.releases: list[Release] = []
        self.release_aims: list[ReleaseAim] = []
        self.held_over_pad_s = 0.0
        self.lowest_over_pad_m: float | None = None  # the cube's bottom above the pad's top
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
            turned = off_faces_rad(world.arm_positions(), world.cube_yaw(self.task.cube))
            self.closes.append(
                Close(sim.now_s, float(offset[2]), float(np.hypot(*offset[:2])), speed, turned)
            )
        above_pad = float(cube[2]) - CUBE_SIZE / 2 - PAD_THICKNESS
        if held and facts.cube_over_pad:
            self.held_over_pad_s += max(dt, 0.0)
            lowest = self.lowest_over_pad_m
            self.lowest_over_pad_m = above_pad if lowest is None else min(lowest, above_pad)
        if self._holding and not held:
            pad = np.asarray(world.pad_center(self.task.pad), dtype=float)
            from_centre = float(np.linalg.norm(cube[:2] - pad))
            self.releases.append(Release(facts.cube_over_pad, from_centre, above_pad))
        self._closing, self._holding = world.gripper_closing, held
        for close in self.closes:
            if sim.now_s - close.time_s <= CLOSE_WINDOW_S:
                close.fingers_touching = max(
                    close.fingers_touching, world.fingers_touching(self.task.cube)
                )
                close.held |= held

    def plan(self, sim, actions: np.ndarray) -> None:
        """Take in a chunk of joint targets computed now (``actions[step, joint]``, the arm's
        joints first): while the task's cube is held over the pad, where its last step takes it."""
        if sim.phase.key != "release" or sim.facts().grasped != self.task.cube:
            return
        world = sim.world
        # both tips by the same kinematics of the current state (`tip_position` is the last
        # physics step's, a tenth of a millimetre behind)
        tip, cube = world.tip_for(world.arm_positions()), world.cube_position(self.task.cube)
        planned = world.tip_for(actions[-1, : len(ARM_JOINTS)]) + (cube - tip)
        pad = np.asarray(world.pad_center(self.task.pad), dtype=float)
        self.release_aims.append(
            ReleaseAim(
                float(np.linalg.norm(cube[:2] - pad)),
                float(np.linalg.norm(planned[:2] - pad)),
                float(planned[2]) - CUBE_SIZE / 2 - PAD_THICKNESS,
                bool(np.max(np.abs(planned[:2] - pad)) > PAD_HALF),
            )
        )

    def record(self) -> dict[str, Any]:
        return {
            "furthest_phase": PHASES[self.furthest],
            "held": any(close.held for close in self.closes),
            "releases": len(self.releases),
            "releases_over_pad": sum(release.over_pad for release in self.releases),
            "held_over_pad_s": round(self.held_over_pad_s, 3),
            "lowest_over_pad_m": None
            if self.lowest_over_pad_m is None
            else round(self.lowest_over_pad_m, 4),
            "closes": [close.record() for close in self.closes],
            "release_events": [release.record() for release in self.releases],
            "release_aims": [aim.record() for aim in self.release_aims],
        }


def ended_at(episode: dict[str, Any]) -> str:
    """The stage one episode's :meth:`PlaceStages.record` got furthest to (`ENDINGS`)."""
    furthest = episode["furthest_phase"]
    if furthest != "release":
        return ENDING_OF_PHASE[furthest]
    if episode["releases_over_pad"]:
        return "let go over the pad, not placed"
    return "let go off the pad" if episode["releases"] else "never let go"


def summarise(stages: list[dict[str, Any]]) -> dict[str, Any]:
    """Over episodes' :meth:`PlaceStages.record`: how many reached at least each phase, how many
    held the cube, held it over the pad for a second and let go over the pad, how low the held
    cube came there, the closes' and releases' outcomes, where the episodes ended (`ENDINGS`) and
    where the chunks over the pad aimed (how much farther from the pad's centre they would take
    the cube, median; how many would take it off the pad)."""
    closes = [close for episode in stages for close in episode["closes"]]
    releases = [r for episode in stages for r in episode["release_events"]]
    aims = [aim for episode in stages for aim in episode["release_aims"]]
    endings = collections.Counter(ended_at(episode) for episode in stages)
    lowest = [e["lowest_over_pad_m"] for e in stages if e["lowest_over_pad_m"] is not None]

    def median(values: list[float]) -> float:
        return float(np.median(values)) if values else float("nan")

    return {
        "episodes": len(stages),
        "reached_phase": {
            phase: sum(PHASES.index(e["furthest_phase"]) >= index for e in stages)
            for index, phase in enumerate(PHASES)
        },
        "held_episodes": sum(e["held"] for e in stages),
        "held_over_pad_1s_episodes": sum(e["held_over_pad_s"] >= 1.0 for e in stages),
        "released_over_pad_episodes": sum(e["releases_over_pad"] > 0 for e in stages),
        "lowest_over_pad_m_p50": median(lowest),
        "closes": len(closes),
        "closes_both_fingers": sum(close["fingers_touching"] == 2 for close in closes),
        "closes_held": sum(close["held"] for close in closes),
        "close_tip_above_cube_m_p50": median([c["tip_above_cube_m"] for c in closes]),
        "close_tip_beside_cube_m_p50": median([c["tip_beside_cube_m"] for c in closes]),
        "close_tip_speed_m_s_p50": median([c["tip_speed_m_s"] for c in closes]),
        "close_off_faces_rad_p50": median([c["off_faces_rad"] for c in closes]),
        "releases": len(releases),
        "release_from_pad_centre_m_p50": median([r["from_pad_centre_m"] for r in releases]),
        "release_above_pad_m_p50": median([r["above_pad_m"] for r in releases]),
        "ended_at": {ending: endings[ending] for ending in ENDINGS},
        "release_plans": len(aims),
        "release_plan_outward_m_p50": median(
            [a["planned_from_centre_m"] - a["from_centre_m"] for a in aims]
        ),
        "release_plans_off_pad": sum(a["planned_off_pad"] for a in aims),
    }
