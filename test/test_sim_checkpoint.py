"""The shipped sim checkpoint (models/sim_so101): pi0.5 trained here on the simulated SO-101 arm.

It loads through `load_policy` unchanged, declares training-time RTC, and given an observation
rendered by the simulation itself (no ROS) returns finite actions inside the joints' ranges.
Closed-loop success over DDS is the closed-loop bench's to measure.
"""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco's first import, as oxygen_ros.sim does

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from oxygen_ros.engine.runtime import ModelSpec, load_policy  # noqa: E402
from oxygen_ros.policy_io.prompts import SubtaskText, resolve_format  # noqa: E402
from oxygen_ros.sim import questions as qa  # noqa: E402
from oxygen_ros.sim.episode import Simulation  # noqa: E402
from oxygen_ros.sim.grounding import HELDOUT_SEED0, VIEWS, render_scenes  # noqa: E402
from oxygen_ros.sim.scene import ARM_JOINTS, GRIPPER_JOINT, JOINT_RANGES  # noqa: E402
from oxygen_ros.sim.tasks import parse_task  # noqa: E402
from oxygen_ros.training.grounding import GroundingBatchMaker, probe  # noqa: E402

CHECKPOINT = Path(__file__).resolve().parents[1] / "models" / "sim_so101"
CAMERAS = ("scene", "wrist")
IMAGE_SIZE = 128  # the sim node's image_width / image_height
MARGIN = 0.05  # rad (arm) / opening (gripper): a sampled chunk may overshoot the data slightly


PROBE_SEED0 = HELDOUT_SEED0 + 700_000  # held-out layouts no training run or bench draws
PROBE_LAYOUTS = 16  # each seen at the start pose and 4 moments of a view's episode
# what the shipped checkpoint answers right on those scenes at least: a little under what it
# measured (start/where 1.00, along/where 0.91, start/all_cubes 0.94, along/all_cubes 0.69,
# along/subtask 0.66; 0.74 and 0.69 on the scenes of the expert before it started down from
# wherever the tip is over its spot: other moments, the same weights), so a worse checkpoint
# fails; the targets (where and subtask 0.95, all_cubes 0.9 at both poses) are met at the start
# pose only (docs/closed_loop.md)
PROBE_FLOORS = {
    "start/where": 0.95,
    "along/where": 0.88,
    "start/all_cubes": 0.9,
    "along/all_cubes": 0.65,
    "start/subtask": 0.9,
    "along/subtask": 0.6,
}


@pytest.fixture(scope="module")
def policy():
    return load_policy(ModelSpec(checkpoint_dir=str(CHECKPOINT)))


@pytest.fixture(scope="module")
def heldout_questions(policy) -> GroundingBatchMaker:
    scenes = render_scenes(PROBE_SEED0, PROBE_LAYOUTS, 5, views=VIEWS)
    return GroundingBatchMaker.for_policy(policy, scenes, resolve_format("openpi_subtask"))


def test_the_subtask_question_is_the_prompt_the_node_decodes_its_subtask_in(
    policy, heldout_questions
):
    maker, fmt = heldout_questions, resolve_format("openpi_subtask")
    for row in (0, 1, len(maker.scenes) - 1):
        question = [q for q in maker.questions(row) if q.kind == qa.SUBTASK][0]
        layout = maker.layout(row, question)
        subtask = SubtaskText(tuple(policy.tokenizer.encode_text(question.answer)), question.answer)
        state, task = maker.scenes.state[row], maker.scenes.tasks[row]
        node = policy.frame_prompt(state, task, fmt, True, subtask)
        assert layout.ids == list(node.ids)
        # supervised: what the node's subtask request generates on the frame's shared prefix
        first = layout.supervised.index(True)
        assert first == node.shared


def test_the_shipped_backbone_answers_held_out_scenes_at_every_pose(policy, heldout_questions):
    result = probe(policy.model, heldout_questions)
    low = {k: round(result[k], 3) for k, floor in PROBE_FLOORS.items() if result[k] < floor}
    assert not low, (low, {k: round(result[k], 3) for k in PROBE_FLOORS})


def test_loads_unchanged_with_training_time_rtc(policy):
    assert policy.rtc_training_max_delay > 0
    assert policy.image_slots == tuple(f"observation.images.{c}" for c in CAMERAS)
    assert policy.action_dim == 6 and policy.state_dim == 6
    assert policy.config.vision.image_size == IMAGE_SIZE


@pytest.mark.parametrize("task", ["touch the red cube", "put the blue cube on the green pad"])
def test_rendered_sim_observation_gives_actions_in_joint_ranges(policy, task):
    sim = Simulation()
    try:
        sim.reset(parse_task(task), seed=3)
        for _ in range(5):
            sim.control_step()
        world = sim.world
        state = np.array([*world.arm_positions(), world.gripper_opening()])
        images = {c: world.render(c, IMAGE_SIZE, IMAGE_SIZE) for c in CAMERAS}
    finally:
        sim.world.close()
    prompt = policy.frame_prompt(state, task, resolve_format("openpi_subtask"))
    inputs = policy.encode(images, state, task, prompt)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        prefix = policy.model.prefill(
            inputs.images,
            inputs.image_masks,
            inputs.tokens,
            inputs.token_masks,
            inputs.token_causal,
        )
        noise = torch.randn(
            1, policy.config.action_horizon, policy.config.action_dim, generator=generator
        )
        chunk = policy.model.sample_actions(prefix, noise, policy.num_steps or 10)
    actions = policy.robot_actions(chunk[0], state)
    assert actions.shape == (policy.published_horizon, 6)
    assert np.isfinite(actions).all()
    for j, name in enumerate(ARM_JOINTS):
        low, high = JOINT_RANGES[name]
        assert (actions[:, j] >= low - MARGIN).all() and (actions[:, j] <= high + MARGIN).all(), (
            name
        )
    gripper = actions[:, len(ARM_JOINTS)]
    assert ((gripper >= -MARGIN) & (gripper <= 1 + MARGIN)).all(), GRIPPER_JOINT


def test_sim_policy_bench_drives_the_sim_with_trajectories_the_controllers_accept(tmp_path):
    import argparse
    import json

    from oxygen_ros.tools.benches import sim_policy

    parser = argparse.ArgumentParser()
    sim_policy.add_arguments(parser)
    out = tmp_path / "sp.json"
    args = parser.parse_args(
        [
            "--checkpoint",
            str(CHECKPOINT),
            "--episodes",
            "2",
            "--timeout-s",
            "1.5",
            "--json",
            str(out),
        ]
    )
    result = sim_policy.run(args)
    assert json.loads(out.read_text())["episodes"] == 2
    ends = ("success", "timeout", "wrong_cube")
    assert [run["status"] in ends for run in result["runs"]] == [True, True]
    assert all(run["rejected"] == {} for run in result["runs"])
    # the policy moves the arm towards the named cube
    assert all(
        run["closest_tip_to_cube_m"] < run["start_tip_to_cube_m"] - 0.05 for run in result["runs"]
    ), result["runs"]
    assert 0 <= result["successes"] <= 2 and result["ci95"][0] <= result["success_rate"]


def test_heading_correlation_of_first_chunks():
    from oxygen_ros.tools.benches.sim_policy import heading_correlation

    def episodes(pans, azimuths):
        return [
            {"first_chunk_pan_rad": p, "cube_azimuth_rad": a}
            for p, a in zip(pans, azimuths, strict=True)
        ]

    azimuths = [-0.6, -0.1, 0.3, 0.7]
    assert heading_correlation(episodes([0.8 * a for a in azimuths], azimuths)) == pytest.approx(1)
    assert heading_correlation(episodes([0.1, 0.1, 0.1, 0.1], azimuths)) != heading_correlation(
        episodes([0.1, 0.1, 0.1, 0.1], azimuths)
    )  # nan: a policy that always heads the same way has no correlation to report
    assert np.isnan(heading_correlation(episodes([0.1, 0.2], azimuths[:2])))
