"""The simulated robot's parts without DDS: controller semantics, tasks, IK, language, expert."""

from __future__ import annotations

import dataclasses
import math
import os

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco's first import, as oxygen_ros.sim does

import mujoco  # noqa: E402
import numpy as np
import pytest
from builtin_interfaces.msg import Time
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from oxygen_ros.ros.convert import seconds_to_duration, seconds_to_stamp
from oxygen_ros.ros.trajectory_rules import TrajectoryRejected
from oxygen_ros.sim.controller import REJECT_NON_FINITE, TrajectoryController
from oxygen_ros.sim.episode import ARM_CONTROLLER, SUCCESS, Simulation
from oxygen_ros.sim.expert import ArmPerturbation
from oxygen_ros.sim.headless import run_expert_episode
from oxygen_ros.sim.kinematics import Unreachable, tip_down_ik
from oxygen_ros.sim.language import (
    LEAVE_CUBE,
    NEAR_CUBE,
    PLACES,
    Phase,
    SceneFacts,
    current_phase,
    every_phase,
    place_words,
    without_place,
)
from oxygen_ros.sim.scene import CUBE_SIZE, PAD_THICKNESS, scene_mjcf
from oxygen_ros.sim.tasks import (
    MIN_CUBE_GAP,
    PLACE,
    TOUCH,
    Task,
    TaskError,
    cube_on_pad,
    parse_task,
    random_layout,
    random_task,
)

JOINTS = ("a", "b")


def trajectory(
    points: list[tuple[float, list[float]]],
    stamp_s: float = 0.0,
    joints=JOINTS,
    velocities: list[list[float]] | None = None,
) -> JointTrajectory:
    msg = JointTrajectory()
    msg.header.stamp = seconds_to_stamp(stamp_s) if stamp_s else Time()
    msg.joint_names = list(joints)
    for k, (t, q) in enumerate(points):
        point = JointTrajectoryPoint(positions=q, time_from_start=seconds_to_duration(t))
        if velocities is not None:
            point.velocities = velocities[k]
        msg.points.append(point)
    return msg


def controller_at(q=(0.0, 0.0)) -> TrajectoryController:
    return TrajectoryController("arm_controller", JOINTS, q)


# -- controller semantics --------------------------------------------------------------------------
def test_holds_its_reset_position_before_any_trajectory():
    controller = controller_at((0.3, -0.2))
    q, v = controller.sample(5.0)
    assert q.tolist() == [0.3, -0.2] and v.tolist() == [0.0, 0.0]


def test_interpolates_from_the_state_at_receipt_to_the_first_point():
    controller = controller_at()
    # received at t=10 with the joints at (0.2, 0); the first point at 10 + 1 s
    msg = trajectory([(1.0, [1.2, 1.0])], stamp_s=10.0)
    controller.receive(msg, 10.0, np.array([0.2, 0.0]), np.zeros(2))
    q, v = controller.sample(10.5)
    assert q == pytest.approx([0.7, 0.5])  # linear: positions only
    assert v == pytest.approx([1.0, 1.0])


def test_a_point_due_at_receipt_is_on_the_clocks_nanosecond_grid():
    """A chunk arriving one step after its observation has its first point due at the receipt;
    sim time summed in floats lands a hair before it (0.1 + 0.2 < 0.3 is false, 0.3 - 1e-17 is
    not). On a ROS clock (nanoseconds) the point is due now: the reference is the point, not the
    state at receipt."""
    controller = controller_at()
    stamp, step = 0.1 + 0.2, 0.1  # 0.30000000000000004
    msg = trajectory([(step, [1.0, 1.0]), (2 * step, [2.0, 2.0])], stamp_s=stamp)
    receipt = 0.4 - 1e-15  # the sim clock's float sum for "0.4"
    controller.receive(msg, receipt, np.array([0.5, 0.5]), np.zeros(2))
    q, _ = controller.sample(receipt)
    assert q == pytest.approx([1.0, 1.0])  # the first point, not the state at receipt (0.5)


def test_zero_stamp_starts_at_the_first_control_step():
    controller = controller_at()
    controller.receive(trajectory([(1.0, [1.0, 1.0])]), 10.0, np.zeros(2), np.zeros(2))
    controller.sample(10.2)  # the first control step after receipt fixes the start: 10.2
    q, _ = controller.sample(10.7)  # between receipt (10.0) and the first point (11.2)
    assert q == pytest.approx([0.7 / 1.2] * 2)
    q, _ = controller.sample(11.2)
    assert q == pytest.approx([1.0, 1.0])


def test_holds_the_last_point_after_the_end():
    controller = controller_at()
    msg = trajectory([(0.5, [0.5, 0.1]), (1.0, [1.0, 0.2])], stamp_s=1.0)
    controller.receive(msg, 1.0, np.zeros(2), np.zeros(2))
    for t in (2.0, 3.0, 100.0):
        q, v = controller.sample(t)
        assert q.tolist() == [1.0, 0.2] and v.tolist() == [0.0, 0.0]


def test_a_new_trajectory_replaces_the_running_one_from_the_present_state():
    controller = controller_at()
    controller.receive(trajectory([(2.0, [2.0, 2.0])], stamp_s=1.0), 1.0, np.zeros(2), np.zeros(2))
    q_mid, v_mid = controller.sample(2.0)  # halfway: (1, 1) moving at 1 rad/s
    assert q_mid == pytest.approx([1.0, 1.0])
    # replaced at t=2 by a trajectory back to zero; the state at receipt is where the joint is
    controller.receive(trajectory([(1.0, [0.0, 0.0])], stamp_s=2.0), 2.0, q_mid, v_mid)
    q, _ = controller.sample(2.0)
    assert q == pytest.approx(q_mid)  # continuous at the switch
    q, _ = controller.sample(2.5)
    assert q == pytest.approx([0.5, 0.5])
    assert controller.sample(4.0)[0] == pytest.approx([0.0, 0.0])


def test_cubic_between_points_with_velocities_and_joints_in_any_order():
    controller = controller_at()
    msg = trajectory(
        [(1.0, [1.0, 0.0]), (2.0, [0.0, 2.0])],
        stamp_s=1.0,
        joints=("b", "a"),  # reversed: mapped by name
        velocities=[[0.5, 1.0], [0.0, 0.0]],
    )
    controller.receive(msg, 1.0, np.zeros(2), np.zeros(2))
    q, v = controller.sample(2.0)  # the first point, in the controller's (a, b) order
    assert q == pytest.approx([0.0, 1.0]) and v == pytest.approx([1.0, 0.5])
    q, v = controller.sample(3.0)
    assert q == pytest.approx([2.0, 0.0]) and v == pytest.approx([0.0, 0.0], abs=1e-12)
    # Hermite midpoint: (q0 + q1) / 2 + span * (v0 - v1) / 8
    q, _ = controller.sample(2.5)
    assert q == pytest.approx([1.0 + 1.0 / 8, 0.5 + 0.5 / 8])


def test_a_rejected_trajectory_is_counted_and_the_running_one_continues():
    controller = controller_at()
    controller.receive(trajectory([(1.0, [1.0, 1.0])], stamp_s=1.0), 1.0, np.zeros(2), np.zeros(2))
    bad = trajectory([(0.5, [0.0, 0.0]), (0.5, [0.0, 0.0])], stamp_s=1.5)
    with pytest.raises(TrajectoryRejected) as rejected:
        controller.receive(bad, 1.5, np.zeros(2), np.zeros(2))
    assert rejected.value.reason == "time_order"
    assert controller.rejected["time_order"] == 1
    assert controller.sample(2.0)[0] == pytest.approx([1.0, 1.0])
    nan = trajectory([(0.5, [math.nan, 0.0])], stamp_s=1.5)
    with pytest.raises(TrajectoryRejected):
        controller.receive(nan, 1.5, np.zeros(2), np.zeros(2))
    assert controller.rejected[REJECT_NON_FINITE] == 1


# -- tasks ---------------------------------------------------------------------------------------
def test_task_texts_parse_and_unknown_ones_are_refused_clearly():
    assert parse_task("Touch the red cube.") == Task(TOUCH, "red")
    assert parse_task("put the blue cube on the green pad") == Task(PLACE, "blue", "green")
    assert parse_task(Task(PLACE, "red", "blue").text) == Task(PLACE, "red", "blue")
    with pytest.raises(TaskError, match="no purple cube"):
        parse_task("touch the purple cube")
    with pytest.raises(TaskError, match="no red pad"):
        parse_task("put the green cube on the red pad")
    with pytest.raises(TaskError, match="unknown task"):
        parse_task("stack the cubes")


def test_layouts_are_seeded_and_never_overlap():
    first = random_layout(np.random.default_rng(3))
    assert first == random_layout(np.random.default_rng(3))
    for seed in range(50):
        layout = random_layout(np.random.default_rng(seed))
        cubes = [np.array(c[:2]) for c in layout.cubes.values()]
        gaps = [np.linalg.norm(a - b) for i, a in enumerate(cubes) for b in cubes[i + 1 :]]
        assert min(gaps) >= MIN_CUBE_GAP
        assert random_task(np.random.default_rng(seed), PLACE).kind == PLACE


def test_cube_on_pad_needs_the_pad_the_height_and_rest():
    rest_z = PAD_THICKNESS + CUBE_SIZE / 2
    assert cube_on_pad(np.array([0.2, 0.0, rest_z]), 0.0, (0.21, 0.01))
    assert not cube_on_pad(np.array([0.3, 0.0, rest_z]), 0.0, (0.2, 0.0))  # beside it
    assert not cube_on_pad(np.array([0.2, 0.0, rest_z + 0.03]), 0.0, (0.2, 0.0))  # held above
    assert not cube_on_pad(np.array([0.2, 0.0, rest_z]), 0.5, (0.2, 0.0))  # still moving


# -- kinematics ----------------------------------------------------------------------------------
def test_ik_puts_the_tip_where_asked_pointing_down_in_mujoco():
    model = mujoco.MjModel.from_xml_string(scene_mjcf())
    data = mujoco.MjData(model)
    rng = np.random.default_rng(0)
    for _ in range(20):
        radius, angle = rng.uniform(0.14, 0.28), rng.uniform(-0.9, 0.9)
        tip = np.array(
            [radius * math.cos(angle), radius * math.sin(angle), rng.uniform(0.01, 0.12)]
        )
        yaw = rng.uniform(-math.pi, math.pi)
        data.qpos[:5] = tip_down_ik(tip, yaw)
        mujoco.mj_kinematics(model, data)
        assert data.site("tip").xpos == pytest.approx(tip, abs=1e-6)
        hand = data.body("hand").xmat.reshape(3, 3)
        assert hand[:, 2] == pytest.approx([0, 0, -1], abs=1e-6)  # pointing down
        finger_yaw = math.atan2(hand[1, 1], hand[0, 1])
        quarter_turns = (finger_yaw - yaw) / (math.pi / 2)
        assert quarter_turns == pytest.approx(round(quarter_turns), abs=1e-6)
    with pytest.raises(Unreachable):
        tip_down_ik(np.array([0.6, 0.0, 0.0]), 0.0)


# -- language ------------------------------------------------------------------------------------
def test_phases_name_the_object_and_follow_the_state():
    task = Task(PLACE, "red", "green")

    def phase(**facts):
        values = dict(
            success=False,
            grasped=None,
            tip_to_cube=0.2,
            cube_outside_pad=math.inf,
            cube_on_pad=False,
        )
        values.update(facts)
        return current_phase(task, SceneFacts(**values))

    assert phase().subtask == "reach the red cube"
    assert phase().narration == "reaching for the red cube"
    assert phase(tip_to_cube=0.01).subtask == "grasp the red cube"
    assert phase(grasped="red", tip_to_cube=0.0).subtask == "carry the red cube to the green pad"
    carry = phase(grasped="red", tip_to_cube=0.0, cube_place="near left", pad_place="far right")
    assert carry.subtask == "carry the red cube to the green pad, far right"  # the pad's place
    assert carry.narration == "carrying the red cube to the green pad, far right"
    assert without_place(carry.subtask) == "carry the red cube to the green pad"
    assert phase(grasped="blue", tip_to_cube=0.1).subtask == "reach the red cube"  # wrong cube
    held_over = phase(grasped="red", tip_to_cube=0.0, cube_outside_pad=-0.01)
    assert held_over.subtask == "release the red cube"
    assert phase(success=True).narration == "the red cube is on the green pad"
    touch = current_phase(Task(TOUCH, "blue"), SceneFacts(False, None, 0.2, math.inf, False))
    assert (touch.subtask, touch.narration) == ("touch the blue cube", "reaching for the blue cube")
    placed = current_phase(
        Task(TOUCH, "blue"), SceneFacts(False, None, 0.2, math.inf, False, place_words(0.25, 0.1))
    )
    assert placed.narration == "reaching for the blue cube, far left"
    assert placed.subtask == "touch the blue cube, far left"
    assert without_place(placed.subtask) == touch.subtask


def test_a_phase_entered_at_an_edge_lasts_until_a_margin_past_it():
    task = Task(PLACE, "red", "green")
    reach = SceneFacts(False, None, 0.04, math.inf, False)
    assert current_phase(task, reach).key == "reach"  # 4 cm: not yet at the cube
    assert current_phase(task, reach, previous="grasp").key == "grasp"  # dithering back out
    gone = dataclasses.replace(reach, tip_to_cube=0.05)
    assert current_phase(task, gone, previous="grasp").key == "reach"
    held = SceneFacts(False, "red", 0.0, 0.005, False)
    assert current_phase(task, held).key == "carry"  # 5 mm outside the pad's edge
    assert current_phase(task, held, previous="release").key == "release"
    back = dataclasses.replace(held, cube_outside_pad=0.02)
    assert current_phase(task, back, previous="release").key == "carry"
    dropped = dataclasses.replace(held, grasped=None, tip_to_cube=0.2)
    assert current_phase(task, dropped, previous="release").key == "reach"  # the scene changed


def test_the_sims_phase_holds_while_the_tip_dithers_at_the_cube():
    sim = Simulation()
    try:
        sim.reset(Task(PLACE, "red", "green"), seed=3)
        world = sim.world
        above = world.cube_position("red") + np.array([0.0, 0.0, 0.038])  # between 3 and 4.5 cm
        arm = tip_down_ik(above, world.cube_yaw("red"))
        world.data.qpos[world._arm_qpos] = arm
        mujoco.mj_forward(world.model, world.data)
        sim.controllers[ARM_CONTROLLER].reset(arm)
        for before, after in (("grasp", "grasp"), ("reach", "reach")):
            sim.phase = Phase(before, "", "")
            sim.control_step()
            assert NEAR_CUBE < sim.facts().tip_to_cube < LEAVE_CUBE
            assert sim.phase.key == after
    finally:
        sim.world.close()


def test_place_words_split_the_reach_into_sides_and_depths():
    assert place_words(0.16, 0.0) == "near centre"
    assert place_words(0.25, -0.12) == "far right"  # atan2 -0.45 rad: the robot's right
    assert place_words(0.12, 0.12) == "near left"
    # every layout the tasks draw gets words, and all six places occur
    rng = np.random.default_rng(0)
    said = {place_words(*random_layout(rng).cubes["red"][:2]) for _ in range(300)}
    assert said == set(PLACES)


def test_every_phase_lists_each_phase_at_every_place():
    touch = every_phase(Task(TOUCH, "red"))
    assert {p.key for p in touch} == {"reach", "done"}
    assert len(touch) == 1 + len(PLACES) + 1  # reach unplaced and at each place; done
    place = every_phase(Task(PLACE, "red", "blue"))
    assert {p.key for p in place} == {"reach", "grasp", "carry", "release", "done"}
    assert "reach the red cube, far left" in {p.subtask for p in place}
    assert "carry the red cube to the blue pad, near right" in {p.subtask for p in place}


# -- the expert without ROS ----------------------------------------------------------------------
@pytest.mark.parametrize("kind", [TOUCH, PLACE])
def test_the_expert_succeeds_headless(kind):
    sim = Simulation()
    for seed in range(3):
        task = random_task(np.random.default_rng(seed + 50), kind)
        result = run_expert_episode(sim, task, seed)
        assert result.status == SUCCESS, result
        assert sim.phase.key == "done"


def test_perturbed_expert_wanders_yet_succeeds():
    """--perturb's offset moves the arm off the expert's path, and the expert still succeeds."""
    sim = Simulation()
    clean = run_expert_episode(sim, Task(TOUCH, "red"), 3)
    perturbed = run_expert_episode(sim, Task(TOUCH, "red"), 3, perturbation_rad=0.03)
    assert clean.status == perturbed.status == SUCCESS
    assert perturbed.sim_s != clean.sim_s  # a different path, not the same one replayed
    with pytest.raises(ValueError, match="perturbation scale"):
        ArmPerturbation(-0.1)
