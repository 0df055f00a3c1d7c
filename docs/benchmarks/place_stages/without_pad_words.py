"""`oxygen-bench sim-policy` with the sim's carry subtask as it was before it named the pad's
place ("carry the red cube to the green pad"): the A/B of the pad's place words.

    python docs/benchmarks/place_stages/without_pad_words.py SIM-POLICY-ARGUMENTS...
"""

import argparse
import dataclasses
import sys

from oxygen_ros.sim import episode
from oxygen_ros.tools.benches import sim_policy

if __name__ == "__main__":
    facts = episode.Simulation.facts
    episode.Simulation.facts = lambda self: dataclasses.replace(facts(self), pad_place="")
    parser = argparse.ArgumentParser()
    sim_policy.add_arguments(parser)
    sim_policy.run(parser.parse_args(sys.argv[1:]))
