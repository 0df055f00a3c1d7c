"""ros2_control's joint_trajectory_controller, as the simulated robot executes trajectories.

Semantics of the stock controller (ros2_controllers, jazzy, default parameters):

* acceptance: a message is checked by :func:`oxygen_ros.ros.trajectory_rules.check_trajectory`
  against the controller's joints and its clock; a rejected message is dropped whole (the
  running trajectory continues) and the rejection's reason is counted;
* replacement: an accepted message replaces the running trajectory at once; the state at receipt
  (positions, velocities) becomes the point before the first point;
* start time: ``header.stamp``, or the first control step after receipt when the stamp is zero;
* sampling, every control step at time ``t``: before the receipt time, nothing changes; between
  the receipt and the first point, interpolation from the state at receipt to the first point;
  between points, cubic Hermite when both carry velocities, linear when they carry positions
  only; after the last point, its position held at zero velocity;
* joints in any order in the message (mapped by name to the controller's order).

Before any trajectory arrives the controller holds the position it was reset to.

One guard beyond the stock controller: a trajectory with a non-finite position, velocity or
time is refused too (reason :data:`REJECT_NON_FINITE`), where a real controller would command it
and fault; the simulated robot stays up instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from oxygen_ros.ros.trajectory_rules import (
    REJECT_REASONS,
    TrajectoryRejected,
    check_trajectory,
    duration_seconds,
)

REJECT_NON_FINITE = "non_finite"  # the sim's own guard, not a stock controller rule


@dataclass
class _ActiveTrajectory:
    """An accepted trajectory in the controller's joint order."""

    start_s: float | None  # None: a zero stamp, fixed at the first sample
    received_s: float
    state_before: tuple[np.ndarray, np.ndarray]  # positions, velocities at receipt
    times: np.ndarray  # each point's time_from_start
    positions: np.ndarray  # (points, joints)
    velocities: np.ndarray | None  # (points, joints) when every point has them


def _hermite(
    t0: float,
    q0: np.ndarray,
    v0: np.ndarray | None,
    t1: float,
    q1: np.ndarray,
    v1: np.ndarray | None,
    t: float,
) -> tuple[np.ndarray, np.ndarray]:
    """Position and velocity at ``t`` between two points: cubic Hermite with both velocities,
    linear otherwise."""
    span = t1 - t0
    if span <= 0.0:
        return q1.copy(), np.zeros_like(q1) if v1 is None else v1.copy()
    s = min(max((t - t0) / span, 0.0), 1.0)
    if v0 is None or v1 is None:
        return q0 + s * (q1 - q0), (q1 - q0) / span
    h00, h10, h01, h11 = (
        2 * s**3 - 3 * s**2 + 1,
        s**3 - 2 * s**2 + s,
        -2 * s**3 + 3 * s**2,
        s**3 - s**2,
    )
    d00, d10, d01, d11 = 6 * s**2 - 6 * s, 3 * s**2 - 4 * s + 1, -6 * s**2 + 6 * s, 3 * s**2 - 2 * s
    position = h00 * q0 + h10 * span * v0 + h01 * q1 + h11 * span * v1
    velocity = (d00 * q0 + d01 * q1) / span + d10 * v0 + d11 * v1
    return position, velocity


class TrajectoryController:
    """One joint_trajectory_controller owning ``joints``; its reference starts at ``initial``."""

    def __init__(self, name: str, joints: Sequence[str], initial: Sequence[float]) -> None:
        if len(initial) != len(joints):
            raise ValueError(f"{name}: {len(initial)} initial positions for {len(joints)} joints")
        self.name = name
        self.joints = tuple(joints)
        self.rejected = dict.fromkeys((*REJECT_REASONS, REJECT_NON_FINITE), 0)
        self.accepted = 0
        self.reset(initial)

    def reset(self, initial: Sequence[float]) -> None:
        """Hold ``initial``; forget the running trajectory (the counters are kept)."""
        self._hold = np.asarray(initial, dtype=float).copy()
        self._active: _ActiveTrajectory | None = None
        self._reference = (self._hold.copy(), np.zeros_like(self._hold))

    def receive(self, msg, now_s: float, positions: np.ndarray, velocities: np.ndarray) -> None:
        """Accept ``msg`` (a trajectory_msgs/JointTrajectory) received at ``now_s`` while the
        joints are at ``positions`` / ``velocities``, replacing the running trajectory.

        Raises:
            TrajectoryRejected: the stock controller would drop it (counted in ``rejected``).
        """
        try:
            check_trajectory(msg, self.joints, now_s)
        except TrajectoryRejected as rejection:
            self.rejected[rejection.reason] += 1
            raise
        order = [list(msg.joint_names).index(joint) for joint in self.joints]
        points = msg.points
        has_velocities = all(len(p.velocities) for p in points)
        stamp_s = duration_seconds(msg.header.stamp)
        active = _ActiveTrajectory(
            start_s=stamp_s if stamp_s != 0.0 else None,
            received_s=now_s,
            state_before=(
                np.asarray(positions, float).copy(),
                np.asarray(velocities, float).copy(),
            ),
            times=np.array([duration_seconds(p.time_from_start) for p in points]),
            positions=np.array([[p.positions[i] for i in order] for p in points], dtype=float),
            velocities=(
                np.array([[p.velocities[i] for i in order] for p in points], dtype=float)
                if has_velocities
                else None
            ),
        )
        values = [active.times, active.positions]
        if active.velocities is not None:
            values.append(active.velocities)
        if not all(np.isfinite(v).all() for v in values):
            self.rejected[REJECT_NON_FINITE] += 1
            raise TrajectoryRejected(
                REJECT_NON_FINITE, "the trajectory has a non-finite position, velocity or time"
            )
        self._active = active
        self.accepted += 1

    def sample(self, now_s: float) -> tuple[np.ndarray, np.ndarray]:
        """The reference (positions, velocities) at ``now_s``, one control step's worth."""
        active = self._active
        if active is None:
            return self._reference
        now_s = round(now_s, 9)  # a ROS clock ticks in nanoseconds: a point due now is due now
        if active.start_s is None:  # a zero stamp starts at the first control step after receipt
            active.start_s = now_s
        if now_s < round(active.received_s, 9):
            return self._reference
        point_times = np.round(active.start_s + active.times, 9)
        velocities = active.velocities
        if now_s >= point_times[-1]:
            last = active.positions[-1]
            self._reference = (last.copy(), np.zeros_like(last))
        elif now_s < point_times[0]:
            q_before, v_before = active.state_before
            self._reference = _hermite(
                active.received_s,
                q_before,
                v_before,
                point_times[0],
                active.positions[0],
                None if velocities is None else velocities[0],
                now_s,
            )
        else:
            k = int(np.searchsorted(point_times, now_s, side="right")) - 1
            self._reference = _hermite(
                point_times[k],
                active.positions[k],
                None if velocities is None else velocities[k],
                point_times[k + 1],
                active.positions[k + 1],
                None if velocities is None else velocities[k + 1],
                now_s,
            )
        return self._reference
