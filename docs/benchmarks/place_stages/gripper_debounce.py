"""`oxygen-bench sim-policy` with each chunk's gripper column debounced: the commanded gripper
changes side (open/closed at 0.5) only where N steps in a row say so; a step on the other side
is held at the current side's end (0 or 1). The state carries over from the chunk executed last.

    python docs/benchmarks/place_stages/gripper_debounce.py N SIM-POLICY-ARGUMENTS...
"""

import argparse
import sys

from oxygen_ros.tools.benches import sim_policy

SIDE = 0.5  # a gripper value above this is closed


def debounce(gripper, closed: bool, steps: int):
    """``gripper`` (one chunk's column) debounced from ``closed``."""
    out = gripper.copy()
    for k in range(len(gripper)):
        window = gripper[k : k + steps]
        if len(window) == steps and all((g > SIDE) != closed for g in window):
            closed = not closed
        if (gripper[k] > SIDE) != closed:
            out[k] = 1.0 if closed else 0.0
    return out


def debounced_sources(steps: int):
    """sim_policy.make_source, its chunks' gripper column debounced over ``steps``."""
    make_source = sim_policy.make_source

    def make(args):
        source = make_source(args)
        chunk, start = source.chunk, source.start
        state = {"closed": False}

        def start_episode(sim, seed):
            state["closed"] = False
            return start(sim, seed)

        def debounced_chunk(sim, observation):
            result = chunk(sim, observation)
            if steps > 1:
                result.actions[:, -1] = debounce(result.actions[:, -1], state["closed"], steps)
            state["closed"] = bool(result.actions[0, -1] > SIDE)
            return result

        source.chunk, source.start = debounced_chunk, start_episode
        return source

    return make


if __name__ == "__main__":
    sim_policy.make_source = debounced_sources(int(sys.argv[1]))
    parser = argparse.ArgumentParser()
    sim_policy.add_arguments(parser)
    sim_policy.run(parser.parse_args(sys.argv[2:]))
