"""``oxygen-bench sim-policy``: a checkpoint drives the simulated arm directly, with no ROS and no
node in between: many episodes quickly, to compare checkpoints (``closed-loop`` measures the
node).

Every ``action_dt`` of sim time the policy sees both cameras (rendered at the sim node's 128 px)
and the joint state, samples a chunk with the flat prompt of ``--prompt-format``, and the chunk
goes to the sim's two controllers the way the node sends it: point ``i`` due ``(i + 1) *
action_dt`` after the observation, the five arm joints and the gripper on their own trajectories.
Inference takes no sim time (the sim waits for it), so this is the policy at zero delay; its
tasks and layouts are ``closed-loop``'s rounds for the same ``--seed``.

Grounding: the arm starts every episode at the same pose, so the first chunk can only head for the
named cube if the policy found it in the images. ``heading_correlation`` is the correlation, over
episodes, of the first chunk's last ``shoulder_pan`` with the cube's azimuth from the base (the
scripted expert's 1 s pan: 0.99); a policy that ignores the images scores about 0.
``--probe-layouts N`` also asks the checkpoint the grounding questions
(`oxygen_ros.sim.grounding`) about N held-out layouts (seeds from 9,000,000, never trained on),
laid out as the node's Ask request, and reports the share answered exactly, per question kind.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oxygen_ros.tools.benches.closed_loop import round_task
from oxygen_ros.tools.benches.closed_loop_metrics import mean_or_nan, wilson_interval
from oxygen_ros.tools.benches.common import print_table, write_json

HELP = "a checkpoint drives the sim directly (no ROS): success over many episodes"
CAMERA_PX = 128  # the sim node's default image size
SLOTS = {"scene": "observation.images.scene", "wrist": "observation.images.wrist"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--checkpoint", type=Path, default=Path("models/sim_so101"), help="default models/sim_so101"
    )
    parser.add_argument("--episodes", type=int, default=50)
    parser.add_argument("--tasks", default="touch", choices=["touch", "place"])
    parser.add_argument("--seed", type=int, default=777, help="closed-loop's round seed")
    parser.add_argument("--timeout-s", type=float, default=20.0, help="sim seconds per episode")
    parser.add_argument("--action-dt", type=float, default=0.1, help="the dataset's 1/fps")
    parser.add_argument("--prompt-format", default="openpi_subtask")
    parser.add_argument("--num-steps", type=int, default=10, help="flow-matching steps")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument(
        "--probe-layouts",
        type=int,
        default=0,
        help="also ask the grounding questions about this many held-out layouts (0: no probe)",
    )
    parser.add_argument("--json", type=Path, help="write every episode and the summary here")


class DirectPolicy:
    """A loaded checkpoint turning one observation into the two controllers' trajectories."""

    def __init__(self, args: argparse.Namespace) -> None:
        from oxygen_ros.policy_io.policy import load_policy
        from oxygen_ros.policy_io.prompts import resolve_format

        torch.set_num_threads(args.threads)
        self.policy = load_policy(args.checkpoint)
        self.format = resolve_format(args.prompt_format)
        self.num_steps = args.num_steps
        self.action_dt = args.action_dt
        self.noise = torch.Generator().manual_seed(args.seed)

    def trajectories(self, images: dict[str, np.ndarray], state: np.ndarray, task: str, now_s):
        """(arm, gripper) JointTrajectory messages of the chunk for this observation."""
        from oxygen_ros.ros.convert import chunk_to_joint_trajectory, seconds_to_stamp
        from oxygen_ros.sim.scene import ARM_JOINTS, GRIPPER_JOINT

        policy, model = self.policy, self.policy.model
        inputs = policy.encode(images, state, task, policy.frame_prompt(state, task, self.format))
        prefix = model.prefill(
            inputs.images, inputs.image_masks, inputs.tokens, inputs.token_masks,
            inputs.token_causal,
        )  # fmt: skip
        shape = (1, policy.config.action_horizon, policy.config.action_dim)
        chunk = model.sample_actions(
            prefix, torch.randn(shape, generator=self.noise), self.num_steps
        )
        actions = policy.robot_actions(chunk[0], state)
        stamp = seconds_to_stamp(now_s)
        arm = len(ARM_JOINTS)
        return (
            chunk_to_joint_trajectory(actions[:, :arm], ARM_JOINTS, self.action_dt, stamp),
            chunk_to_joint_trajectory(actions[:, arm:], [GRIPPER_JOINT], self.action_dt, stamp),
        )


def run_episode(sim, driver: DirectPolicy, task, seed: int) -> dict[str, Any]:
    """One episode: its status, the closest the tip came to the task's cube, and the
    trajectories the controllers refused (per controller/reason)."""
    from oxygen_ros.sim.episode import ARM_CONTROLLER, GRIPPER_CONTROLLER, RUNNING

    sim.reset(task, seed)
    world = sim.world
    start = sim.facts().tip_to_cube
    steps_per_frame = max(1, round(driver.action_dt / sim.control_dt))
    closest, step, started = np.inf, 0, time.perf_counter()
    cube = world.cube_position(task.cube)
    first_pan = None
    while sim.status == RUNNING:
        if step % steps_per_frame == 0:
            state = np.append(world.arm_positions(), world.gripper_opening()).astype(np.float32)
            images = {
                slot: world.render(camera, CAMERA_PX, CAMERA_PX) for camera, slot in SLOTS.items()
            }
            arm, gripper = driver.trajectories(images, state, task.text, sim.now_s)
            if first_pan is None:
                first_pan = float(arm.points[-1].positions[0])
            sim.receive(ARM_CONTROLLER, arm)
            sim.receive(GRIPPER_CONTROLLER, gripper)
        sim.control_step()
        step += 1
        closest = min(closest, sim.facts().tip_to_cube)
    return {
        "task": task.text,
        "seed": seed,
        "status": sim.status,
        "sim_s": round(sim.elapsed_s, 3),
        "start_tip_to_cube_m": round(float(start), 4),
        "closest_tip_to_cube_m": round(float(closest), 4),
        "rejected": sim.episode_report()["rejected"],
        "first_chunk_pan_rad": round(first_pan, 4),
        "cube_azimuth_rad": round(float(np.arctan2(cube[1], cube[0])), 4),
        "wall_s": round(time.perf_counter() - started, 3),
    }


def summarise(episodes: list[dict[str, Any]]) -> dict[str, Any]:
    wins = [e for e in episodes if e["status"] == "success"]
    low, high = wilson_interval(len(wins), len(episodes))
    return {
        "episodes": len(episodes),
        "successes": len(wins),
        "success_rate": len(wins) / len(episodes) if episodes else float("nan"),
        "ci95": [low, high],
        "time_to_success_s": mean_or_nan([e["sim_s"] for e in wins]),
        "median_closest_tip_to_cube_m": float(
            np.median([e["closest_tip_to_cube_m"] for e in episodes])
        ),
        "heading_correlation": heading_correlation(episodes),
    }


def heading_correlation(episodes: list[dict[str, Any]]) -> float:
    """Correlation of the first chunks' final pan with the cubes' azimuths (nan under 3)."""
    pans = [e["first_chunk_pan_rad"] for e in episodes]
    azimuths = [e["cube_azimuth_rad"] for e in episodes]
    if len(episodes) < 3 or np.std(pans) == 0 or np.std(azimuths) == 0:
        return float("nan")
    return float(np.corrcoef(pans, azimuths)[0, 1])


def grounding_probe(policy, prompt_format: str, layouts: int) -> dict[str, float]:
    """The checkpoint's exact-answer share per question kind on ``layouts`` held-out layouts."""
    from oxygen_ros.policy_io.prompts import resolve_format
    from oxygen_ros.sim.grounding import HELDOUT_SEED0, render_scenes
    from oxygen_ros.training.grounding import GroundingBatchMaker, probe

    scenes = render_scenes(HELDOUT_SEED0, layouts)
    maker = GroundingBatchMaker(
        scenes,
        policy.model.config,
        policy.tokenizer,
        resolve_format(prompt_format),
        policy.prompt_state,
        policy.image_slots,
        policy.conventions.border,
    )
    return probe(policy.model, maker)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from oxygen_ros.sim.episode import Simulation

    if args.episodes < 1:
        raise SystemExit("oxygen-bench sim-policy: --episodes must be at least 1")
    driver = DirectPolicy(args)
    sim = Simulation(episode_timeout_s=args.timeout_s)
    episodes = []
    try:
        for index in range(args.episodes):
            task, seed = round_task(index, args.seed, args.tasks)
            episodes.append(run_episode(sim, driver, task, seed))
    finally:
        sim.world.close()
    summary = summarise(episodes)
    if args.probe_layouts > 0:
        summary["probe"] = grounding_probe(driver.policy, args.prompt_format, args.probe_layouts)
    low, high = summary["ci95"]
    print_table(
        [
            {
                "checkpoint": str(args.checkpoint),
                "tasks": args.tasks,
                "success": f"{summary['successes']}/{summary['episodes']} ({low:.2f}-{high:.2f})",
                "time to success s": f"{summary['time_to_success_s']:.2f}",
                "median closest m": f"{summary['median_closest_tip_to_cube_m']:.3f}",
                "heading corr": f"{summary['heading_correlation']:.2f}",
                "probe": f"{summary['probe']['all']:.3f}" if "probe" in summary else "-",
            }
        ],
        [
            "checkpoint",
            "tasks",
            "success",
            "time to success s",
            "median closest m",
            "heading corr",
            "probe",
        ],
    )
    if "probe" in summary:
        print("probe per question kind: " + json.dumps(summary["probe"]))
    result = {"bench": "sim-policy", "args": vars(args), **summary, "runs": episodes}
    write_json(args.json, result)
    return result
