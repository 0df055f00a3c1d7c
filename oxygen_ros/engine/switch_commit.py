"""Keep the gripper switches a policy plans ahead (`SwitchCommitment`).

A policy that re-plans every frame and hands the controller a fresh chunk each time executes only
the first step or so of each plan. A gripper switch it plans a few steps ahead (open in 0.4 s)
can then recede frame after frame: each new chunk again plans it a few steps ahead, and the
gripper never moves. It happens where the demonstrations pause before a switch (the expert opens
once it has lowered the cube onto its spot): a state that looks like "just before the switch"
is planned as such for as long as the policy stays in it.

The commitment keeps a planned switch to the time it was first planned for. Per gripper dim, a
chunk that plans the dim to cross ``level`` (closed above it, open below) ``k`` steps ahead makes
the switch due at that step's time; a later chunk may bring it sooner, not put it off; once due,
the chunk's dim holds the switched value throughout, and keeps it for ``hold_s`` (the gripper
moves and the cube drops before the policy may plan the way back). A switch that no chunk has
planned on ``misses`` frames in a row is dropped: the policy changed its mind.

Times are the controller's: action ``i`` of a chunk stamped ``stamp_s`` runs at
``stamp_s + (i + 1) * action_dt``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

HOLD_S = 0.5  # a switch made holds this long
MISSES = 2  # frames in a row without the switch planned that drop it
EPSILON_S = 1e-6  # stamps' float slack


@dataclasses.dataclass
class _DimState:
    """One gripper dim's side, its kept switch and its hold."""

    closed: bool | None = None  # the side of the last chunk's first step (None: no chunk yet)
    due_s: float | None = None  # when the kept switch runs
    target: float = 0.0  # the value the kept switch goes to
    misses: int = 0  # chunks in a row that did not plan it
    hold_until_s: float = -math.inf
    held: float = 0.0  # the value held until then


class SwitchCommitment:
    """Per gripper dim, the switches a chunk plans ahead kept to their time (module docstring).

    Raises (constructor):
        ValueError: no dims, a level that is not a finite number, an ``action_dt`` or ``hold_s``
            that is not positive, or ``misses`` below 1.
    """

    def __init__(
        self,
        dims: Sequence[int],
        level: float,
        action_dt: float,
        hold_s: float = HOLD_S,
        misses: int = MISSES,
    ) -> None:
        if not dims:
            raise ValueError("a switch commitment needs at least one gripper dim")
        if not math.isfinite(level):
            raise ValueError(f"the gripper's switch level must be a finite number, got {level}")
        for name, value in (("action_dt", action_dt), ("hold_s", hold_s)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be > 0 s, got {value}")
        if misses < 1:
            raise ValueError(f"misses must be >= 1, got {misses}")
        self.dims = tuple(int(d) for d in dims)
        self.level = float(level)
        self.action_dt = float(action_dt)
        self.hold_s = float(hold_s)
        self.misses = int(misses)
        self.switches = 0  # switches the commitment made sooner than the chunk in hand planned
        self.reset()

    def reset(self) -> None:
        """A new episode: no side known, nothing kept."""
        self._dims = {dim: _DimState() for dim in self.dims}

    def apply(self, actions: np.ndarray, stamp_s: float) -> np.ndarray:
        """``actions`` [steps, dims] (robot units) with each gripper dim's kept switch applied;
        a copy. ``stamp_s``: the chunk's stamp (its observation's time).

        Raises:
            ValueError: a chunk that is not 2-D or lacks a gripper dim.
        """
        chunk = np.array(actions, dtype=np.float64)
        if chunk.ndim != 2 or chunk.shape[0] == 0 or max(self.dims) >= chunk.shape[1]:
            raise ValueError(
                f"chunk of shape {tuple(chunk.shape)} does not hold gripper dims {self.dims}"
            )
        times = stamp_s + self.action_dt * np.arange(1, chunk.shape[0] + 1)
        for dim, state in self._dims.items():
            self._apply_dim(chunk[:, dim], times, state)
        return chunk.astype(np.asarray(actions).dtype, copy=False)

    def _apply_dim(self, column: np.ndarray, times: np.ndarray, state: _DimState) -> None:
        """Rewrite one dim's ``column`` (in place) and advance its state."""
        if state.closed is None:
            state.closed = bool(column[0] > self.level)
        if times[0] < state.hold_until_s - EPSILON_S:
            column[:] = state.held
            return
        crossed = (column <= self.level) if state.closed else (column > self.level)
        if crossed.any():
            step = int(np.argmax(crossed))
            if state.due_s is None or times[step] < state.due_s:
                state.due_s, state.target = float(times[step]), float(column[step])
            state.misses = 0
        else:
            state.misses += 1
            if state.misses >= self.misses:
                state.due_s = None
        if state.due_s is not None:
            switched = times >= state.due_s - EPSILON_S
            if switched[0]:  # due by this chunk's first step: switch now and hold
                if not crossed[0]:
                    self.switches += 1
                column[:] = state.target
                state.hold_until_s, state.held = times[0] + self.hold_s, state.target
                state.due_s, state.misses = None, 0
            else:
                column[switched] = state.target
        state.closed = bool(column[0] > self.level)
