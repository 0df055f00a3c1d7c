"""What the scripts beside this file share: `oxygen-bench sim-policy` run from a command line
after a patch, and a chunk source whose chunks a per-episode function rewrites."""

import argparse
from collections.abc import Callable, Sequence

import numpy as np

from oxygen_ros.tools.benches import sim_policy

Rewrite = Callable[[np.ndarray], None]  # rewrites one chunk's actions [steps, joints] in place


def run(argv: Sequence[str]) -> None:
    """`oxygen-bench sim-policy ARGV...` with whatever the caller patched."""
    parser = argparse.ArgumentParser()
    sim_policy.add_arguments(parser)
    sim_policy.run(parser.parse_args(argv))


def rewrite_chunks(new_episode: Callable[[], Rewrite]) -> None:
    """Patch sim-policy's chunk sources: each episode gets a fresh rewrite from ``new_episode``,
    applied to every chunk before it reaches the controllers."""
    make_source = sim_policy.make_source

    def make(args):
        source = make_source(args)
        chunk, start = source.chunk, source.start
        rewrite: Rewrite | None = None  # the current episode's

        def start_episode(sim, seed):
            nonlocal rewrite
            rewrite = new_episode()
            return start(sim, seed)

        def rewritten(sim, observation):
            result = chunk(sim, observation)
            rewrite(result.actions)
            return result

        source.chunk, source.start = rewritten, start_episode
        return source

    sim_policy.make_source = make
