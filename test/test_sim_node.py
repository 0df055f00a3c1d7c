"""The simulated robot's node over DDS: its controllers refuse and count what a stock
joint_trajectory_controller refuses and execute the rest; the scripted expert's episodes, run by
``oxygen-sim --expert`` in a subprocess, succeed through the same topics with the right labels."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import rclpy
from node_harness import send_request, wait_for
from rcl_interfaces.srv import SetParameters
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import JointState
from std_msgs.msg import String
from std_srvs.srv import Trigger
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

from oxygen_ros.ros.convert import seconds_to_duration, seconds_to_stamp, stamp_to_seconds
from oxygen_ros.sim.scene import ARM_JOINTS, HOME

pytestmark = pytest.mark.ros

LATCHED = QoSProfile(
    depth=10, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL
)
RELIABLE = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)


class SimProbe:
    """The test's own node (own context): commands the sim's controllers, records its outputs."""

    def __init__(self) -> None:
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        node = self.node = rclpy.create_node("sim_probe", context=self.context)
        self.lock = threading.Lock()
        self.texts: dict[str, list[str]] = {"task": [], "subtask": [], "narration": []}
        self.episodes: list[dict] = []
        self.joint_state: JointState | None = None
        for name, texts in self.texts.items():
            qos = RELIABLE if name == "narration" else LATCHED
            node.create_subscription(String, f"/sim/{name}", self._keep(texts), qos)
        node.create_subscription(String, "/sim/episode", self._on_episode, LATCHED)
        node.create_subscription(JointState, "/joint_states", self._on_joints, RELIABLE)
        self.arm = node.create_publisher(JointTrajectory, "/arm_controller/joint_trajectory", 10)
        self.gripper = node.create_publisher(
            JointTrajectory, "/gripper_controller/joint_trajectory", 10
        )
        self.reset = node.create_client(Trigger, "/sim/reset")
        self.parameters = node.create_client(SetParameters, "/sim/set_parameters")
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(node)
        self._spinner = threading.Thread(target=self.executor.spin, daemon=True)
        self._spinner.start()

    def _keep(self, texts: list[str]):
        def keep(msg: String) -> None:
            with self.lock:
                texts.append(msg.data)

        return keep

    def _on_episode(self, msg: String) -> None:
        with self.lock:
            self.episodes.append(json.loads(msg.data))

    def _on_joints(self, msg: JointState) -> None:
        with self.lock:
            self.joint_state = msg

    def position(self, joint: str) -> float:
        with self.lock:
            state = self.joint_state
        return state.position[list(state.name).index(joint)]

    def sim_now(self) -> float:
        with self.lock:
            return stamp_to_seconds(self.joint_state.header.stamp)

    def last_episode(self) -> dict:
        with self.lock:
            return self.episodes[-1] if self.episodes else {}

    def start_episode(self, task: str, seed: int, episode: int) -> None:
        """Set the sim's task and seed parameters, then call sim/reset for episode ``episode``.

        A fresh DDS client can lose the reply to its first request (a Jazzy flake the node
        harness works around too): setting parameters is resent (it changes nothing twice); the
        reset is sent once, and its effect is also accepted as seen on sim/episode.
        """
        assert self.parameters.wait_for_service(timeout_sec=20.0)
        request = SetParameters.Request(
            parameters=[
                Parameter("task", value=task).to_parameter_msg(),
                Parameter("seed", value=seed).to_parameter_msg(),
            ]
        )
        results = send_request(self.parameters, "set_parameters", request, 12.0, tries=4).results
        assert all(r.successful for r in results), results
        assert self.reset.wait_for_service(timeout_sec=20.0)
        future = self.reset.call_async(Trigger.Request())
        started = wait_for(
            lambda: future.done() or self.last_episode().get("episode") == episode, 15.0
        )
        assert started, "sim/reset: no reply and no new episode"
        if future.done():
            reply = future.result()
            assert reply.success, reply.message
            assert json.loads(reply.message) == {"episode": episode, "task": task}

    def close(self) -> None:
        self.executor.shutdown()
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)


def arm_trajectory(positions, times=(1.0,), stamp_s=0.0, joints=ARM_JOINTS, last_velocity=0.0):
    msg = JointTrajectory()
    if stamp_s:
        msg.header.stamp = seconds_to_stamp(stamp_s)
    msg.joint_names = list(joints)
    for k, t in enumerate(times):
        velocity = last_velocity if k == len(times) - 1 else 0.0
        msg.points.append(
            JointTrajectoryPoint(
                positions=list(positions),
                velocities=[velocity] * len(joints),
                time_from_start=seconds_to_duration(t),
            )
        )
    return msg


@pytest.fixture
def sim_in_process():
    """A SimNode (own context, running its physics) with no expert: nothing else commands it."""
    from oxygen_ros.sim.node import SimNode

    context = rclpy.Context()
    rclpy.init(context=context)
    sim = SimNode(
        context=context,
        parameter_overrides=[Parameter("task", value="touch the red cube")],
    )
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(sim)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    sim.start()
    yield sim
    sim.stop()
    executor.shutdown()
    sim.destroy_node()
    rclpy.try_shutdown(context=context)


def test_the_controllers_refuse_and_count_bad_trajectories_and_execute_a_good_one(sim_in_process):
    sim = sim_in_process
    probe = SimProbe()
    try:
        assert wait_for(
            lambda: (
                probe.arm.get_subscription_count()
                and probe.gripper.get_subscription_count()
                and probe.joint_state is not None
            ),
            20.0,
        ), "the probe never matched the sim"

        def rejected() -> dict:
            return sim.episode_report()["rejected"]

        home = list(HOME)
        wrong = ("shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_yaw")
        cases = [
            ("arm_controller/joints", probe.arm, arm_trajectory(home, joints=wrong)),
            (
                "arm_controller/joints",  # the gripper in the arm's trajectory
                probe.arm,
                arm_trajectory([*home, 0.0], joints=(*ARM_JOINTS, "gripper")),
            ),
            ("arm_controller/time_order", probe.arm, arm_trajectory(home, times=(0.5, 0.5))),
            (
                "arm_controller/ends_in_past",
                probe.arm,
                arm_trajectory(home, stamp_s=probe.sim_now() - 5.0),
            ),
            ("arm_controller/end_velocity", probe.arm, arm_trajectory(home, last_velocity=0.3)),
            (
                "gripper_controller/joints",
                probe.gripper,
                arm_trajectory([0.0], joints=("shoulder_pan",)),
            ),
        ]
        expected: dict[str, int] = {}
        for key, publisher, msg in cases:
            expected[key] = expected.get(key, 0) + 1
            publisher.publish(msg)
            assert wait_for(lambda: rejected() == expected, 10.0), (key, rejected())
        # the same counts reach sim/episode over DDS (refreshed every sim second)
        assert wait_for(lambda: probe.last_episode().get("rejected") == expected, 10.0)
        assert probe.position("shoulder_pan") == pytest.approx(HOME[0], abs=0.01)

        target = [0.4, *home[1:]]
        probe.arm.publish(arm_trajectory(target, times=(0.5, 1.0)))
        assert wait_for(lambda: abs(probe.position("shoulder_pan") - 0.4) < 0.01, 15.0), (
            probe.position("shoulder_pan")
        )
        probe.gripper.publish(arm_trajectory([1.0], joints=("gripper",)))  # close on nothing
        assert wait_for(lambda: probe.position("gripper") > 0.95, 15.0), probe.position("gripper")
        assert rejected() == expected
    finally:
        probe.close()


@pytest.mark.slow
def test_expert_episodes_through_the_sim_node_topics(tmp_path: Path, ros_env):
    log_path = tmp_path / "sim.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "oxygen_ros.tools.sim",
                "--expert",
                "--ros-args",
                "-p",
                "autostart:=false",
            ],
            env=ros_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    probe = SimProbe()
    try:
        episodes = [
            ("touch the red cube", 1, "red"),
            ("put the green cube on the blue pad", 2, "green"),
            ("touch the blue cube", 5, "blue"),
        ]
        for index, (task, seed, color) in enumerate(episodes):
            started = time.monotonic()
            with probe.lock:
                for texts in probe.texts.values():
                    texts.clear()
            probe.start_episode(task, seed, index)

            def finished(index=index) -> bool:
                report = probe.last_episode()
                return report.get("episode") == index and report.get("status") != "running"

            # 90 s of wall time for a 20 sim-s timeout: a loaded CI machine slows sim time
            assert wait_for(finished, 90.0), (
                "the episode neither ended nor timed out; its last report (elapsed_s says "
                "whether sim time still advanced):",
                probe.last_episode(),
                log_path.read_text()[-2000:],
            )
            report = probe.last_episode()
            assert report["status"] == "success", report
            assert report["task"] == task and report["seed"] == seed
            assert wait_for(lambda task=task: probe.texts["task"][-1:] == [task], 5.0)
            if task.startswith("put"):
                final = "the green cube is on the blue pad"
            else:
                final = f"the gripper is touching the {color} cube"
            # the last narration travels on its own topic: it may arrive after the report
            assert wait_for(lambda final=final: probe.texts["narration"][-1:] == [final], 5.0), (
                probe.texts["narration"]
            )
            with probe.lock:
                subtasks = list(probe.texts["subtask"])
                narrations = list(probe.texts["narration"])
            for text in subtasks + narrations:
                assert color in text or text == "done", (text, task)
            if task.startswith("put"):
                for step in ("reach", "grasp", "carry", "release"):
                    assert any(s.startswith(step) for s in subtasks), (step, subtasks)
            else:  # where the cube is while reaching, the task alone once touched
                assert subtasks[0].startswith(f"{task}, ") and subtasks[-1] == task, subtasks
            print(f"{task!r}: {report['elapsed_s']:.2f} sim s, {time.monotonic() - started:.1f} s")
    finally:
        probe.close()
        process.send_signal(signal.SIGINT)
        try:
            code = process.wait(20.0)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    assert code == 0, log_path.read_text()[-3000:]
