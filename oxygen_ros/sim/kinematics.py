"""Analytic inverse kinematics of the simulated arm, for a gripper pointing straight down.

The pan joint turns a vertical plane; in it, ``shoulder_lift``, ``elbow_flex`` and ``wrist_flex``
form a planar chain whose links point up at zero and tilt forward with positive angles (see
:mod:`.scene`). With the last link pointing down, the wrist_flex axis sits ``WRIST_TO_TIP`` above
the tip, a two-link problem for the shoulder and elbow (elbow up), and ``wrist_flex`` makes the
three pitch angles sum to pi. ``wrist_roll`` then turns the fingers' closing axis to a wanted yaw.
"""

from __future__ import annotations

import math

import numpy as np

from .scene import FOREARM, JOINT_RANGES, SHOULDER_HEIGHT, UPPER_ARM, WRIST_TO_TIP

ARM_JOINT_LOWER = np.array([JOINT_RANGES[n][0] for n in JOINT_RANGES])
ARM_JOINT_UPPER = np.array([JOINT_RANGES[n][1] for n in JOINT_RANGES])
MAX_REACH = UPPER_ARM + FOREARM - 1e-4


class Unreachable(ValueError):
    """A tip position the arm cannot reach pointing down."""


def wrap_to_quarter_turn(angle: float) -> float:
    """``angle`` plus a multiple of pi/2, within [-pi/4, pi/4] (a cube looks the same)."""
    return (angle + math.pi / 4) % (math.pi / 2) - math.pi / 4


def tip_down_ik(tip: np.ndarray, finger_yaw: float, roll_hint: float = 0.0) -> np.ndarray:
    """The five arm joint angles that put the tip site at ``tip`` (world x, y, z; the arm's base
    at the origin) with the gripper pointing straight down and its fingers closing along the
    horizontal direction ``finger_yaw`` (radians, modulo pi/2: a cube looks the same, so the roll
    nearest ``roll_hint`` is chosen, which keeps the hand from flipping as the pan turns).

    Raises:
        Unreachable: ``tip`` is out of the arm's reach or needs a joint beyond its range.
    """
    x, y, z = (float(v) for v in tip)
    pan = math.atan2(y, x)
    radius = math.hypot(x, y)
    # the wrist_flex axis, relative to the shoulder axis, in the arm's plane
    dr, dz = radius, z + WRIST_TO_TIP - SHOULDER_HEIGHT
    distance = math.hypot(dr, dz)
    if distance > MAX_REACH or distance < abs(UPPER_ARM - FOREARM) + 1e-3:
        raise Unreachable(f"tip {tip} is {distance:.3f} m from the shoulder (reach {MAX_REACH})")
    cos_elbow = (distance**2 - UPPER_ARM**2 - FOREARM**2) / (2 * UPPER_ARM * FOREARM)
    elbow = math.acos(max(-1.0, min(1.0, cos_elbow)))
    # links are measured from the vertical, positive towards the target
    shoulder = math.atan2(dr, dz) - math.atan2(
        FOREARM * math.sin(elbow), UPPER_ARM + FOREARM * math.cos(elbow)
    )
    wrist = math.pi - shoulder - elbow
    # with the hand pointing down, rolling by +r turns the fingers' axis by -r about world up;
    # at zero roll that axis is the pan plane's normal (pan + pi/2)
    roll = roll_hint + wrap_to_quarter_turn(pan + math.pi / 2 - finger_yaw - roll_hint)
    joints = np.array([pan, shoulder, elbow, wrist, roll])
    outside = (joints < ARM_JOINT_LOWER) | (joints > ARM_JOINT_UPPER)
    if outside.any():
        raise Unreachable(f"tip {tip} needs joints {joints.round(3)} beyond their ranges")
    return joints
