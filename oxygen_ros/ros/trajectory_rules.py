"""What ros2_control's joint_trajectory_controller accepts, with its default parameters.

The rules of ``JointTrajectoryController::validate_trajectory_msg`` (ros2_controllers, jazzy),
applied to a ``trajectory_msgs/JointTrajectory``: a controller drops the whole message when any
fails. The node checks what it publishes against them, the simulated robot refuses what a real
controller would refuse, and the tests apply them to every action space.

Defaults assumed (each a controller parameter): ``allow_partial_joints_goal: false``,
``allow_nonzero_velocity_at_trajectory_end: false``, ``allow_integration_in_goal_trajectories:
false`` and no effort command interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# the controller compares each last-point velocity against float's epsilon
VELOCITY_EPSILON = 1.1920928955078125e-07

# every reason a trajectory is rejected, as counters and logs name it
REJECT_JOINTS = "joints"  # not exactly the controller's joints
REJECT_EMPTY = "empty"  # no points
REJECT_END_VELOCITY = "end_velocity"  # non-zero velocity at the last point
REJECT_PAST = "ends_in_past"  # a non-zero stamp whose last point is already over
REJECT_TIME_ORDER = "time_order"  # time_from_start not strictly increasing
REJECT_FIELDS = "fields"  # positions missing or any field of the wrong width, or effort
REJECT_REASONS = (
    REJECT_JOINTS,
    REJECT_EMPTY,
    REJECT_END_VELOCITY,
    REJECT_PAST,
    REJECT_TIME_ORDER,
    REJECT_FIELDS,
)


class TrajectoryRejected(ValueError):
    """A trajectory a stock joint_trajectory_controller would drop; ``reason`` is one of
    ``REJECT_REASONS``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def duration_seconds(duration: Any) -> float:
    """A builtin_interfaces Time or Duration in seconds."""
    return duration.sec + duration.nanosec * 1e-9


def check_trajectory(trajectory: Any, controller_joints: Sequence[str], now_s: float) -> None:
    """Raise :class:`TrajectoryRejected` if a controller owning ``controller_joints`` whose clock
    reads ``now_s`` would reject ``trajectory``; return None when it would accept it.

    The checks run in the controller's own order, so the reason is the one its log would give.
    """
    names = list(trajectory.joint_names)
    if len(names) != len(controller_joints):
        raise TrajectoryRejected(
            REJECT_JOINTS,
            f"the trajectory has {len(names)} joints {names}, the controller "
            f"{len(controller_joints)} {list(controller_joints)} "
            "(allow_partial_joints_goal: false)",
        )
    if not trajectory.points:
        raise TrajectoryRejected(REJECT_EMPTY, "the trajectory has no points")
    foreign = [name for name in names if name not in controller_joints]
    if foreign:
        raise TrajectoryRejected(
            REJECT_JOINTS, f"joints {foreign} are not the controller's {list(controller_joints)}"
        )
    last = trajectory.points[-1]
    moving = [
        (names[i], float(v)) for i, v in enumerate(last.velocities) if abs(v) > VELOCITY_EPSILON
    ]
    if moving:
        raise TrajectoryRejected(
            REJECT_END_VELOCITY,
            f"the last point's velocity is not zero for {moving} "
            "(allow_nonzero_velocity_at_trajectory_end: false)",
        )
    start_s = duration_seconds(trajectory.header.stamp)
    if start_s != 0.0:
        end_s = start_s + duration_seconds(last.time_from_start)
        if end_s < now_s:
            raise TrajectoryRejected(
                REJECT_PAST,
                f"the trajectory starts at {start_s:.6f} s and ends at {end_s:.6f} s, "
                f"before now ({now_s:.6f} s)",
            )
    previous = None
    for index, point in enumerate(trajectory.points):
        at = duration_seconds(point.time_from_start)
        if previous is not None and at <= previous:
            raise TrajectoryRejected(
                REJECT_TIME_ORDER,
                f"time_from_start of points {index - 1} and {index} is not strictly increasing "
                f"({previous:.6f} s, {at:.6f} s)",
            )
        previous = at
        _check_fields(point, index, len(names))


def _check_fields(point: Any, index: int, width: int) -> None:
    if len(point.positions) != width:
        raise TrajectoryRejected(
            REJECT_FIELDS, f"point {index} has {len(point.positions)} positions for {width} joints"
        )
    for field in ("velocities", "accelerations"):
        values = getattr(point, field)
        if len(values) and len(values) != width:
            raise TrajectoryRejected(
                REJECT_FIELDS, f"point {index} has {len(values)} {field} for {width} joints"
            )
    if len(point.effort):
        raise TrajectoryRejected(
            REJECT_FIELDS,
            f"point {index} carries effort (only a controller commanding effort takes it)",
        )
