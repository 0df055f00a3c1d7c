"""What the node publishes is what a stock ros2_control joint_trajectory_controller accepts.

The controller's rules (jazzy, default parameters; ``oxygen_ros.ros.trajectory_rules``) are applied
to the commands of every joint action space, to every shipped config, to what ``Outputs`` sends,
and over DDS to every trajectory a real node publishes in each action space, at the time it
arrives.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import rclpy
import yaml
from builtin_interfaces.msg import Time
from lifecycle_msgs.msg import Transition
from node_harness import NodeProcess, Probe, synthetic_bag_params, wait_for
from rclpy.lifecycle import LifecycleNode

from oxygen_ros.engine.types import ActionChunk
from oxygen_ros.ros.commands import build_command
from oxygen_ros.ros.convert import seconds_to_stamp
from oxygen_ros.ros.outputs import Outputs
from oxygen_ros.ros.params import PARAMETERS, NodeSettings
from oxygen_ros.ros.trajectory_rules import (
    REJECT_END_VELOCITY,
    REJECT_JOINTS,
    REJECT_PAST,
    REJECT_TIME_ORDER,
    TrajectoryRejected,
    check_trajectory,
)
from oxygen_ros.tools.make_bag import joint_names, write_synthetic_bag

CONFIG_DIR = Path(__file__).resolve().parents[1] / "config"
JOINT_SPACES = ("position", "delta_position", "velocity")
JOINTS = joint_names(7)
GRIPPER = JOINTS[-1]


def settings(**overrides) -> NodeSettings:
    values = {spec.name: spec.default for spec in PARAMETERS}
    values.update(overrides)
    return NodeSettings.from_values(values)


def controllers(s: NodeSettings) -> dict[str, list[str]]:
    """The joints of the controllers a robot with these settings runs: the arm's, the gripper's."""
    grippers = [s.action_joint_names[i] for i in s.gripper_trajectory_dims]
    arm = [name for name in s.action_joint_names if name not in grippers]
    return {"arm": arm, "gripper": grippers} if grippers else {"arm": arm}


def random_chunk(rng: np.random.Generator, horizon: int, width: int) -> np.ndarray:
    return rng.normal(0.0, 2.0, size=(horizon, width))  # large enough to hit the limits


def assert_accepted(command, s: NodeSettings, now_s: float) -> None:
    owners = controllers(s)
    sent = dict(command.trajectories)
    assert set(sent) == set(owners), f"trajectories {set(sent)} for controllers {set(owners)}"
    for name, trajectory in sent.items():
        check_trajectory(trajectory, owners[name], now_s)


@pytest.mark.parametrize("space", JOINT_SPACES)
@pytest.mark.parametrize("split", [True, False], ids=["gripper_own", "gripper_in_arm"])
def test_every_joint_space_is_accepted(space, split):
    rng = np.random.default_rng(0)
    s = settings(
        joint_names=JOINTS,
        action_space=space,
        gripper_joint_names=[GRIPPER],
        gripper_trajectory=split,
        action_dt=0.05,
        joint_lower_limits=[-1.0] * 7,
        joint_upper_limits=[1.0] * 7,
        max_joint_velocity=[0.8] * 7,
    )
    stamp = seconds_to_stamp(100.0)
    for _ in range(20):
        chunk = random_chunk(rng, 10, 7)
        command = build_command(s, chunk, rng.uniform(-0.5, 0.5, 7), stamp)
        assert_accepted(command, s, now_s=100.0)
        names = list(command.trajectory.joint_names)
        assert (GRIPPER in names) is not split


def shipped_settings(path: Path) -> NodeSettings:
    """A shipped config's settings, sending commands (dry_run off)."""
    document = yaml.safe_load(path.read_text())
    values = {spec.name: spec.default for spec in PARAMETERS}
    values.update(document["/**"]["ros__parameters"])
    values["dry_run"] = False
    return NodeSettings.from_values(values)


def node_configs() -> list[Path]:
    """oxygen_node's shipped parameter files (config/ also holds the simulated robot's and the
    dataset converter's)."""
    return [
        path
        for path in sorted(CONFIG_DIR.glob("*.yaml"))
        if "checkpoint_dir"
        in (yaml.safe_load(path.read_text()).get("/**") or {}).get("ros__parameters", {})
    ]


@pytest.mark.parametrize("path", node_configs(), ids=lambda p: p.name)
def test_every_shipped_config_is_accepted(path):
    s = shipped_settings(path)
    rng = np.random.default_rng(1)
    width = len(s.action_joint_names)
    command = build_command(
        s, random_chunk(rng, 15, width), np.zeros(len(s.joint_names)), seconds_to_stamp(50.0)
    )
    if not s.publishes_trajectory:  # end-effector actions: ~/action_chunk only
        assert command.trajectories == ()
        return
    assert_accepted(command, s, now_s=50.0)
    for name in s.gripper_joint_names:
        assert name not in command.trajectory.joint_names, f"{name} in the arm's trajectory"


def test_the_rules_reject_what_the_controller_rejects():
    s = settings(joint_names=JOINTS, action_space="velocity", gripper_joint_names=[GRIPPER])
    command = build_command(s, np.ones((5, 7)), np.zeros(7), seconds_to_stamp(10.0))
    arm = command.trajectory
    check_trajectory(arm, JOINTS[:6], now_s=10.0)
    cases = {
        REJECT_JOINTS: lambda: check_trajectory(arm, JOINTS, now_s=10.0),  # gripper expected too
        REJECT_PAST: lambda: check_trajectory(arm, JOINTS[:6], now_s=30.0),
    }
    for reason, check in cases.items():
        with pytest.raises(TrajectoryRejected) as caught:
            check()
        assert caught.value.reason == reason
    arm.points[-1].velocities[0] = 0.3
    with pytest.raises(TrajectoryRejected, match="not zero") as caught:
        check_trajectory(arm, JOINTS[:6], now_s=10.0)
    assert caught.value.reason == REJECT_END_VELOCITY
    arm.points[-1].velocities[0] = 0.0
    arm.points[2].time_from_start = arm.points[1].time_from_start
    with pytest.raises(TrajectoryRejected) as caught:
        check_trajectory(arm, JOINTS[:6], now_s=10.0)
    assert caught.value.reason == REJECT_TIME_ORDER


@pytest.mark.ros
def test_outputs_do_not_send_a_trajectory_that_has_already_ended():
    """A chunk of an observation older than its horizon is over before it is sent: nothing goes
    out on either trajectory topic, and why is returned; a fresh one goes out."""
    s = settings(joint_names=JOINTS, gripper_joint_names=[GRIPPER], dry_run=False, action_dt=0.1)
    context = rclpy.Context()
    rclpy.init(context=context)
    node = LifecycleNode("acceptance_outputs", context=context)
    try:
        outputs = Outputs(node, s)
        chunk = ActionChunk(0, 0.0, np.zeros((10, 7), np.float32), 0.0, 0.0)

        def send(stamp_s: float, now_s: float):
            stamp = seconds_to_stamp(stamp_s)
            command = build_command(s, chunk.actions, np.zeros(7), stamp)
            return outputs.publish_command(s, chunk, stamp, command, 1.0, True, 0.0, now_s)

        stale = send(100.0, now_s=101.5)  # ended at 100 + 10 * 0.1 = 101.0
        assert [(name, r.reason) for name, r in stale] == [
            ("arm", REJECT_PAST),
            ("gripper", REJECT_PAST),
        ]
        assert send(100.0, now_s=100.2) == []
        assert send(0.0, now_s=500.0) == []  # a zero stamp means "now" to a controller
        outputs.destroy()
    finally:
        node.destroy_node()
        rclpy.shutdown(context=context)


# -- over DDS: a real node in each joint action space ----------------------------------------------


@pytest.fixture(scope="module")
def probe(tiny_checkpoint, tmp_path_factory):
    bag = write_synthetic_bag(tmp_path_factory.mktemp("bag") / "synthetic", duration_s=4.0)
    node = NodeProcess(
        {
            **synthetic_bag_params(tiny_checkpoint),
            "rate_hz": 10.0,
            "action_dt": 0.1,
            "gripper_joint_names": [GRIPPER],
            "max_joint_velocity": [1.0] * 7,
            "max_observation_age_s": 1.0,
            "narration_period_s": 0.0,
            "dry_run": False,
        },
        tmp_path_factory.mktemp("node"),
    )
    probe = Probe()
    try:
        probe.wait_active(node)
        playback = probe.play_in_background(bag)
        yield probe
        playback.stop()
    finally:
        probe.close()
        assert node.stop() == 0, node.log()[-3000:]


@pytest.mark.ros
@pytest.mark.slow
def test_every_trajectory_the_node_publishes_is_accepted_on_arrival(probe):
    """Each action space in turn (reconfigured): every trajectory on ~/joint_trajectory and
    ~/gripper_trajectory passes the controller's rules at the wall-clock time it arrived (the
    node's clock is the wall clock here, so arrival times compare with its stamps)."""
    owners = {"arm": JOINTS[:6], "gripper": [GRIPPER]}
    for space in JOINT_SPACES:
        assert probe.change_state(Transition.TRANSITION_DEACTIVATE)
        assert probe.change_state(Transition.TRANSITION_CLEANUP)
        assert probe.set("action_space", space).successful
        assert probe.change_state(Transition.TRANSITION_CONFIGURE)
        with probe.lock:
            start = len(probe.arrivals)
        assert probe.change_state(Transition.TRANSITION_ACTIVATE)

        def arrived(start: int = start) -> list:
            with probe.lock:
                return probe.arrivals[start:]

        assert wait_for(lambda: sum(1 for name, _, _ in arrived() if name == "gripper") >= 4, 30), (
            f"{space}: fewer than 4 gripper trajectories in 30 s"
        )
        received = arrived()
        assert {name for name, _, _ in received} == {"arm", "gripper"}
        for name, arrival_s, trajectory in received:
            check_trajectory(trajectory, owners[name], arrival_s)
        velocities = [t.points[0].velocities for n, _, t in received if n == "arm"]
        assert all(len(v) == 6 for v in velocities) is (space == "velocity"), space


def test_a_zero_stamp_is_never_stale():
    s = settings(joint_names=JOINTS, gripper_joint_names=[GRIPPER])
    command = build_command(s, np.zeros((3, 7)), np.zeros(7), Time())
    for name, trajectory in command.trajectories:
        check_trajectory(trajectory, controllers(s)[name], now_s=1e9)
