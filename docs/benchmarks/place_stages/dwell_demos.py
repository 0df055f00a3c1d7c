"""Place demonstrations whose expert dwells DWELL_S at the close (held, not yet lifting) and at the
release (open, not yet retreating): more frames of the two gripper moments. An experiment, run as
`oxygen-sim-dataset` is: python dwell_demos.py demos --out DIR --touch 0 --place 600 ...
(the release's dwell is not recorded: a place episode ends when it succeeds)."""

import sys

from oxygen_ros.sim import expert as ex
from oxygen_ros.tools import sim_dataset

DWELL_S = 0.3
orig = ex.ScriptedExpert._advance


def _advance(self, task, state):
    if task.kind == ex.PLACE and self.step in (ex.CLOSE, ex.OPEN) and hasattr(self, "_last"):
        ready = state.grasped == task.cube if self.step == ex.CLOSE else state.gripper < ex.OPENED
        if ready:
            key = (self.episode, self.task_step if hasattr(self, "task_step") else 0, self.step)
            since = self.__dict__.setdefault("_ready_since", {}).setdefault(key, state.time_s)
            if state.time_s - since < DWELL_S:
                return self._last
    self._last = orig(self, task, state)
    return self._last


ex.ScriptedExpert._advance = _advance
sys.exit(sim_dataset.main(sys.argv[1:]))
