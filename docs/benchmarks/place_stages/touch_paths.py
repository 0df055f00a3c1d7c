"""`oxygen-bench sim-policy --tasks touch` with, per episode, the closest the policy's tip came
(across the table) to a cube other than the task's while low (below the cubes' top + 4 cm, the
episode still running), and the scripted expert's closest on the same layout, as JSON lines in
$PROBE_OUT (``who``: policy or expert, ``seed``, ``status``, ``min_neighbour_m``).

    PROBE_OUT=paths.jsonl python docs/benchmarks/place_stages/touch_paths.py SIM-POLICY-ARGS...
"""

import json
import os
import sys

import numpy as np
from patched_bench import run

from oxygen_ros.sim.headless import drive_expert
from oxygen_ros.sim.scene import CUBE_SIZE
from oxygen_ros.tools.benches import sim_policy

LOW_M = CUBE_SIZE + 0.04  # the tip this low is where a hand can graze a cube


def closest_neighbours(sim, task, closest: dict[str, float]) -> None:
    """Update ``closest`` (colour -> metres) with the tip's distance to the other cubes now."""
    if sim.status != "running":
        return
    state = sim.privileged_state()
    if state.tip[2] > LOW_M:
        return
    for colour, centre in state.cubes.items():
        if colour != task.cube:
            distance = float(np.hypot(*(state.tip[:2] - centre[:2])))
            closest[colour] = min(closest.get(colour, np.inf), distance)


def line(who: str, seed: int, status: str, closest: dict[str, float]) -> str:
    nearest = min(closest.values()) if closest else None
    return json.dumps({"who": who, "seed": seed, "status": status, "min_neighbour_m": nearest})


def probed_episodes(out) -> None:
    """Patch sim-policy's episodes to follow the tip, then run the expert on the same layout."""
    run_episode = sim_policy.run_episode

    def probed(sim, source, task, seed, *args, **kwargs):
        closest: dict[str, float] = {}
        control_step = sim.control_step

        def step() -> None:
            control_step()
            closest_neighbours(sim, task, closest)

        sim.control_step = step
        try:
            record = run_episode(sim, source, task, seed, *args, **kwargs)
        finally:
            sim.control_step = control_step
        out.write(line("policy", seed, record["status"], closest) + "\n")
        sim.reset(task, seed)
        expert: dict[str, float] = {}
        for _ in drive_expert(sim):
            closest_neighbours(sim, task, expert)
        out.write(line("expert", seed, sim.status, expert) + "\n")
        return record

    sim_policy.run_episode = probed


if __name__ == "__main__":
    with open(os.environ["PROBE_OUT"], "w") as out:
        probed_episodes(out)
        run(sys.argv[1:])
