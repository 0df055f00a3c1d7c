"""Physics and rendering of the scene, without ROS: the robot's body.

The arm's and fingers' servos track a reference (position and velocity) set once per control
step: ``ctrl = q_ref + (kv / kp) * v_ref``, so the actuator's force ``kp * (ctrl - q) - kv * qdot``
is a PD law on the position error and the velocity error. The gripper's one reference (0 = open,
1 = closed) drives both fingers.

Grasp assist (honest, documented): primitive fingers squeezing a cube under position control make
a friction grasp that slips often enough to spoil a data set, so a grasp is made firm by a weld
constraint between the hand and the cube. It switches on when both fingers touch the same cube
while the gripper is commanded to close, holding the cube at the pose it had then, and off as
soon as the fingers are commanded open. The fingers still close on the cube and stop at its
faces (the gripper reads ~0.5 holding a cube), and a gripper that closes beside a cube, or on
it with one finger, grasps nothing.

Rendering is headless (EGL; ``MUJOCO_GL`` is set to ``egl`` unless already set) and must happen
on the thread that created the renderer.
"""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")

import mujoco  # noqa: E402  (MUJOCO_GL must be set first)
import numpy as np  # noqa: E402

from .scene import (  # noqa: E402
    ARM_JOINTS,
    ARM_KP,
    ARM_KV,
    CUBE_COLORS,
    CUBE_SIZE,
    FINGER_JOINTS,
    FINGER_KP,
    FINGER_KV,
    FINGER_TRAVEL,
    GRIPPER_BODIES,
    HOME,
    PAD_COLORS,
    PAD_THICKNESS,
    scene_mjcf,
)
from .tasks import Layout  # noqa: E402

CLOSE_COMMAND = 0.3  # a gripper reference above this is a command to close


class World:
    """The MuJoCo model and state of the scene, stepped at ``physics_rate_hz``."""

    def __init__(self, physics_rate_hz: float = 500.0) -> None:
        self.model = mujoco.MjModel.from_xml_string(scene_mjcf(physics_rate_hz))
        self.data = mujoco.MjData(self.model)
        self.dt = float(self.model.opt.timestep)
        self._arm_qpos = [self.model.joint(n).qposadr[0] for n in ARM_JOINTS]
        self._arm_dof = [self.model.joint(n).dofadr[0] for n in ARM_JOINTS]
        self._finger_qpos = [self.model.joint(n).qposadr[0] for n in FINGER_JOINTS]
        self._finger_dof = [self.model.joint(n).dofadr[0] for n in FINGER_JOINTS]
        self._arm_actuators = [self.model.actuator(n).id for n in ARM_JOINTS]
        self._finger_actuators = [self.model.actuator(n).id for n in FINGER_JOINTS]
        self._cube_qpos = {c: self.model.joint(f"cube_{c}").qposadr[0] for c in CUBE_COLORS}
        self._cube_dof = {c: self.model.joint(f"cube_{c}").dofadr[0] for c in CUBE_COLORS}
        self._cube_geom = {c: self.model.geom(f"cube_{c}").id for c in CUBE_COLORS}
        self._pad_geom = {c: self.model.geom(f"pad_{c}").id for c in PAD_COLORS}
        self._finger_geoms = [self.model.geom(n).id for n in FINGER_JOINTS]
        gripper_bodies = [self.model.body(n).id for n in GRIPPER_BODIES]
        self._gripper_geoms = np.flatnonzero(np.isin(self.model.geom_bodyid, gripper_bodies))
        self._weld = {c: self.model.equality(f"grasp_{c}").id for c in CUBE_COLORS}
        self._hand = self.model.body("hand").id
        self._tip = self.model.site("tip").id
        self._kinematics = mujoco.MjData(self.model)  # scratch state for `tip_for`
        self._gripper_reference = 0.0
        self.grasped: str | None = None
        self._renderer: mujoco.Renderer | None = None
        self.reset(None)

    # -- episode set-up ---------------------------------------------------------------------------
    def reset(self, layout: Layout | None) -> None:
        """Arm at home with the gripper open, nothing grasped, objects where ``layout`` says
        (``None`` leaves them where the model puts them); time back to zero."""
        mujoco.mj_resetData(self.model, self.data)
        self.data.qpos[self._arm_qpos] = HOME
        for color in CUBE_COLORS:
            self.data.eq_active[self._weld[color]] = 0
        self.grasped = None
        if layout is not None:
            for color, (x, y, yaw) in layout.cubes.items():
                adr = self._cube_qpos[color]
                self.data.qpos[adr : adr + 3] = (x, y, CUBE_SIZE / 2)
                self.data.qpos[adr + 3 : adr + 7] = (np.cos(yaw / 2), 0.0, 0.0, np.sin(yaw / 2))
            for color, (x, y) in layout.pads.items():
                self.model.geom_pos[self._pad_geom[color]] = (x, y, PAD_THICKNESS / 2)
        self.set_reference(np.array(HOME), np.zeros(len(ARM_JOINTS)), 0.0, 0.0)
        mujoco.mj_forward(self.model, self.data)

    # -- control ----------------------------------------------------------------------------------
    def set_reference(
        self, arm_q: np.ndarray, arm_v: np.ndarray, gripper: float, gripper_v: float
    ) -> None:
        """The servos' reference: arm joint positions/velocities, gripper opening/rate (0..1)."""
        self.data.ctrl[self._arm_actuators] = arm_q + (ARM_KV / ARM_KP) * arm_v
        gripper = float(np.clip(gripper, 0.0, 1.0))
        self._gripper_reference = gripper
        finger = gripper * FINGER_TRAVEL + (FINGER_KV / FINGER_KP) * gripper_v * FINGER_TRAVEL
        self.data.ctrl[self._finger_actuators] = finger

    def step(self, substeps: int = 1) -> None:
        """Advance physics by ``substeps`` steps, then update the grasp assist."""
        mujoco.mj_step(self.model, self.data, nstep=substeps)
        self._update_grasp()

    @property
    def time(self) -> float:
        """Simulated seconds since the last reset."""
        return float(self.data.time)

    # -- proprioception (what the robot publishes) -----------------------------------------------
    def arm_positions(self) -> np.ndarray:
        return self.data.qpos[self._arm_qpos].copy()

    def arm_velocities(self) -> np.ndarray:
        return self.data.qvel[self._arm_dof].copy()

    def gripper_opening(self) -> float:
        """The gripper as published: 0 = open .. 1 = closed (the fingers' mean travel)."""
        return float(np.mean(self.data.qpos[self._finger_qpos]) / FINGER_TRAVEL)

    @property
    def gripper_closing(self) -> bool:
        """Whether the gripper is commanded to close (its reference past :data:`CLOSE_COMMAND`)."""
        return self._gripper_reference > CLOSE_COMMAND

    def gripper_velocity(self) -> float:
        return float(np.mean(self.data.qvel[self._finger_dof]) / FINGER_TRAVEL)

    # -- privileged state (scoring and the expert only) -------------------------------------------
    def tip_position(self) -> np.ndarray:
        return self.data.site_xpos[self._tip].copy()

    def tip_for(self, arm: np.ndarray) -> np.ndarray:
        """Where the tip would be with the arm's joints at ``arm`` and everything else as it is
        (forward kinematics on a scratch copy of the state; the simulation is untouched)."""
        scratch = self._kinematics
        scratch.qpos[:] = self.data.qpos
        scratch.qpos[self._arm_qpos] = arm
        mujoco.mj_kinematics(self.model, scratch)
        return scratch.site_xpos[self._tip].copy()

    def cube_position(self, color: str) -> np.ndarray:
        adr = self._cube_qpos[color]
        return self.data.qpos[adr : adr + 3].copy()

    def cube_yaw(self, color: str) -> float:
        adr = self._cube_qpos[color]
        w, x, y, z = self.data.qpos[adr + 3 : adr + 7]
        return float(np.arctan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z)))

    def cube_speed(self, color: str) -> float:
        adr = self._cube_dof[color]
        return float(np.linalg.norm(self.data.qvel[adr : adr + 3]))

    def pad_center(self, color: str) -> tuple[float, float]:
        x, y, _ = self.model.geom_pos[self._pad_geom[color]]
        return (float(x), float(y))

    def _touching(self, color: str) -> set[int]:
        """The geoms in contact with the cube of ``color`` now (MuJoCo's contact list)."""
        cube = self._cube_geom[color]
        pairs = self.data.contact.geom  # (contacts, 2) geom ids
        return set((pairs[(pairs == cube).any(axis=1)].sum(axis=1) - cube).tolist())

    def fingers_touching(self, color: str) -> int:
        """How many fingers (0, 1 or 2) touch the cube of ``color``."""
        return len(self._touching(color) & set(self._finger_geoms))

    def cubes_touched(self) -> frozenset[str]:
        """The colours of the cubes a finger or the hand is in contact with now."""
        gripper = set(self._gripper_geoms.tolist())
        return frozenset(c for c in CUBE_COLORS if self._touching(c) & gripper)

    # -- grasp assist -----------------------------------------------------------------------------
    def _update_grasp(self) -> None:
        closing = self.gripper_closing
        if self.grasped is not None:
            if not closing:
                self.data.eq_active[self._weld[self.grasped]] = 0
                self.grasped = None
            return
        if not closing:
            return
        for color in CUBE_COLORS:
            if self.fingers_touching(color) == 2:
                self._weld_to_hand(color)
                return

    def _weld_to_hand(self, color: str) -> None:
        """Hold the cube at its present pose relative to the hand."""
        weld = self._weld[color]
        cube = self.model.body(f"cube_{color}").id
        hand_rotation = self.data.xmat[self._hand].reshape(3, 3)
        relative_position = hand_rotation.T @ (self.data.xpos[cube] - self.data.xpos[self._hand])
        hand_inverse = np.zeros(4)
        mujoco.mju_negQuat(hand_inverse, self.data.xquat[self._hand])
        relative_quat = np.zeros(4)
        mujoco.mju_mulQuat(relative_quat, hand_inverse, self.data.xquat[cube])
        self.model.eq_data[weld, 0:3] = 0.0  # anchor at the cube's origin
        self.model.eq_data[weld, 3:6] = relative_position
        self.model.eq_data[weld, 6:10] = relative_quat
        self.data.eq_active[weld] = 1
        self.grasped = color

    # -- rendering --------------------------------------------------------------------------------
    def render(self, camera: str, width: int, height: int) -> np.ndarray:
        """An (height, width, 3) uint8 RGB image from ``camera`` (``scene`` or ``wrist``)."""
        renderer = self._renderer
        if renderer is None or (renderer.width, renderer.height) != (width, height):
            if renderer is not None:
                renderer.close()
            renderer = self._renderer = mujoco.Renderer(self.model, height, width)
        renderer.update_scene(self.data, camera=camera)
        return renderer.render()

    def close(self) -> None:
        """Free the renderer (call from the thread that rendered)."""
        if self._renderer is not None:
            self._renderer.close()
            self._renderer = None
