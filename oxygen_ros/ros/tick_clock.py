"""ROS time that keeps moving while a tick runs.

With ``use_sim_time`` a node's ROS clock moves only when its executor takes a ``/clock`` message.
The node spins one single-threaded executor, so during a tick (prefill, action, limits, publish:
tens to hundreds of milliseconds, more with ``inject_inference_delay_ms``) its clock stands at the
tick's start: the chunk's delay reported to RTC, the publish time and the check that a trajectory
does not already end in the past would all read a stale "now", and a controller on the sim's
clock rejects trajectories the node believed current (seen in ``oxygen-bench closed-loop``).

:class:`TickClock` extrapolates: while the ROS clock is simulated and has not stepped since it was
last read, now = the last reading + the simulated clock's measured speed x the steady time since
that reading (at most ``max_extrapolation_s``: a paused simulation stops it). With wall-clock ROS
time, or once a new ``/clock`` arrived, it returns the clock as is.
"""

from __future__ import annotations

import time
from collections.abc import Callable

MAX_EXTRAPOLATION_S = 2.0  # longer than any tick the node runs (its rate is >= 1 Hz)
MAX_SPEED = 1.5  # a simulation measured faster than this is taken at this speed


class TickClock:
    """``now_ns()``: the ROS time ``ros_now_ns`` gives, extrapolated on ``steady_ns`` while
    ``simulated()`` and the ROS time has not stepped since it was last read."""

    def __init__(
        self,
        ros_now_ns: Callable[[], int],
        simulated: Callable[[], bool],
        steady_ns: Callable[[], int] = time.monotonic_ns,
        max_extrapolation_s: float = MAX_EXTRAPOLATION_S,
    ) -> None:
        self._ros_now_ns, self._simulated, self._steady_ns = ros_now_ns, simulated, steady_ns
        self._max_ns = int(max_extrapolation_s * 1e9)
        self._seen: tuple[int, int] | None = None  # (ROS ns, steady ns) when it last stepped
        self._speed = 1.0  # simulated seconds per steady second, between the last two steps

    def now_ns(self) -> int:
        ros, steady = self._ros_now_ns(), self._steady_ns()
        seen = self._seen
        if seen is None or ros != seen[0]:
            if seen is not None and steady > seen[1] and ros > seen[0]:
                speed = (ros - seen[0]) / (steady - seen[1])
                self._speed = min(MAX_SPEED, speed)
            self._seen = (ros, steady)
            return ros
        if not self._simulated():
            return ros
        return ros + int(self._speed * min(steady - seen[1], self._max_ns))
