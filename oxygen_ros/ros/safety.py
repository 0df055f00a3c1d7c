"""Last checks between the model and the robot: finite values, position limits, speed limits.

:meth:`SafetyFilter.apply` takes an action chunk in robot units ``[horizon, joints]`` and the
current positions of the same joints, and returns a copy in which

1. each step moves at most ``max_velocity * dt`` from the previous step (the first step from the
   current joint state), then
2. every value lies within ``[lower, upper]`` (position limits are hard and win over the speed
   limit when the robot currently stands outside them),

together with the number of values changed. :meth:`SafetyFilter.apply_velocity` limits a velocity
command in its own space: speeds to ``max_velocity``, the positions integrated from the current
state (``q + sum(v * dt)``) to ``[lower, upper]``. A chunk holding NaN or Inf is refused
(:class:`UnsafeChunkError`), never repaired: the node publishes nothing for that tick.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np


class UnsafeChunkError(ValueError):
    """An action chunk that must not be published (non-finite model output)."""


@dataclasses.dataclass(frozen=True)
class SafeChunk:
    actions: np.ndarray  # [horizon, joints] float32
    clipped: int  # values changed by the limits


@dataclasses.dataclass(frozen=True)
class SafeVelocityChunk:
    # [horizon, joints] float32, each step's velocity (also of position dims)
    velocities: np.ndarray
    positions: np.ndarray  # [horizon, joints] float32, where each step ends
    # commanded values (velocities; positions of the position dims) changed by the limits
    clipped: int


def _optional(values: Sequence[float], joints: int, name: str) -> np.ndarray | None:
    if not values:
        return None
    array = np.asarray(values, dtype=np.float64)
    if array.shape != (joints,):
        raise ValueError(
            f"{name} needs {joints} values (one per action joint), got {array.shape[0]}"
        )
    if not np.isfinite(array).all():
        raise ValueError(f"{name} must be finite, got {list(values)}")
    return array


class SafetyFilter:
    """Position and speed limits for the action joints; empty sequences mean unlimited.

    Raises:
        ValueError: limits of the wrong length, non-finite, lower above upper, or speeds <= 0.
    """

    def __init__(
        self,
        joints: int,
        lower: Sequence[float] = (),
        upper: Sequence[float] = (),
        max_velocity: Sequence[float] = (),
    ) -> None:
        self.joints = joints
        self.lower = _optional(lower, joints, "lower limits")
        self.upper = _optional(upper, joints, "upper limits")
        self.max_velocity = _optional(max_velocity, joints, "max velocity")
        if self.lower is not None and self.upper is not None and (self.lower > self.upper).any():
            raise ValueError("lower limits exceed upper limits")
        if self.max_velocity is not None and (self.max_velocity <= 0).any():
            raise ValueError("max velocity must be positive")

    @property
    def limited(self) -> bool:
        return any(x is not None for x in (self.lower, self.upper, self.max_velocity))

    def _checked(self, actions: np.ndarray) -> np.ndarray:
        chunk = np.asarray(actions, dtype=np.float64)
        if chunk.ndim != 2 or chunk.shape[1] != self.joints:
            raise ValueError(f"actions must be [horizon, {self.joints}], got {chunk.shape}")
        bad = ~np.isfinite(chunk)
        if bad.any():
            raise UnsafeChunkError(
                f"model output holds {int(bad.sum())} non-finite values (NaN/Inf)"
            )
        return chunk

    def _current(self, current: np.ndarray) -> np.ndarray:
        state = np.asarray(current, dtype=np.float64)
        if state.shape != (self.joints,) or not np.isfinite(state).all():
            raise ValueError(f"current positions must be {self.joints} finite values, got {state}")
        return state

    def apply_velocity(
        self, command: np.ndarray, current: np.ndarray, dt: float, position_dims: Sequence[int] = ()
    ) -> SafeVelocityChunk:
        """Limit a velocity ``command`` [horizon, joints] whose ``position_dims`` hold positions.

        Step by step from the ``current`` positions: a velocity dim's speed is clipped to
        ``max_velocity`` and its position integrated (``previous + v * dt``); a position dim moves
        at most ``max_velocity * dt`` towards its target. Each position is then clipped to
        ``[lower, upper]``; where that changes it, the step's velocity becomes the one that reaches
        the clipped position (``(position - previous) / dt``), so velocities and positions agree.
        Position dims get the velocity of their step the same way.

        Raises:
            UnsafeChunkError: ``command`` holds NaN or Inf.
            ValueError: shapes do not match, ``current`` is not finite, ``dt`` is not positive, or a
                position dim is out of range.
        """
        chunk = self._checked(command)
        previous = self._current(current)
        if not dt > 0:
            raise ValueError(f"dt must be positive, got {dt}")
        is_position = np.zeros(self.joints, dtype=bool)
        if len(position_dims):
            dims = np.asarray(position_dims, dtype=int)
            if dims.min() < 0 or dims.max() >= self.joints:
                raise ValueError(
                    f"position dims {list(position_dims)} outside 0..{self.joints - 1}"
                )
            is_position[dims] = True
        velocities = np.empty_like(chunk)
        positions = np.empty_like(chunk)
        step = None if self.max_velocity is None else self.max_velocity * dt
        for i, row in enumerate(chunk):
            velocity = (
                row
                if self.max_velocity is None
                else np.clip(row, -self.max_velocity, self.max_velocity)
            )
            target = row if step is None else np.clip(row, previous - step, previous + step)
            target = np.where(is_position, target, previous + velocity * dt)
            position = (
                np.clip(target, self.lower, self.upper)
                if self.lower is not None or self.upper is not None
                else target
            )
            reached = (position - previous) / dt
            velocities[i] = np.where(is_position | (position != target), reached, velocity)
            positions[i] = position
            previous = position
        commanded = np.where(is_position, positions, velocities).astype(np.float32)
        clipped = int(np.count_nonzero(commanded != chunk.astype(np.float32)))
        return SafeVelocityChunk(
            velocities.astype(np.float32), positions.astype(np.float32), clipped
        )

    def apply(self, actions: np.ndarray, current: np.ndarray, dt: float) -> SafeChunk:
        """Limit ``actions`` [horizon, joints] given the ``current`` positions [joints] and step
        ``dt``.

        Raises:
            UnsafeChunkError: ``actions`` holds NaN or Inf.
            ValueError: shapes do not match the configured joints, or ``current`` is not finite.
        """
        chunk = self._checked(actions)
        if not self.limited:
            return SafeChunk(chunk.astype(np.float32), 0)
        out = chunk.copy()
        if self.max_velocity is not None:
            state = self._current(current)
            step = self.max_velocity * dt
            previous = state
            for i in range(out.shape[0]):
                out[i] = np.clip(out[i], previous - step, previous + step)
                previous = out[i]
        if self.lower is not None or self.upper is not None:
            out = np.clip(out, self.lower, self.upper)
        final = out.astype(np.float32)
        clipped = int(np.count_nonzero(final != chunk.astype(np.float32)))
        return SafeChunk(final, clipped)
