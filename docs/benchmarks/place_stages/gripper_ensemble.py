"""`oxygen-bench sim-policy` with each chunk's gripper column averaged over the chunks before it:
the gripper sent for a step is the mean of what the last N chunks predicted for that moment (a
temporal ensemble of the gripper only; the arm is the newest chunk's, as guided RTC made it).

    python docs/benchmarks/place_stages/gripper_ensemble.py N SIM-POLICY-ARGUMENTS...
"""

import argparse
import sys

import numpy as np

from oxygen_ros.tools.benches import sim_policy


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


def ensembled_sources(chunks: int):
    """sim_policy.make_source, its chunks' gripper column averaged over ``chunks`` chunks."""
    make_source = sim_policy.make_source

    def make(args):
        source = make_source(args)
        chunk, start = source.chunk, source.start
        history: list[np.ndarray] = []  # raw gripper columns, newest first

        def start_episode(sim, seed):
            history.clear()
            return start(sim, seed)

        def ensembled_chunk(sim, observation):
            result = chunk(sim, observation)
            raw = result.actions[:, -1].copy()
            result.actions[:, -1] = ensembled(raw, history[: chunks - 1])
            history.insert(0, raw)
            del history[chunks:]
            return result

        source.chunk, source.start = ensembled_chunk, start_episode
        return source

    return make


if __name__ == "__main__":
    sim_policy.make_source = ensembled_sources(int(sys.argv[1]))
    parser = argparse.ArgumentParser()
    sim_policy.add_arguments(parser)
    sim_policy.run(parser.parse_args(sys.argv[2:]))
