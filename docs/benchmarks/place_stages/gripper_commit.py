"""`oxygen-bench sim-policy` with the gripper's planned switches kept: when a chunk plans the
gripper to change (open while it is closed, or close while open) k steps ahead, the switch is due
at that moment and a later chunk may bring it sooner but not put it off; a switch no chunk has
planned for ``MISSES`` frames in a row is dropped, and a switch made holds for ``HOLD_STEPS``
(the gripper moves and the cube drops before the policy may change its mind). The policy re-plans
every frame and executes one step of each chunk: a switch planned a few steps ahead can otherwise
recede frame by frame.

    python docs/benchmarks/place_stages/gripper_commit.py MISSES SIM-POLICY-ARGUMENTS...
"""

import sys

import numpy as np
from patched_bench import rewrite_chunks, run

OPEN_BELOW = 0.5  # a gripper command below this opens (0 open, 1 closed)
HOLD_STEPS = 5  # a switch made holds this many steps


def committer(misses_allowed: int):
    """A new episode's rewrite: the gripper column switched from a due planned switch on."""
    closed = False  # what the gripper was last sent
    due: int | None = None  # steps from now until the kept switch
    misses = 0
    holding = 0  # steps the last switch still holds

    def rewrite(actions: np.ndarray) -> None:
        nonlocal closed, due, misses, holding
        column = actions[:, -1]
        if holding > 0:
            column[:] = 1.0 if closed else 0.0
            holding -= 1
            return
        switched = (column < OPEN_BELOW) if closed else (column >= OPEN_BELOW)
        planned = int(np.argmax(switched)) if switched.any() else None
        if planned is None:
            misses += 1
            if misses >= misses_allowed:
                due = None
        else:
            misses = 0
            due = planned if due is None else min(due, planned)
        if due is not None and due <= 0:
            column[:] = 0.0 if closed else 1.0
            due, misses, holding = None, 0, HOLD_STEPS - 1
        elif due is not None:
            due -= 1  # one step is executed before the next chunk
        closed = bool(column[0] >= OPEN_BELOW)

    return rewrite


if __name__ == "__main__":
    misses_allowed = int(sys.argv[1])
    rewrite_chunks(lambda: committer(misses_allowed))
    run(sys.argv[2:])
