"""From a robot-unit action chunk to the command the node publishes, limited in its own space.

The numbers a checkpoint returns mean different things (``action_space``, see
:mod:`oxygen_ros.policy_io.robots`):

* ``position`` — absolute joint positions: published as trajectory positions;
* ``delta_position`` — positions relative to the joint state at the observation: published as the
  absolute positions ``state + delta``;
* ``velocity`` — joint velocities: published the way ros2_control executes them, every point
  carrying the ``velocities`` and the positions integrated from the state (``q + sum(v * dt)``);
* ``end_effector`` — not joints (LIBERO): published on ``~/action_chunk`` only, never as a
  JointTrajectory, and no joint limits apply.

The dims named by ``gripper_joint_names`` are absolute positions in every joint space. Safety
limits act in the commanded space after the conversion: position limits on positions,
``max_joint_velocity`` on velocities (a position dim's speed between consecutive points).

What is published is what a stock ros2_control ``joint_trajectory_controller`` with its default
parameters accepts (:mod:`oxygen_ros.ros.trajectory_rules`): the gripper dims go to their own
controller (``gripper_trajectory``), never as a joint the arm's controller does not have, and a
velocity-space trajectory ends at rest (``allow_nonzero_velocity_at_trajectory_end: false``): its
last point keeps its integrated position with velocity zero, so a chunk that no newer one replaces
decelerates over its last step instead of being refused whole.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from builtin_interfaces.msg import Time
from trajectory_msgs.msg import JointTrajectory

from ..policy_io.robots import DELTA_POSITION, END_EFFECTOR, POSITION, VELOCITY
from .convert import chunk_to_joint_trajectory
from .params import NodeSettings
from .safety import SafetyFilter, UnsafeChunkError


@dataclasses.dataclass(frozen=True)
class Command:
    """One chunk ready to publish.

    ``actions`` is the limited chunk in the units of ``action_space`` (what ``~/action_chunk``
    carries): positions, deltas from the observed state, or velocities (gripper dims: positions).
    """

    action_space: str
    actions: np.ndarray  # [horizon, action dims] float32
    clipped: int  # values changed by the limits
    trajectory: JointTrajectory | None  # the arm's; None in dry_run, for end-effector actions
    gripper_trajectory: JointTrajectory | None = None  # the gripper controller's, when split off

    @property
    def trajectories(self) -> tuple[tuple[str, JointTrajectory], ...]:
        """(output name, message) of each trajectory to publish: ``arm`` and/or ``gripper``."""
        named = (("arm", self.trajectory), ("gripper", self.gripper_trajectory))
        return tuple((name, msg) for name, msg in named if msg is not None)


def safety_filter(settings: NodeSettings) -> SafetyFilter:
    """The limits of ``settings`` over the action dims."""
    return SafetyFilter(
        len(settings.action_joint_names),
        settings.joint_lower_limits,
        settings.joint_upper_limits,
        settings.max_joint_velocity,
    )


def build_command(
    settings: NodeSettings,
    actions: np.ndarray,
    state: np.ndarray,
    stamp: Time,
    safety: SafetyFilter | None = None,
) -> Command:
    """Convert a robot-unit chunk [horizon, action dims] into the limited command of ``settings``.

    ``state`` is the full joint state of the observation (``joint_names`` order); ``stamp`` its
    time, which becomes the trajectory's header stamp. ``safety`` defaults to the limits of
    ``settings`` (pass a cached one to skip rebuilding it).

    Raises:
        UnsafeChunkError: the chunk holds NaN or Inf (nothing may be published).
        ValueError: shapes that do not match the settings.
    """
    space = settings.command_space
    chunk = np.asarray(actions, dtype=np.float64)
    if space == END_EFFECTOR:
        if not np.isfinite(chunk).all():
            raise UnsafeChunkError(
                f"model output holds {int((~np.isfinite(chunk)).sum())} non-finite values"
            )
        return Command(space, chunk.astype(np.float32), 0, None)
    safety = safety or safety_filter(settings)
    current = np.asarray(state, dtype=np.float64)[list(settings.action_joint_indices)]
    grippers = list(settings.gripper_dims)
    velocities = None
    if space == VELOCITY:
        safe = safety.apply_velocity(chunk, current, settings.action_dt, grippers)
        positions, velocities, clipped = safe.positions, safe.velocities, safe.clipped
        published = np.where(_mask(chunk.shape[1], grippers), positions, velocities)
    elif space == DELTA_POSITION:
        relative = ~_mask(chunk.shape[1], grippers)
        targets = np.where(relative, current + chunk, chunk)
        safe = safety.apply(targets, current, settings.action_dt)
        positions, clipped = safe.actions, safe.clipped
        published = np.where(relative, positions - current, positions)
    elif space == POSITION:
        safe = safety.apply(chunk, current, settings.action_dt)
        positions, clipped = safe.actions, safe.clipped
        published = positions
    else:  # NodeSettings validates the space; this guards a new one added without a branch here
        raise ValueError(f"no command conversion for action space {space!r}")
    arm, gripper = None, None
    if settings.publishes_trajectory:
        if velocities is not None:
            velocities = velocities.copy()
            velocities[-1] = 0.0  # the trajectory ends at rest (see the module docstring)
        arm = _trajectory(settings, settings.arm_joint_dims, positions, velocities, stamp)
        gripper = _trajectory(settings, settings.gripper_trajectory_dims, positions, None, stamp)
    return Command(space, np.asarray(published, dtype=np.float32), clipped, arm, gripper)


def _trajectory(
    settings: NodeSettings,
    dims: tuple[int, ...],
    positions: np.ndarray,
    velocities: np.ndarray | None,
    stamp: Time,
) -> JointTrajectory | None:
    """The JointTrajectory of action ``dims`` (None when there are none)."""
    if not dims:
        return None
    columns = list(dims)
    return chunk_to_joint_trajectory(
        positions[:, columns],
        [settings.action_joint_names[i] for i in columns],
        settings.action_dt,
        stamp,
        velocities=None if velocities is None else velocities[:, columns],
    )


def _mask(width: int, dims) -> np.ndarray:
    mask = np.zeros(width, dtype=bool)
    mask[list(dims)] = True
    return mask
