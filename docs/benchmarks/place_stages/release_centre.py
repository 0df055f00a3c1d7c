"""`oxygen-bench sim-policy` with the sim's place task entering its release phase only once the
held cube's centre is within W metres of its pad's centre (Chebyshev; the sim enters it at the
pad's edge, 0.035 m); it is kept, as in the sim, until the cube is 1 cm back outside the pad.
Under `--subtask oracle` the carry's words then steer the cube towards the centre for longer.

    python docs/benchmarks/place_stages/release_centre.py W SIM-POLICY-ARGUMENTS...
"""

import dataclasses
import sys

from patched_bench import run

from oxygen_ros.sim import episode, language
from oxygen_ros.sim.scene import PAD_HALF
from oxygen_ros.sim.tasks import PLACE


def release_within(within: float):
    """language.current_phase, a held cube over the pad only within ``within`` of its centre."""
    current_phase = language.current_phase

    def phase(task, facts, previous=None):
        if task.kind == PLACE and facts.grasped == task.cube and previous != "release":
            if facts.cube_outside_pad > within - PAD_HALF:  # not yet within ``within``
                facts = dataclasses.replace(
                    facts, cube_outside_pad=max(facts.cube_outside_pad, 1e-6)
                )
        return current_phase(task, facts, previous)

    return phase


if __name__ == "__main__":
    episode.current_phase = release_within(float(sys.argv[1]))
    run(sys.argv[2:])
