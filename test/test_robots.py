"""Robot adapters, action spaces and the published command, checked against numbers worked out by
hand from openpi's transforms (../shared/OPENPI_ROBOTS.md), not from this code's output."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from builtin_interfaces.msg import Time

from oxygen_ros.checkpoints.core import build_model
from oxygen_ros.checkpoints.norm_stats import NormStats
from oxygen_ros.model.config import get_preset
from oxygen_ros.policy_io.policy import Pi05Policy, load_policy
from oxygen_ros.policy_io.robots import ROBOTS, robot_adapter
from oxygen_ros.policy_io.tokenizer import Pi05Tokenizer
from oxygen_ros.ros.commands import build_command
from oxygen_ros.ros.params import PARAMETERS, NodeSettings, SettingsError
from oxygen_ros.ros.safety import UnsafeChunkError

ROOT = Path(__file__).resolve().parents[1]
STAMP = Time(sec=12, nanosec=500)


def settings(**overrides) -> NodeSettings:
    values = {spec.name: spec.default for spec in PARAMETERS}
    values.update(overrides)
    return NodeSettings.from_values(values)


def seconds(duration) -> float:
    return duration.sec + duration.nanosec * 1e-9


# -- registry ------------------------------------------------------------------------------------


def test_registry_names_every_robot_and_refuses_unknown_ones():
    assert set(ROBOTS) == {"generic", "droid", "aloha", "libero"}
    with pytest.raises(ValueError, match="unknown robot 'ur5'.*generic, droid, aloha, libero"):
        robot_adapter("ur5")


def test_adapters_carry_the_checkpoint_facts():
    droid, aloha, libero = robot_adapter("droid"), robot_adapter("aloha"), robot_adapter("libero")
    assert (droid.state_dim, droid.action_dim, droid.action_horizon, droid.action_space) == (
        8,
        8,
        15,
        "velocity",
    )
    assert droid.gripper_dims == (7,) and droid.discrete_state_input
    assert dict(droid.cameras) == {
        "exterior_image_1_left": "base_0_rgb",
        "wrist_image_left": "left_wrist_0_rgb",
    }
    assert (aloha.state_dim, aloha.action_dim, aloha.action_horizon, aloha.action_space) == (
        14,
        14,
        50,
        "position",
    )
    assert dict(aloha.cameras) == {
        "cam_high": "base_0_rgb",
        "cam_left_wrist": "left_wrist_0_rgb",
        "cam_right_wrist": "right_wrist_0_rgb",
    }
    assert (libero.state_dim, libero.action_dim, libero.action_horizon) == (8, 7, 10)
    assert libero.action_space == "end_effector" and not libero.controls_joints
    assert not libero.discrete_state_input


# -- ALOHA by hand -------------------------------------------------------------------------------


def test_aloha_gripper_state_goes_to_pis_angle():
    # Gripper 1.0 (normalised linear): 1.0 * (0.05800 - 0.01844) + 0.01844 = 0.058 m;
    # (0.022^2 + 0.058^2 - 0.036^2) / (2 * 0.022 * 0.058) = 0.002552 / 0.002552 = 1 -> asin = pi/2;
    # normalised from [0.5476, 1.6296]: (1.570796 - 0.5476) / 1.082 = 0.945653.
    state = np.zeros(14)
    state[6] = 1.0
    state[13] = 1.0
    pi_state = robot_adapter("aloha").state_to_pi(state)
    assert pi_state[6] == pytest.approx(0.945653, abs=1e-6)
    assert pi_state[13] == pytest.approx(0.945653, abs=1e-6)


def test_aloha_state_joints_are_flipped():
    state = np.arange(1, 15, dtype=np.float64) / 10  # 0.1 .. 1.4
    pi_state = robot_adapter("aloha").state_to_pi(state)
    arm = [i for i in range(14) if i not in (6, 13)]
    expected = [0.1, -0.2, -0.3, 0.4, 0.5, 0.6, None, 0.8, -0.9, -1.0, 1.1, 1.2, 1.3, None]
    assert pi_state[arm].tolist() == pytest.approx([expected[i] for i in arm])


def test_aloha_gripper_action_from_pi():
    # (0.5 + 0.5476) normalised from [-0.6213, 1.4910]: (1.0476 + 0.6213) / 2.1123 = 0.790087.
    actions = np.zeros((1, 14))
    actions[0, 6] = 0.5
    actions[0, 13] = 0.5
    out = robot_adapter("aloha").actions_from_pi(actions, np.zeros(14))
    assert out[0, 6] == pytest.approx(0.790087, abs=1e-6)
    assert out[0, 13] == pytest.approx(0.790087, abs=1e-6)


def test_aloha_delta_arm_actions_are_made_absolute_then_flipped():
    # AbsoluteActions adds the flipped state: flip * (a + flip * s) = flip * a + s on the 12 arm
    # dims.
    state = np.full(14, 0.2)
    state[[6, 13]] = 0.5  # grippers: not deltas, so the state must not be added to them
    actions = np.full((2, 14), 0.05)
    actions[1] = 0.1
    adapter = robot_adapter("aloha")
    out = adapter.actions_from_pi(actions, adapter.state_to_pi(state))
    # joint 0 (flip +1): 0.2 + 0.05; joint 1 (flip -1): 0.2 - 0.05; right joint 8 (flip -1): 0.2 -
    # 0.1
    assert out[0, 0] == pytest.approx(0.25)
    assert out[0, 1] == pytest.approx(0.15)
    assert out[1, 8] == pytest.approx(0.1)
    assert out[1, 10] == pytest.approx(0.3)
    # gripper step 0: (0.05 + 0.5476 + 0.6213) / 2.1123, no state added
    assert out[0, 6] == pytest.approx((0.05 + 0.5476 + 0.6213) / 2.1123, abs=1e-9)


def test_generic_and_droid_pass_the_first_dims_through():
    actions = np.array([[0.3, -0.2, 0.1, 0, 0, 0, 0, 0.9]])
    state = np.full(8, 0.5)
    for name in ("generic", "droid"):
        adapter = robot_adapter(name)
        assert (
            adapter.actions_from_pi(actions, adapter.state_to_pi(state)).tolist()
            == actions.tolist()
        )


def test_wrong_state_width_is_refused_by_name():
    with pytest.raises(ValueError, match="robot aloha needs a 14-dim state, got 7"):
        robot_adapter("aloha").state_to_pi(np.zeros(7))
    with pytest.raises(ValueError, match="non-finite values at indices \\[2\\]"):
        robot_adapter("droid").state_to_pi(np.array([0, 0, np.nan, 0, 0, 0, 0, 0]))


# -- the policy: robot_actions / model_actions ---------------------------------------------------


@pytest.fixture(scope="module")
def wide_policy_parts(tiny_checkpoint):
    """A tiny model widened to 32 action dims (room for ALOHA's 14) and 32-dim synthetic stats."""
    config = dataclasses.replace(get_preset("tiny"), action_dim=32)
    model = build_model(config, "cpu", "float32")
    rng = np.random.default_rng(3)
    stats = {}
    for key in ("state", "actions"):
        q01 = rng.uniform(-2.0, -0.5, 32)
        q99 = rng.uniform(0.5, 2.0, 32)
        stats[key] = NormStats(mean=(q01 + q99) / 2, std=np.ones(32), q01=q01, q99=q99)
    return model, Pi05Tokenizer(tiny_checkpoint / "tokenizer.model"), stats


@pytest.mark.parametrize("robot", sorted(ROBOTS))
def test_robot_and_model_actions_are_inverses_on_the_robot_dims(wide_policy_parts, robot):
    model, tokenizer, stats = wide_policy_parts
    action_dim = 6 if robot == "generic" else None
    policy = Pi05Policy(model, tokenizer, stats, action_dim, robot=robot)
    adapter = robot_adapter(robot)
    rng = np.random.default_rng(7)
    state = rng.uniform(0.1, 0.9, adapter.state_dim or 9)  # grippers inside ALOHA's range
    model_chunk = rng.uniform(-0.9, 0.9, (5, 32)).astype(np.float32)
    robot_chunk = policy.robot_actions(model_chunk, state)
    assert robot_chunk.shape == (5, policy.action_dim) and robot_chunk.dtype == np.float32
    back = policy.model_actions(robot_chunk, state)
    assert back.shape == (5, 32) and back.dtype == np.float32
    np.testing.assert_allclose(
        back[:, : policy.action_dim], model_chunk[:, : policy.action_dim], atol=2e-5
    )
    assert not back[:, policy.action_dim :].any()  # zeros beyond the robot dims
    again = policy.robot_actions(back, state)
    np.testing.assert_allclose(again, robot_chunk, atol=2e-5)


def test_robot_actions_unnormalise_then_apply_alohas_delta(wide_policy_parts):
    model, tokenizer, stats = wide_policy_parts
    policy = Pi05Policy(model, tokenizer, stats, robot="aloha")
    q01, q99 = stats["actions"].q01, stats["actions"].q99
    model_chunk = np.zeros((1, 32), dtype=np.float32)  # normalised 0 = the middle of [q01, q99]
    state = np.full(14, 0.3)
    out = policy.robot_actions(model_chunk, state)
    middle = (q99 - q01 + 1e-6) / 2 + q01
    assert out[0, 0] == pytest.approx(0.3 + middle[0], abs=1e-5)  # flip +1: s + a
    assert out[0, 1] == pytest.approx(0.3 - middle[1], abs=1e-5)  # flip -1: s - a


def test_fixed_width_robots_refuse_another_action_dim(wide_policy_parts):
    model, tokenizer, stats = wide_policy_parts
    with pytest.raises(ValueError, match="robot droid has 8 action dims, asked for 7"):
        Pi05Policy(model, tokenizer, stats, 7, robot="droid")


# -- libero: no state in the prompt ---------------------------------------------------------------


def test_libero_prompt_is_the_task_alone(tiny_checkpoint):
    libero = load_policy(tiny_checkpoint, robot="libero")
    generic = load_policy(tiny_checkpoint, action_dim=7)
    state = np.linspace(-0.5, 0.5, 8)
    task = "put the bowl on the plate"
    ids, mask = libero.prompt_tokens(state, task)
    with_state, with_mask = generic.prompt_tokens(state, task)
    tok = libero.tokenizer
    real = ids[mask].tolist()
    # openpi's TokenizePrompt with discrete_state_input=False: bos + task, then "\n" encoded alone.
    assert real == [tok.bos_id] + tok.encode_text(task) + tok.encode_text("\n")
    assert real != with_state[with_mask].tolist()
    assert "State" not in tok.decode(real) and "Action" not in tok.decode(real)
    assert "State:" in tok.decode(with_state[with_mask].tolist())
    other, _ = libero.prompt_tokens(state + 0.3, task)  # the state does not reach the prompt
    assert other.tolist() == ids.tolist()


# -- the published command ------------------------------------------------------------------------

JOINTS3 = ["a", "b", "c"]


def test_velocity_chunk_is_integrated_into_positions():
    # a, b: velocities; c: gripper position. q = [0.1, -0.2, 0.0], dt = 0.1.
    s = settings(
        joint_names=JOINTS3, action_space="velocity", gripper_joint_names=["c"], action_dt=0.1
    )
    chunk = np.array([[0.5, -1.0, 0.2], [0.5, 0.0, 0.4], [-1.0, 1.0, 0.4]])
    command = build_command(s, chunk, np.array([0.1, -0.2, 0.0]), STAMP)
    trajectory = command.trajectory
    assert command.action_space == "velocity" and command.clipped == 0
    assert [seconds(p.time_from_start) for p in trajectory.points] == pytest.approx([0.1, 0.2, 0.3])
    # a: 0.1 + 0.05 = 0.15, + 0.05 = 0.20, - 0.1 = 0.10;  b: -0.2 - 0.1 = -0.3, -0.3, -0.2
    assert [p.positions[0] for p in trajectory.points] == pytest.approx([0.15, 0.20, 0.10])
    assert [p.positions[1] for p in trajectory.points] == pytest.approx([-0.3, -0.3, -0.2])
    # the trajectory ends at rest (a stock controller rejects a non-zero last velocity)
    assert [p.velocities[0] for p in trajectory.points] == pytest.approx([0.5, 0.5, 0.0])
    assert [p.velocities[1] for p in trajectory.points] == pytest.approx([-1.0, 0.0, 0.0])
    assert trajectory.header.stamp == STAMP and list(trajectory.joint_names) == ["a", "b"]
    # the gripper is a position, on its own controller's trajectory, without velocities
    gripper = command.gripper_trajectory
    assert list(gripper.joint_names) == ["c"] and gripper.header.stamp == STAMP
    assert [p.positions[0] for p in gripper.points] == pytest.approx([0.2, 0.4, 0.4])
    assert not any(p.velocities for p in gripper.points)
    np.testing.assert_allclose(command.actions, chunk, atol=1e-7)  # ~/action_chunk: the velocities


def test_droid_defaults_to_velocity_with_the_gripper_as_position():
    names = [f"j{i}" for i in range(1, 8)] + ["gripper"]
    s = settings(robot="droid", joint_names=names, action_dt=0.1)
    assert s.command_space == "velocity" and s.gripper_dims == (7,)
    chunk = np.zeros((2, 8))
    chunk[:, 0] = 1.0  # 1 rad/s on joint 1
    chunk[:, 7] = 0.8  # gripper position 0.8
    command = build_command(s, chunk, np.zeros(8), STAMP)
    assert [p.positions[0] for p in command.trajectory.points] == pytest.approx([0.1, 0.2])
    assert list(command.gripper_trajectory.joint_names) == ["gripper"]
    assert [p.positions[0] for p in command.gripper_trajectory.points] == pytest.approx([0.8, 0.8])


def test_delta_position_is_relative_to_the_observed_state():
    s = settings(joint_names=JOINTS3, action_space="delta_position", gripper_joint_names=["c"])
    chunk = np.array([[0.1, -0.1, 0.7], [0.2, -0.2, 0.9]])
    command = build_command(s, chunk, np.array([1.0, 2.0, 0.0]), STAMP)
    positions = [list(p.positions) for p in command.trajectory.points]
    assert positions == [pytest.approx([1.1, 1.9]), pytest.approx([1.2, 1.8])]
    grippers = [list(p.positions) for p in command.gripper_trajectory.points]
    assert grippers == [pytest.approx([0.7]), pytest.approx([0.9])]
    assert not command.trajectory.points[0].velocities  # position commands carry no velocities
    np.testing.assert_allclose(command.actions, chunk, atol=1e-6)


def test_position_space_publishes_the_chunk_as_positions():
    s = settings(joint_names=JOINTS3)
    chunk = np.array([[0.1, 0.2, 0.3]])
    command = build_command(s, chunk, np.zeros(3), STAMP)
    assert command.action_space == "position"
    assert list(command.trajectory.points[0].positions) == pytest.approx([0.1, 0.2, 0.3])


def test_position_limits_act_on_positions_in_every_space():
    limits = dict(
        joint_names=JOINTS3,
        joint_lower_limits=[-1.0, -1.0, 0.0],
        joint_upper_limits=[1.2, 1.0, 1.0],
    )
    state = np.array([1.0, 0.0, 0.0])
    # delta: 1.0 + 0.5 = 1.5 -> 1.2, published delta 0.2
    delta = build_command(
        settings(action_space="delta_position", **limits), np.array([[0.5, 0.0, 0.0]]), state, STAMP
    )
    assert delta.trajectory.points[0].positions[0] == pytest.approx(1.2)
    assert delta.actions[0, 0] == pytest.approx(0.2) and delta.clipped == 1
    # velocity 2 rad/s, dt 0.1 from 1.0: 1.2 (ok), 1.4 -> 1.2; that step's velocity becomes 0
    velocity = build_command(
        settings(action_space="velocity", action_dt=0.1, **limits),
        np.array([[2.0, 0.0, 0.0], [2.0, 0.0, 0.0]]),
        state,
        STAMP,
    )
    points = velocity.trajectory.points
    assert [p.positions[0] for p in points] == pytest.approx([1.2, 1.2])
    assert [p.velocities[0] for p in points] == pytest.approx([2.0, 0.0], abs=1e-9)
    assert velocity.clipped == 1


def test_velocity_limits_act_on_velocities():
    s = settings(
        joint_names=JOINTS3,
        action_space="velocity",
        gripper_joint_names=["c"],
        action_dt=0.1,
        max_joint_velocity=[0.5, 0.5, 1.0],
    )
    chunk = np.array([[2.0, -0.3, 0.5], [-2.0, 0.3, 0.5]])
    command = build_command(s, chunk, np.zeros(3), STAMP)
    points = command.trajectory.points
    assert command.actions[:, 0] == pytest.approx([0.5, -0.5])  # clipped to +-0.5
    assert [p.positions[0] for p in points] == pytest.approx([0.05, 0.0])  # 0 + 0.05 - 0.05
    assert command.actions[:, 1] == pytest.approx([-0.3, 0.3])  # within the limit
    assert [p.velocities[0] for p in points] == pytest.approx([0.5, 0.0])  # ends at rest
    # gripper: a position moving at most 1.0 * 0.1 per step: 0.1, 0.2
    assert [p.positions[0] for p in command.gripper_trajectory.points] == pytest.approx([0.1, 0.2])
    assert command.clipped == 4  # 2 velocities of a, 2 gripper positions


def test_non_finite_chunks_are_refused_in_every_space():
    chunk = np.array([[np.nan, 0.0, 0.0]])
    for space in ("position", "delta_position", "velocity"):
        with pytest.raises(UnsafeChunkError):
            build_command(
                settings(joint_names=JOINTS3, action_space=space), chunk, np.zeros(3), STAMP
            )


def test_libero_publishes_the_chunk_only():
    labels = ["dx", "dy", "dz", "droll", "dpitch", "dyaw", "grip"]
    s = settings(
        robot="libero",
        joint_names=[f"s{i}" for i in range(8)],
        action_joint_names=labels,
        dry_run=False,
    )
    assert s.command_space == "end_effector" and not s.publishes_trajectory
    chunk = np.full((3, 7), 0.25)
    command = build_command(s, chunk, np.zeros(8), STAMP)
    assert command.trajectory is None and command.action_space == "end_effector"
    assert command.actions.tolist() == chunk.tolist()


def test_dry_run_publishes_no_trajectory():
    command = build_command(
        settings(joint_names=JOINTS3, dry_run=True, action_space="velocity"),
        np.zeros((2, 3)),
        np.zeros(3),
        STAMP,
    )
    assert command.trajectory is None and command.actions.shape == (2, 3)


# -- parameters -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(robot="ur5"), "robot must be one of generic, droid, aloha, libero"),
        (
            dict(action_space="torque"),
            "action_space must be one of position, delta_position, velocity",
        ),
        (dict(robot="aloha"), "robot aloha reads a 14-dim state but joint_names has 7"),
        (
            dict(
                robot="droid",
                joint_names=[f"j{i}" for i in range(8)],
                action_joint_names=[f"j{i}" for i in range(7)],
            ),
            "robot droid returns 8 action dims but there are 7",
        ),
        (
            dict(
                robot="droid",
                joint_names=[f"j{i}" for i in range(8)],
                camera_slots=["base_0_rgb", "right_wrist_0_rgb"],
            ),
            "trained with image slots",
        ),
        (
            dict(gripper_joint_names=["hand"]),
            "gripper_joint_names \\['hand'\\] are not action joints",
        ),
        (
            dict(
                robot="libero",
                joint_names=[f"s{i}" for i in range(8)],
                action_joint_names=list("abcdefg"),
                action_space="position",
            ),
            "end-effector actions.*action_space",
        ),
        (
            dict(
                robot="libero",
                joint_names=[f"s{i}" for i in range(8)],
                action_joint_names=list("abcdefg"),
                joint_upper_limits=[1.0] * 7,
            ),
            "publishes ~/action_chunk only.*joint_upper_limits",
        ),
    ],
)
def test_robot_parameters_are_validated_together(overrides, message):
    with pytest.raises(SettingsError, match=message):
        settings(**overrides)


@pytest.mark.parametrize(
    "name, robot, horizon, space",
    [
        ("pi05_droid", "droid", 15, "velocity"),
        ("pi05_aloha", "aloha", 50, "position"),
        ("pi05_libero", "libero", 10, "end_effector"),
    ],
)
def test_shipped_params_files_are_valid_and_match_their_checkpoint(name, robot, horizon, space):
    text = (ROOT / "config" / f"{name}.yaml").read_text()
    values = yaml.safe_load(text)["/**"]["ros__parameters"]
    defaults = {spec.name: spec.default for spec in PARAMETERS}
    s = NodeSettings.from_values({**defaults, **values})
    assert (s.robot, s.action_horizon, s.command_space) == (robot, horizon, space)
    assert s.dry_run and not s.publishes_trajectory
    adapter = robot_adapter(robot)
    assert {cam.slot for cam in s.cameras} <= set(adapter.slots)
    assert (
        len(s.joint_names) == adapter.state_dim and len(s.action_joint_names) == adapter.action_dim
    )
    assert math.isclose(
        s.action_dt, {"droid": 1 / 15, "aloha": 0.02, "libero": 0.05}[robot], rel_tol=1e-3
    )
