"""From a robot-unit action chunk to the command the node publishes, limited in its own space.

The numbers a checkpoint returns mean different things (``action_space``, see
:mod:`oxygen_ros.model.robots`):

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
    trajectory: JointTrajectory | None  # None in dry_run and for end-effector actions


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
    trajectory = None
    if settings.publishes_trajectory:
        trajectory = chunk_to_joint_trajectory(
            positions, settings.action_joint_names, settings.action_dt, stamp, velocities=velocities
        )
    return Command(space, np.asarray(published, dtype=np.float32), clipped, trajectory)


def _mask(width: int, dims) -> np.ndarray:
    mask = np.zeros(width, dtype=bool)
    mask[list(dims)] = True
    return mask
