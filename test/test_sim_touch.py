"""Touch judged by contact (real MuJoCo): a finger or the hand on the named cube succeeds, another
cube touched first fails; the old tip rule is still reported beside it (sim-policy's columns)."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco's first import, as oxygen_ros.sim does

import numpy as np
import pytest
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from oxygen_ros.ros.convert import seconds_to_duration, seconds_to_stamp
from oxygen_ros.sim.episode import (
    ARM_CONTROLLER,
    GRIPPER_CONTROLLER,
    RUNNING,
    SUCCESS,
    TIMEOUT,
    WRONG_CUBE,
    Simulation,
)
from oxygen_ros.sim.expert import ScriptedExpert
from oxygen_ros.sim.kinematics import tip_down_ik
from oxygen_ros.sim.scene import ARM_JOINTS, CUBE_SIZE
from oxygen_ros.sim.tasks import TOUCH, TOUCH_DISTANCE, Task, touch_verdict
from oxygen_ros.tools.benches import sim_policy
from oxygen_ros.tools.benches.subtask_modes import ConditionedChunk


@pytest.fixture
def sim():
    sim = Simulation(episode_timeout_s=4.0)
    yield sim
    sim.world.close()


def test_the_first_contact_decides():
    assert touch_verdict("red", []) is None
    assert touch_verdict("red", ["red"]) is True
    assert touch_verdict("red", ["green"]) is False
    assert touch_verdict("red", ["green", "red"]) is True  # both at once: the red one is touched


def _lower_hand_beside(sim: Simulation, sideways_m: float) -> None:
    """Send the arm down to the expert's old touch point (1.7 cm above the red cube's centre)
    shifted ``sideways_m`` across the line from the base, fingers aligned with the cube."""
    cube, yaw = sim.world.cube_position("red"), sim.world.cube_yaw("red")
    radial = cube[:2] / np.linalg.norm(cube[:2])
    xy = cube[:2] + sideways_m * np.array([-radial[1], radial[0]])
    msg = JointTrajectory(joint_names=list(ARM_JOINTS))
    msg.header.stamp = seconds_to_stamp(sim.now_s)
    roll = float(sim.world.arm_positions()[4])
    for k, z in enumerate((0.09, cube[2] + CUBE_SIZE / 2 + 0.002)):
        joints = tip_down_ik(np.r_[xy, z], yaw, roll_hint=roll)
        msg.points.append(
            JointTrajectoryPoint(
                positions=[float(q) for q in joints],
                velocities=[0.0] * 5,
                time_from_start=seconds_to_duration(1.0 + k),
            )
        )
    sim.receive(ARM_CONTROLLER, msg)


def test_the_old_tip_rule_needs_the_tip_within_a_centimetre_and_a_half_sideways():
    """Why the old tip rule (kept as sim-policy's ``touch_tip``) missed touches: 1 cm to the side
    the tip gets down to 2 cm from the cube's centre, 2 cm to the side the hand rests on the
    cube's top and the tip stays beyond the rule's 3 cm (measured: 3.1-3.3 cm). The contact rule
    counts that hand as touching (below)."""
    sim = Simulation(episode_timeout_s=0.5)  # the episode times out early; physics goes on
    try:
        for seed in (7000, 7001, 7002):
            for sideways_m, near in ((0.0, 0.018), (0.01, TOUCH_DISTANCE - 0.005)):
                assert _tip_settled_beside(sim, seed, sideways_m) < near
            for sideways_m in (0.02, -0.02):
                assert _tip_settled_beside(sim, seed, sideways_m) > TOUCH_DISTANCE
    finally:
        sim.world.close()


def _tip_settled_beside(sim: Simulation, seed: int, sideways_m: float) -> float:
    """The tip's distance to the red cube's centre 3 s after :func:`_lower_hand_beside`."""
    sim.reset(Task(TOUCH, "red"), seed)
    cube = sim.world.cube_position("red")
    _lower_hand_beside(sim, sideways_m)
    for _ in range(round(3.0 / sim.control_dt)):
        sim.control_step()
    return float(np.linalg.norm(sim.world.tip_position() - cube))


@pytest.mark.parametrize("seed", [7000, 7001])
def test_a_hand_resting_on_the_cube_touches_it(sim, seed):
    """2 cm to the side the hand rests on the cube's top: the old rule never counted it (tip
    beyond 3 cm, above), the contact rule does."""
    sim.reset(Task(TOUCH, "red"), seed)
    _lower_hand_beside(sim, 0.02)
    while sim.status == RUNNING:
        sim.control_step()
    assert sim.status == SUCCESS
    cube = sim.world.cube_position("red")
    assert np.linalg.norm(sim.world.tip_position() - cube) > TOUCH_DISTANCE
    while sim.tip_rule_pending():  # the hand settles on the cube: the old rule never holds
        sim.control_step()
    report = sim.episode_report()
    assert report["touched_first"] == ["red"] and report["reason"] == ""
    assert report["tip_rule_s"] is None
    assert "red" in sim.world.cubes_touched()
    assert np.linalg.norm(sim.world.tip_position() - cube) > TOUCH_DISTANCE


def _drive_expert_at(sim: Simulation, cube: str, seconds: float) -> None:
    """The scripted expert touching ``cube`` whatever the sim's task, for ``seconds`` of sim time
    (on past the episode's end, as a policy that heads for the wrong cube would)."""
    expert = ScriptedExpert()
    for step in range(round(seconds / sim.control_dt)):
        if step % 10 == 0:
            state = sim.privileged_state()
            state = dataclasses.replace(state, task=Task(TOUCH, cube), status=RUNNING)
            arm, gripper = expert.plan(state)
            sim.receive(ARM_CONTROLLER, arm)
            sim.receive(GRIPPER_CONTROLLER, gripper)
        sim.control_step()


def test_a_hand_on_another_cube_first_fails(sim):
    sim.reset(Task(TOUCH, "red"), 7000)
    _drive_expert_at(sim, "green", 3.0)
    assert sim.status == WRONG_CUBE
    report = sim.episode_report()
    assert report["status"] == WRONG_CUBE and report["touched_first"] == ["green"]
    assert report["reason"] == "touched the green cube before the red cube"
    assert report["elapsed_s"] < 3.0  # it ended at the contact
    _drive_expert_at(sim, "red", 3.0)  # touching the right cube afterwards changes nothing
    assert "red" in sim.world.cubes_touched()
    assert sim.status == WRONG_CUBE


def test_the_expert_touches_with_a_finger_and_ends_the_episode(sim):
    sim.reset(Task(TOUCH, "blue"), 7002)
    _drive_expert_at(sim, "blue", 4.0)
    assert sim.status == SUCCESS
    assert sim.episode_report()["touched_first"] == ["blue"]
    assert sim.world.fingers_touching("blue") >= 1


class _TipAtCentre:
    """A chunk source (sim-policy's protocol) that puts the tip 1.7 cm above the cube's centre:
    the open fingers straddle the cube and touch nothing, what the old rule called a touch."""

    mode, policy = "oracle", None

    def start(self, sim: Simulation, noise_seed: int) -> None:
        pass

    def published(self) -> None:
        pass

    def chunk(self, sim: Simulation, observation) -> ConditionedChunk:
        cube = sim.world.cube_position(sim.task.cube)
        target = np.r_[cube[:2], cube[2] + CUBE_SIZE / 2 + 0.002]
        roll = float(sim.world.arm_positions()[4])
        tip, points = sim.world.tip_position(), []
        for _ in range(4):  # 12 cm/s along the line, as the expert moves
            step = target - tip
            tip = tip + step * min(1.0, 0.012 / max(np.linalg.norm(step), 1e-9))
            joints = tip_down_ik(tip, sim.world.cube_yaw(sim.task.cube), roll_hint=roll)
            points.append(np.r_[joints, 0.0])
        return ConditionedChunk(np.array(points), sim.phase.subtask, None)

    def close(self) -> None:
        pass


def test_sim_policy_reports_both_touch_rules(sim):
    """A tip over the cube's centre with the fingers around it: the old rule's touch, no contact
    (timeout); the bench drives on and reports both, and counts no wrong cube."""
    task = Task(TOUCH, "red")
    record = sim_policy.run_episode(sim, _TipAtCentre(), task, 7000, 0.1)
    assert record["status"] == TIMEOUT and record["touched_first"] == []
    assert record["touch_contact"] is False and record["touch_tip"] is True
    assert 0 < record["tip_rule_s"] < 4.0
    assert record["closest_tip_to_cube_m"] <= TOUCH_DISTANCE
    summary = sim_policy.summarise([record])
    assert (summary["touch_contact"], summary["touch_tip"], summary["wrong_cube"]) == (0, 1, 0)
