"""`oxygen-bench sim-policy` with each chunk's gripper column averaged over the chunks before it:
the gripper sent for a step is the mean of what the last N chunks predicted for that moment (a
temporal ensemble of the gripper only; the arm is the newest chunk's, as guided RTC made it).

    python docs/benchmarks/place_stages/gripper_ensemble.py N SIM-POLICY-ARGUMENTS...
"""

import sys

import numpy as np
from patched_bench import rewrite_chunks, run


def ensembled(column: np.ndarray, earlier: list[np.ndarray]) -> np.ndarray:
    """``column`` (the newest chunk's gripper), each step averaged with what ``earlier`` (the
    chunks of the frames before, newest first) predicted for the same moment."""
    out = column.astype(np.float64).copy()
    counts = np.ones(len(column))
    for age, old in enumerate(earlier, start=1):
        overlap = old[age : age + len(column)]
        out[: len(overlap)] += overlap
        counts[: len(overlap)] += 1
    return (out / counts).astype(column.dtype)


def ensembler(chunks: int):
    """A new episode's rewrite: the gripper column averaged over the last ``chunks`` chunks."""
    history: list[np.ndarray] = []  # raw gripper columns, newest first

    def rewrite(actions: np.ndarray) -> None:
        raw = actions[:, -1].copy()
        actions[:, -1] = ensembled(raw, history[: chunks - 1])
        history.insert(0, raw)
        del history[chunks:]

    return rewrite


if __name__ == "__main__":
    chunks = int(sys.argv[1])
    rewrite_chunks(lambda: ensembler(chunks))
    run(sys.argv[2:])
