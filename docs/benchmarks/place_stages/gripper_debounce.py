"""`oxygen-bench sim-policy` with each chunk's gripper column debounced: the commanded gripper
changes side (open/closed at 0.5) only where N steps in a row say so; a step on the other side
is held at the current side's end (0 or 1). The state carries over from the chunk executed last.

    python docs/benchmarks/place_stages/gripper_debounce.py N SIM-POLICY-ARGUMENTS...
"""

import sys

import numpy as np
from patched_bench import rewrite_chunks, run

SIDE = 0.5  # a gripper value above this is closed


def debounce(gripper: np.ndarray, closed: bool, steps: int) -> np.ndarray:
    """``gripper`` (one chunk's column) debounced from ``closed``."""
    out = gripper.copy()
    for k in range(len(gripper)):
        window = gripper[k : k + steps]
        if len(window) == steps and all((g > SIDE) != closed for g in window):
            closed = not closed
        if (gripper[k] > SIDE) != closed:
            out[k] = 1.0 if closed else 0.0
    return out


def debouncer(steps: int):
    """A new episode's rewrite: the gripper column debounced over ``steps``, from open."""
    state = {"closed": False}

    def rewrite(actions: np.ndarray) -> None:
        if steps > 1:
            actions[:, -1] = debounce(actions[:, -1], state["closed"], steps)
        state["closed"] = bool(actions[0, -1] > SIDE)

    return rewrite


if __name__ == "__main__":
    steps = int(sys.argv[1])
    rewrite_chunks(lambda: debouncer(steps))
    run(sys.argv[2:])
