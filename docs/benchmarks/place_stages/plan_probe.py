"""`oxygen-bench sim-policy` recording where a policy plans to take a held cube over its pad: per
frame of the sim's release phase with the task's cube held, the cube's offset from the pad's centre
and its bottom's height above the pad now, and where the chunk's arm plan puts it after 1, 3, 5 and
10 steps (forward kinematics of the planned joints, the cube kept at its offset from the tip), as
JSON lines in $PROBE_OUT; `plan_stats.py` sums them up.

    PROBE_OUT=plan.jsonl python docs/benchmarks/place_stages/plan_probe.py SIM-POLICY-ARGS...
"""

import json
import os
import sys

import mujoco
import numpy as np
from patched_bench import run

from oxygen_ros.sim.scene import CUBE_SIZE, PAD_THICKNESS
from oxygen_ros.tools.benches import sim_policy

PLAN_STEPS = (1, 3, 5, 10)


def above_pad(point: np.ndarray, pad: np.ndarray) -> list[float]:
    """A cube centre as (x, y) from the pad's centre and its bottom's height above the pad."""
    return [
        round(float(point[0] - pad[0]), 4),
        round(float(point[1] - pad[1]), 4),
        round(float(point[2] - CUBE_SIZE / 2 - PAD_THICKNESS), 4),
    ]


def probed_sources(out) -> None:
    """Patch sim-policy's chunk sources to write each release-phase frame's plan to ``out``."""
    make_source = sim_policy.make_source

    def make(args):
        source = make_source(args)
        chunk = source.chunk
        scratch = {}  # one MjData for the forward kinematics

        def probed(sim, observation):
            result = chunk(sim, observation)
            state, task = sim.privileged_state(), sim.step_task
            releasing = sim.phase is not None and sim.phase.key == "release"
            if task.kind != "place" or not releasing or state.grasped != task.cube:
                return result
            world = sim.world
            data = scratch.setdefault("data", mujoco.MjData(world.model))
            cube, pad = state.cubes[task.cube], np.array(state.pads[task.pad])
            plan = {}
            for step in PLAN_STEPS:
                data.qpos[:] = world.data.qpos
                data.qpos[world._arm_qpos] = result.actions[step - 1, : len(world._arm_qpos)]
                mujoco.mj_kinematics(world.model, data)
                plan[step] = above_pad(data.site_xpos[world._tip] + (cube - state.tip), pad)
            row = {"seed": int(sim.seed), "t": round(state.time_s, 2), "now": above_pad(cube, pad)}
            gripper = [round(float(g), 2) for g in result.actions[:, -1]]
            out.write(json.dumps({**row, "plan": plan, "gripper": gripper}) + "\n")
            return result

        source.chunk = probed
        return source

    sim_policy.make_source = make


if __name__ == "__main__":
    with open(os.environ["PROBE_OUT"], "w") as out:
        probed_sources(out)
        run(sys.argv[1:])
