"""`oxygen-bench sim-policy` with cameras blanked: each image named in $BLANK (scene, wrist or
both, comma-separated) replaced by a flat image of its own mean grey, every frame. What the
actions lose without a camera is what they took from it.

    BLANK=wrist python docs/benchmarks/place_stages/blank_cameras.py SIM-POLICY-ARGS...
"""

import os
import sys

import numpy as np
from patched_bench import run

from oxygen_ros.tools.benches import sim_policy

BLANKED = [sim_policy.SLOTS[camera] for camera in os.environ["BLANK"].split(",")]
_observe = sim_policy.observe


def observe(sim):
    observation = _observe(sim)
    for slot in BLANKED:
        image = observation.images[slot]
        observation.images[slot] = np.full_like(image, int(image.mean()))
    return observation


if __name__ == "__main__":
    sim_policy.observe = observe
    run(sys.argv[1:])
