"""The simulated scene as MJCF, written from primitives (no downloaded assets).

An SO-101-like arm on a table: five revolute joints (``shoulder_pan`` about the vertical, then
``shoulder_lift``, ``elbow_flex`` and ``wrist_flex`` about parallel horizontal axes, then
``wrist_roll`` about the last link) and a parallel gripper of two sliding fingers. All three
pitch links point straight up at zero, so the arm is a planar 3-link chain turned by the pan joint
(see :mod:`.kinematics`). Each joint is a PD servo in physics (a ``general`` actuator: force
``kp * (ctrl - q) - kv * qdot``); the arm's links are gravity-compensated (``gravcomp``), as a
stiff hobby servo holds its pose. Three 3 cm cubes (red, green, blue) have free joints; two flat
pads (green, blue) are static geoms moved per episode. A fixed ``scene`` camera looks at the
workspace, a ``wrist`` camera rides on the hand.

Only the arm's links do not collide (with anything); the fingers, cubes, pads and table do. The
hand's box collides with the cubes alone (explicit contact pairs), so a hand laid on a cube rests
on it and a touch by the hand is a contact like a finger's.
"""

from __future__ import annotations

import numpy as np

ARM_JOINTS = ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll")
GRIPPER_JOINT = "gripper"
JOINT_NAMES = (*ARM_JOINTS, GRIPPER_JOINT)
FINGER_JOINTS = ("finger_left", "finger_right")

CUBE_COLORS = ("red", "green", "blue")
PAD_COLORS = ("green", "blue")
RGBA = {
    "red": "0.85 0.15 0.12 1",
    "green": "0.15 0.7 0.2 1",
    "blue": "0.15 0.3 0.85 1",
}
PAD_RGBA = {"green": "0.45 0.85 0.45 1", "blue": "0.45 0.6 0.95 1"}

# arm geometry (metres): the shoulder axis height, the links between the pitch axes, and the
# distance from the wrist_flex axis to the tip site between the fingers
SHOULDER_HEIGHT = 0.09
UPPER_ARM = 0.16
FOREARM = 0.16
WRIST_TO_TIP = 0.09
PAN_HEIGHT = 0.06

CUBE_SIZE = 0.03  # edge
PAD_HALF = 0.035  # half edge of a square pad
PAD_THICKNESS = 0.004
FINGER_TRAVEL = 0.022  # each finger slides this far from open to closed
FINGER_OFFSET = 0.03  # finger centre from the hand's axis when open
FINGER_HALF_THICKNESS = 0.004
FINGER_LENGTH = 0.05  # each finger's box, from its base on the hand's face to its end
FINGER_BASE = 0.02  # the fingers' bodies, this far along the hand's axis from the hand body
OPEN_GAP = 2 * (FINGER_OFFSET - FINGER_HALF_THICKNESS)  # 0.052 m between the fingers
HAND_TO_TIP = WRIST_TO_TIP - 0.03  # the tip site on the hand's axis (the hand body 3 cm past wrist)
FINGER_BEYOND_TIP = FINGER_BASE + FINGER_LENGTH - HAND_TO_TIP  # 0.01 m: fingers end past the tip
GRIPPER_BODIES = ("hand", *FINGER_JOINTS)  # the bodies whose contacts are the gripper's touches

JOINT_RANGES = {
    "shoulder_pan": (-1.9, 1.9),
    "shoulder_lift": (-1.5, 1.8),
    "elbow_flex": (-0.3, 2.8),
    "wrist_flex": (-1.8, 2.2),
    "wrist_roll": (-2.8, 2.8),
}
HOME = (0.0, -0.3, 1.9, 1.0, 0.0)  # the arm's pose at every episode start; gripper open

# PD gains of the servos (N m / rad and N m s / rad; N / m and N s / m for the fingers)
ARM_KP, ARM_KV = 30.0, 1.5
FINGER_KP, FINGER_KV = 300.0, 6.0

SCENE_CAMERA_POS = (0.55, 0.0, 0.40)
SCENE_CAMERA_TARGET = (0.17, 0.0, 0.02)


def _look_at_xyaxes(position: np.ndarray, target: np.ndarray) -> str:
    """MJCF ``xyaxes`` of a camera at ``position`` looking at ``target``, world z up."""
    forward = target - position
    forward /= np.linalg.norm(forward)
    right = np.cross(forward, (0.0, 0.0, 1.0))
    right /= np.linalg.norm(right)
    up = np.cross(right, forward)
    return " ".join(f"{v:.5f}" for v in (*right, *up))


def _joint(name: str, axis: str) -> str:
    low, high = JOINT_RANGES[name]
    return f'<joint name="{name}" axis="{axis}" range="{low} {high}" armature="0.005"/>'


def _cube(color: str, index: int) -> str:
    half = CUBE_SIZE / 2
    return f"""
    <body name="cube_{color}" pos="{0.2 + 0.05 * index} 0.3 {half}">
      <freejoint name="cube_{color}"/>
      <geom name="cube_{color}" type="box" size="{half} {half} {half}" rgba="{RGBA[color]}"
            density="500" friction="1.0 0.01 0.001"/>
    </body>"""


def _pad(color: str, index: int) -> str:
    return (
        f'<geom name="pad_{color}" type="box" pos="{0.2 + 0.1 * index} -0.3 {PAD_THICKNESS / 2}" '
        f'size="{PAD_HALF} {PAD_HALF} {PAD_THICKNESS / 2}" rgba="{PAD_RGBA[color]}"/>'
    )


def _actuators() -> str:
    lines = []
    for name in ARM_JOINTS:
        lines.append(
            f'<general name="{name}" joint="{name}" biastype="affine" gainprm="{ARM_KP}" '
            f'biasprm="0 -{ARM_KP} -{ARM_KV}" forcerange="-8 8" ctrlrange="-3.2 3.2"/>'
        )
    for name in FINGER_JOINTS:
        lines.append(
            f'<general name="{name}" joint="{name}" biastype="affine" gainprm="{FINGER_KP}" '
            f'biasprm="0 -{FINGER_KP} -{FINGER_KV}" forcerange="-6 6" '
            f'ctrlrange="0 {FINGER_TRAVEL}"/>'
        )
    return "\n    ".join(lines)


def scene_mjcf(physics_rate_hz: float = 500.0) -> str:
    """The whole scene as an MJCF string, its physics step ``1 / physics_rate_hz``."""
    if not physics_rate_hz > 0:
        raise ValueError(f"physics_rate_hz must be positive, got {physics_rate_hz}")
    scene_xyaxes = _look_at_xyaxes(np.array(SCENE_CAMERA_POS), np.array(SCENE_CAMERA_TARGET))
    wrist_xyaxes = "0 1 0 1 0 0"  # looks along the hand's +z (towards the fingers)
    half_finger, half_length = FINGER_HALF_THICKNESS, FINGER_LENGTH / 2
    cubes = "".join(_cube(color, i) for i, color in enumerate(CUBE_COLORS))
    pads = "\n    ".join(_pad(color, i) for i, color in enumerate(PAD_COLORS))
    pos = " ".join(str(v) for v in SCENE_CAMERA_POS)
    return f"""<mujoco model="so101_like_tabletop">
  <compiler angle="radian" autolimits="true"/>
  <option timestep="{1.0 / physics_rate_hz:.6f}" integrator="implicitfast" cone="elliptic"
          impratio="10"/>
  <visual>
    <global offwidth="640" offheight="480"/>
    <headlight ambient="0.45 0.45 0.45" diffuse="0.5 0.5 0.5" specular="0 0 0"/>
  </visual>
  <default>
    <geom solref="0.004 1" solimp="0.95 0.99 0.001"/>
    <default class="link">
      <geom contype="0" conaffinity="0" rgba="0.92 0.92 0.9 1" density="400"/>
    </default>
  </default>
  <worldbody>
    <light pos="0.3 0.2 1.2" dir="-0.2 -0.1 -1" diffuse="0.5 0.5 0.5" castshadow="false"/>
    <geom name="table" type="box" pos="0.15 0 -0.02" size="0.45 0.5 0.02"
          rgba="0.62 0.52 0.42 1"/>
    {pads}
    <camera name="scene" pos="{pos}" xyaxes="{scene_xyaxes}" fovy="58"/>
    <geom name="base" class="link" type="cylinder" pos="0 0 {PAN_HEIGHT / 2}"
          size="0.045 {PAN_HEIGHT / 2}" rgba="0.2 0.2 0.22 1"/>
    <body name="pan_link" pos="0 0 {PAN_HEIGHT}" gravcomp="1">
      {_joint("shoulder_pan", "0 0 1")}
      <geom class="link" type="cylinder" size="0.035 0.015" pos="0 0 0.015"/>
      <body name="upper_arm" pos="0 0 {SHOULDER_HEIGHT - PAN_HEIGHT}" gravcomp="1">
        {_joint("shoulder_lift", "0 1 0")}
        <geom class="link" type="capsule" fromto="0 0 0 0 0 {UPPER_ARM}" size="0.018"/>
        <body name="forearm" pos="0 0 {UPPER_ARM}" gravcomp="1">
          {_joint("elbow_flex", "0 1 0")}
          <geom class="link" type="capsule" fromto="0 0 0 0 0 {FOREARM}" size="0.015"/>
          <body name="wrist" pos="0 0 {FOREARM}" gravcomp="1">
            {_joint("wrist_flex", "0 1 0")}
            <geom class="link" type="capsule" fromto="0 0 0 0 0 0.03" size="0.014"/>
            <body name="hand" pos="0 0 0.03" gravcomp="1">
              {_joint("wrist_roll", "0 0 1")}
              <geom name="hand" class="link" type="box" size="0.02 0.036 0.01" pos="0 0 0.01"
                    rgba="0.2 0.2 0.22 1"/>
              <camera name="wrist" pos="0.045 0 0.0" xyaxes="{wrist_xyaxes}" fovy="75"/>
              <site name="tip" pos="0 0 {HAND_TO_TIP}" size="0.004" rgba="1 1 0 0"/>
              <body name="finger_left" pos="0 {FINGER_OFFSET} {FINGER_BASE}" gravcomp="1">
                <joint name="finger_left" type="slide" axis="0 -1 0"
                       range="0 {FINGER_TRAVEL}" armature="0.01"/>
                <geom name="finger_left" type="box" size="0.012 {half_finger} {half_length}"
                      pos="0 0 {half_length}" rgba="0.3 0.3 0.32 1" friction="1.5 0.01 0.001"/>
              </body>
              <body name="finger_right" pos="0 -{FINGER_OFFSET} {FINGER_BASE}" gravcomp="1">
                <joint name="finger_right" type="slide" axis="0 1 0"
                       range="0 {FINGER_TRAVEL}" armature="0.01"/>
                <geom name="finger_right" type="box" size="0.012 {half_finger} {half_length}"
                      pos="0 0 {half_length}" rgba="0.3 0.3 0.32 1" friction="1.5 0.01 0.001"/>
              </body>
            </body>
          </body>
        </body>
      </body>
    </body>{cubes}
  </worldbody>
  <equality>
    {
        "".join(
            f'<weld name="grasp_{c}" body1="hand" body2="cube_{c}" active="false"/>'
            for c in CUBE_COLORS
        )
    }
  </equality>
  <contact>
    {"".join(f'<pair geom1="hand" geom2="cube_{c}"/>' for c in CUBE_COLORS)}
  </contact>
  <actuator>
    {_actuators()}
  </actuator>
</mujoco>
"""
