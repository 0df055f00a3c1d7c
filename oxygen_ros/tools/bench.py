"""``oxygen-bench``: measure the engines side by side, the model's parts, a paced real-time loop,
overload, and a long soak. Every subcommand prints a table; ``--json`` writes the numbers.

    oxygen-bench engines --preset small            # the paper's workload, all engines, one run
    oxygen-bench model --preset small              # prefill / denoise step / decode step ms
    oxygen-bench realtime --rate-hz 60             # OxyGen under a 60 Hz timer
    oxygen-bench overload --requests-per-frame 8   # KV exhausted: refusals, action latency
    oxygen-bench soak --frames 20000               # KV and RSS drift over a long run
    oxygen-bench soak --inject-faults              # ... a fault every 500 ticks, rotating stages
    oxygen-bench action --preset pi05 --device cuda --dtype bfloat16 --cuda-graphs
                                                   # prefill + chunk latency, 1/2/3 cameras
    oxygen-bench summary --dir OUT                 # combine action/engines/realtime JSON
    oxygen-bench continuity --preset small         # chunk switches: none/identity/vjp/trained
    oxygen-bench hierarchy --preset tiny           # subtasks: none vs per call vs in the slack
    oxygen-bench closed-loop --episodes 50 --json cl.json
                                                   # the sim arm through the node over DDS
    oxygen-bench sim-policy --episodes 100         # a checkpoint drives the sim directly
    oxygen-bench rtc-curve --plot rtc.png          # success vs delay per RTC mode (sim-policy)
    oxygen-bench serve --clients 1,2,4,8           # robots on one oxygen-serve vs one server each
    oxygen-bench faults --json faults.json         # stopped inputs, clock jumps: hold, resume
    oxygen-bench failover --json failover.json     # two oxygen-serve, the serving one dies

Robots: ``--robot droid|libero|aloha|generic`` wraps the random-weight model in that robot's openpi
transforms (policy_io/robots.py), as the node's ``robot`` parameter does: its state width and state
transform, the state in the prompt or not, its action width and output transform, its camera
slots and trained horizon (``aloha`` needs 14 action dims: ``--preset small`` or larger).

GPU fast path: ``--static-shapes`` runs the fixed-shape steps (engine/static_paths.py),
``--cuda-graphs`` captures them in CUDA graphs, ``--gpu-preprocess`` resizes images on the device,
``--init device`` draws random weights on the device (seconds for pi05). scripts/gpu_bench.sh runs
the whole GPU measurement.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from oxygen_ros.tools.benches import (
    action,
    closed_loop,
    continuity,
    engines,
    failover,
    faults,
    hierarchy,
    model,
    overload,
    realtime,
    rtc_curve,
    serve,
    sim_policy,
    soak,
    summary,
)

# subcommand -> its bench module, in --help order
BENCHES = {
    "engines": engines,
    "model": model,
    "realtime": realtime,
    "overload": overload,
    "soak": soak,
    "action": action,
    "continuity": continuity,
    "hierarchy": hierarchy,
    "summary": summary,
    "closed-loop": closed_loop,
    "sim-policy": sim_policy,
    "rtc-curve": rtc_curve,
    "serve": serve,
    "faults": faults,
    "failover": failover,
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="oxygen-bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command")
    for name, bench in BENCHES.items():
        bench.add_arguments(sub.add_parser(name, help=bench.HELP))
    args = parser.parse_args(argv)
    if args.command is None:
        args = parser.parse_args(["engines", *(argv or [])])
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    BENCHES[args.command].run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
