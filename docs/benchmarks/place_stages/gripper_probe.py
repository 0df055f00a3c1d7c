"""`oxygen-bench sim-policy` recording the gripper a policy plans while it holds the cube low over
its pad: per frame, the layout's seed, the cube's bottom above the pad, its offset from the pad's
centre (the larger of the two edges') and the chunk's gripper column, as JSON lines in $PROBE_OUT.

    PROBE_OUT=gripper.jsonl python docs/benchmarks/place_stages/gripper_probe.py SIM-POLICY-ARGS...
"""

import json
import os
import sys

import numpy as np
from patched_bench import run

from oxygen_ros.sim.scene import CUBE_SIZE, PAD_THICKNESS
from oxygen_ros.tools.benches import sim_policy

LOW_M, NEAR_M = 0.02, 0.045  # record frames with the cube this low and this near the pad's centre


def probed_sources(out) -> None:
    """Patch sim-policy's chunk sources to write each low-over-the-pad frame to ``out``."""
    make_source = sim_policy.make_source

    def make(args):
        source = make_source(args)
        chunk = source.chunk

        def probed(sim, observation):
            result = chunk(sim, observation)
            state, task = sim.privileged_state(), sim.step_task
            if task.kind == "place" and state.grasped == task.cube:
                cube = state.cubes[task.cube]
                above = float(cube[2] - CUBE_SIZE / 2 - PAD_THICKNESS)
                off = float(np.max(np.abs(cube[:2] - np.array(state.pads[task.pad]))))
                if above < LOW_M and off < NEAR_M:
                    gripper = [round(float(g), 3) for g in result.actions[:, -1]]
                    row = {"seed": int(sim.seed), "t": round(sim.now_s, 2), "above": above}
                    out.write(json.dumps({**row, "off": off, "gripper": gripper}) + "\n")
            return result

        source.chunk = probed
        return source

    sim_policy.make_source = make


if __name__ == "__main__":
    with open(os.environ["PROBE_OUT"], "w") as out:
        probed_sources(out)
        run(sys.argv[1:])
