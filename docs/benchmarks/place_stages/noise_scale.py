"""`oxygen-bench sim-policy` (flat, oracle, lying) with the flow's starting noise scaled by S:
S = 1 samples the policy's own action distribution, S < 1 narrows it towards its mode.

    python docs/benchmarks/place_stages/noise_scale.py S SIM-POLICY-ARGUMENTS...
"""

import sys

from patched_bench import run

from oxygen_ros.tools.benches import subtask_modes


def scaled_noise(scale: float):
    """subtask_modes.frame_noise, every draw multiplied by ``scale``."""
    frame_noise = subtask_modes.frame_noise
    return lambda *args, **kwargs: frame_noise(*args, **kwargs) * scale


if __name__ == "__main__":
    subtask_modes.frame_noise = scaled_noise(float(sys.argv[1]))
    run(sys.argv[2:])
