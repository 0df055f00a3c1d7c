"""oxygen-sim-dataset: training data rendered from the simulated arm, without ROS.

    oxygen-sim-dataset demos --out data/sim_demos --touch 1200 --place 800 [--two-step 200] \\
        [--perturbed-share 0.3 --perturbation-rad 0.02] [--touch-seed 1000000 --place-seed 2000000]
    oxygen-sim-dataset grounding --out data/grounding.npz --layouts 2500 [--seed 3000000] \\
        [--poses 5 --views along dart off_course --workers 2]
    oxygen-sim-dataset on-policy --out data/on_policy --checkpoint models/sim_so101 --place 150 \\
        [--touch 0 --two-step 0 --seed 5000000 --labels takeover] \\
        [--subtask oracle --continuity guided --gripper-commit]

``demos``: expert demonstrations straight into a LeRobotDataset, the same features as
``oxygen-collect`` + ``oxygen-bag-to-lerobot`` with ``config/sim_dataset.yaml``
(``config/sim_dataset_perturbed.yaml`` for perturbed episodes: the action is the clean plan), in
one process: thousands of episodes in minutes (:mod:`oxygen_ros.sim.recording`). Episode ``i`` of
a kind has seed ``SEED + i``, its task drawn from the seed as ``oxygen-collect --kind`` draws it;
only successful episodes are written. ``--two-step N`` adds two-step episodes ("put the red cube
on the green pad, then touch the blue cube" and "..., then put the blue cube on the blue pad",
either form drawn per seed) from their own seeds (``--two-step-seed``, 4,000,000) with their own
timeout (``--two-step-timeout-s``).

``grounding``: scenes for ``oxygen-train --grounding`` (:mod:`oxygen_ros.sim.grounding`): each
layout at the start pose and at moments along an expert episode, both cameras, with the sim's
state for the questions' answers. Training seeds from 3,000,000, the probe's from 9,000,000.

``on-policy``: a checkpoint drives the episodes as ``oxygen-bench sim-policy`` drives them (each
frame's chunk sent at once, conditioned as ``--subtask`` says, continued as ``--continuity``
says) and the scripted expert labels them (DAgger, :mod:`oxygen_ros.sim.on_policy`): with
``--labels takeover`` (the default) it takes over at a time drawn per episode and drives to the
end, recorded, successes written; with ``--labels per_frame`` every frame of the policy's episode
is labelled with the plan it would make there, every episode written. The same features as
``demos``. Touch episodes' seeds from ``--seed``, place's from ``--seed`` + 500,000, two-step's from
``--seed`` + 800,000 (default 5,000,000: apart from the demonstrations', the grounding scenes' and
the benches' seeds); timeouts as sim-policy's (8, 20 and 30 sim s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from oxygen_ros.tools.cli import positive_float, positive_int

DEFAULT_TOUCH_SEED = 1_000_000  # apart from the benches' 777000+ and the grounding seeds
DEFAULT_PLACE_SEED = 2_000_000
DEFAULT_TWO_STEP_SEED = 4_000_000  # apart from the grounding seeds (3,000,000..)
DEFAULT_TWO_STEP_TIMEOUT_S = 30.0  # two places take the expert ~10 sim s
DEFAULT_GROUNDING_SEED = 3_000_000  # = oxygen_ros.sim.grounding.TRAIN_SEED0 (tested)
DEFAULT_ON_POLICY_SEED = 5_000_000
ON_POLICY_PLACE_OFFSET = 500_000  # place episodes' seeds past the touch episodes'
ON_POLICY_TWO_STEP_OFFSET = 800_000  # two-step episodes' seeds past the place episodes'


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="oxygen-sim-dataset", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demos = commands.add_parser("demos", help="expert demonstrations as a LeRobotDataset")
    demos.add_argument("--out", type=Path, required=True, help="dataset folder to create")
    demos.add_argument("--touch", type=int, default=100, help="touch episodes to run")
    demos.add_argument("--place", type=int, default=0, help="place episodes to run")
    demos.add_argument(
        "--two-step", type=int, default=0, help="two-step episodes to run (a place, then another)"
    )
    demos.add_argument("--touch-seed", type=int, default=DEFAULT_TOUCH_SEED)
    demos.add_argument("--place-seed", type=int, default=DEFAULT_PLACE_SEED)
    demos.add_argument("--two-step-seed", type=int, default=DEFAULT_TWO_STEP_SEED)
    demos.add_argument(
        "--two-step-timeout-s",
        type=positive_float,
        default=DEFAULT_TWO_STEP_TIMEOUT_S,
        help="sim seconds before a two-step episode fails",
    )
    demos.add_argument(
        "--perturbed-share",
        type=float,
        default=0.0,
        help="share of episodes whose executed arm plan drifts (DART; the label stays clean)",
    )
    demos.add_argument("--perturbation-rad", type=float, default=0.02)
    demos.add_argument(
        "--touch-settle-s",
        type=float,
        default=0.0,
        help="touch episodes go on this long past the touch, the expert finishing its reach to "
        "its goal (1.7 cm above the cube's centre) and holding there; labels stay the reach's",
    )
    demos.add_argument(
        "--timeout-s", type=positive_float, default=12.0, help="sim seconds before an episode fails"
    )
    scenes = commands.add_parser("grounding", help="grounding scenes (.npz) for oxygen-train")
    scenes.add_argument("--out", type=Path, required=True, help=".npz file to write")
    scenes.add_argument("--layouts", type=positive_int, required=True)
    scenes.add_argument("--seed", type=int, default=DEFAULT_GROUNDING_SEED, help="first seed")
    scenes.add_argument("--poses", type=positive_int, default=3, help="views per layout")
    scenes.add_argument(
        "--views",
        nargs="+",
        default=["along"],
        metavar="VIEW",
        help="how the arm moves past the start pose, one drawn per layout: along (the expert), "
        "dart (the expert drifting), off_course (the expert heading for another cube)",
    )
    scenes.add_argument(
        "--workers", type=positive_int, default=1, help="rendering processes (one core each)"
    )
    on_policy = commands.add_parser(
        "on-policy", help="episodes a checkpoint drives, labelled by the expert (DAgger)"
    )
    on_policy.add_argument("--out", type=Path, required=True, help="dataset folder to create")
    on_policy.add_argument("--checkpoint", type=Path, required=True, help="the driving policy")
    on_policy.add_argument("--touch", type=int, default=0, help="touch episodes to run")
    on_policy.add_argument("--place", type=int, default=0, help="place episodes to run")
    on_policy.add_argument(
        "--two-step", type=int, default=0, help="two-step episodes to run (a place, then another)"
    )
    on_policy.add_argument("--seed", type=int, default=DEFAULT_ON_POLICY_SEED, help="first seed")
    on_policy.add_argument(
        "--subtask",
        default="oracle",
        choices=("flat", "oracle", "predicted"),
        help="what conditions the policy's chunks (as sim-policy's --subtask)",
    )
    on_policy.add_argument(
        "--continuity",
        default="guided",
        choices=("none", "guided", "trained"),
        help="each chunk continues the executed one (as sim-policy's --continuity)",
    )
    on_policy.add_argument(
        "--labels",
        choices=("takeover", "per_frame"),
        default="takeover",
        help="takeover: the expert drives from a time drawn per episode, recorded (its own "
        "chunks); per_frame: the policy drives throughout, every frame labelled with the "
        "expert's plan (teaches chunked policies to hesitate)",
    )
    on_policy.add_argument("--prompt-format", default="openpi_subtask")
    on_policy.add_argument(
        "--gripper-commit",
        action="store_true",
        help="the policy drives with its planned gripper switches kept (sim-policy's flag)",
    )
    on_policy.add_argument("--num-steps", type=positive_int, default=10, help="flow steps")
    on_policy.add_argument("--threads", type=positive_int, default=1, help="torch CPU threads")
    args = parser.parse_args(argv)
    if args.command in ("demos", "on-policy"):
        counts = (args.touch, args.place, getattr(args, "two_step", 0))
        if min(counts) < 0 or sum(counts) == 0:
            parser.error("the episode counts must be >= 0 and not all 0")
    return args


def write_demos(args: argparse.Namespace) -> dict:
    from oxygen_ros.sim.episode import Simulation
    from oxygen_ros.sim.recording import demonstration_specs, write_demonstrations

    specs = demonstration_specs(
        "touch",
        args.touch_seed,
        args.touch,
        args.perturbed_share,
        args.perturbation_rad,
        args.touch_settle_s,
    ) + demonstration_specs(
        "place", args.place_seed, args.place, args.perturbed_share, args.perturbation_rad
    )
    specs += demonstration_specs(
        "two_step",
        args.two_step_seed,
        args.two_step,
        args.perturbed_share,
        args.perturbation_rad,
        timeout_s=args.two_step_timeout_s,
    )

    def progress(report) -> None:
        done = report.episodes + len(report.failed)
        if done % 100 == 0:
            print(f"{done}/{len(specs)} episodes, {report.frames} frames", flush=True)

    sim = Simulation(episode_timeout_s=args.timeout_s)
    try:
        report = write_demonstrations(args.out, specs, sim, progress)
    finally:
        sim.world.close()
    return {
        "episodes": report.episodes,
        "frames": report.frames,
        "failed": len(report.failed),
        "failed_seeds": [(s.kind, s.seed, s.perturbation_rad) for s in report.failed],
    }


def write_on_policy(args: argparse.Namespace) -> dict:
    from oxygen_ros.sim.episode import SUCCESS, Simulation
    from oxygen_ros.sim.on_policy import record_on_policy_episode
    from oxygen_ros.sim.recording import FPS, EpisodeSpec, write_demonstrations
    from oxygen_ros.tools.benches.sim_policy import (
        TIMEOUT_S,
        PolicyDriver,
        bench_arguments,
        make_source,
    )

    bench_args = bench_arguments(
        **vars(args),
        subtask_every=1,
        subtask_confirmations=1,
        rtc_guidance_weight=5.0,
        delay_steps=0,
        execute_steps=0,
        action_dt=1.0 / FPS,
    )
    driver = PolicyDriver(make_source(bench_args), 1.0 / FPS)
    place_seed = args.seed + ON_POLICY_PLACE_OFFSET
    specs = [
        EpisodeSpec(kind, seed0 + i, timeout_s=TIMEOUT_S[kind])  # sim-policy's episodes
        for kind, seed0, count in (
            ("touch", args.seed, args.touch),
            ("place", place_seed, args.place),
            ("two_step", args.seed + ON_POLICY_TWO_STEP_OFFSET, args.two_step),
        )
        for i in range(count)
    ]

    ran = {"episodes": 0, "succeeded": 0}

    def record(sim, spec):
        episode = record_on_policy_episode(sim, spec, driver, args.labels)
        ran["episodes"] += 1
        ran["succeeded"] += episode.status == SUCCESS
        return episode

    def progress(report) -> None:
        if ran["episodes"] % 10 == 0:
            print(
                f"{ran['episodes']}/{len(specs)} episodes ({ran['succeeded']} succeeded), "
                f"{report.episodes} written, {report.frames} frames",
                flush=True,
            )

    sim = Simulation()
    keep_failures = args.labels == "per_frame"  # a takeover keeps, as demonstrations do, successes
    try:
        report = write_demonstrations(
            args.out, specs, sim, progress, record, keep_failures=keep_failures
        )
    finally:
        sim.world.close()
    return {
        "episodes": ran["episodes"],
        "succeeded": ran["succeeded"],
        "written": report.episodes,
        "frames": report.frames,
        "labels": args.labels,
        "checkpoint": str(args.checkpoint),
        "subtask": args.subtask,
        "continuity": args.continuity,
    }


def write_grounding(args: argparse.Namespace) -> dict:
    from oxygen_ros.sim.grounding import render_scenes

    scenes = render_scenes(
        args.seed, args.layouts, args.poses, tuple(args.views), workers=args.workers
    )
    scenes.save(args.out)
    views = {view: scenes.views.count(view) for view in sorted(set(scenes.views))}
    return {"layouts": args.layouts, "scenes": len(scenes), "views": views}


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("MUJOCO_GL", "egl")
    args = _parse_args(argv)
    started = time.perf_counter()
    try:
        write = {"demos": write_demos, "grounding": write_grounding, "on-policy": write_on_policy}
        summary = write[args.command](args)
    except ValueError as exc:
        print(f"oxygen-sim-dataset: {exc}", file=sys.stderr)
        return 2
    summary = {"out": str(args.out), **summary, "seconds": round(time.perf_counter() - started, 1)}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
