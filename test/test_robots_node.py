"""The real node over DDS with robot droid: a velocity-space command published as ros2_control
executes it (a real ``oxygen_node`` process, tiny random-weight model, synthetic bag replayed)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from node_harness import NodeProcess, Probe, stamp_ns, wait_for

from oxygen_ros.tools.make_bag import camera_topic, joint_names, write_synthetic_bag

pytestmark = [pytest.mark.ros, pytest.mark.slow]

DT = 0.0667
JOINTS = joint_names(8)  # droid: 7 arm joints + the gripper (joint_8)
MAX_VELOCITY = 0.5


@pytest.fixture(scope="module")
def probe(tiny_checkpoint, tmp_path_factory):
    bag = write_synthetic_bag(
        tmp_path_factory.mktemp("bag") / "synthetic", duration_s=3.0, num_joints=8
    )
    node = NodeProcess(
        {
            "checkpoint_dir": str(tiny_checkpoint),
            "robot": "droid",  # action_space: droid's own (velocity), gripper: its 8th dim
            "rate_hz": 10.0,
            "camera_topics": [camera_topic("base"), camera_topic("wrist")],
            "camera_slots": ["base_0_rgb", "left_wrist_0_rgb"],
            "joint_names": JOINTS,
            "action_dt": DT,
            "max_joint_velocity": [MAX_VELOCITY] * 8,
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


def test_velocity_command_carries_velocities_and_integrated_positions(probe):
    since = time.monotonic()
    assert wait_for(lambda: len(probe.trajectories_since(since)) >= 3, 30), (
        "fewer than 3 trajectories in 30 s"
    )
    chunks = {stamp_ns(c.header.stamp): c for c in probe.chunks_since(since - 1.0)}
    grippers = {stamp_ns(g.header.stamp): g for g in probe.gripper_trajectories_since(since - 1.0)}
    matched = 0
    for trajectory in probe.trajectories_since(since):
        assert list(trajectory.joint_names) == JOINTS[:7]  # the gripper has its own controller
        positions = np.array([p.positions for p in trajectory.points])
        velocities = np.array([p.velocities for p in trajectory.points])
        assert positions.shape == velocities.shape == (10, 7)  # the tiny model's horizon, 7 arm
        times = [
            p.time_from_start.sec + p.time_from_start.nanosec * 1e-9 for p in trajectory.points
        ]
        assert times == pytest.approx([(i + 1) * DT for i in range(10)], abs=1e-6)
        # each point is where the previous one ends plus this step's velocity * dt; the last
        # point keeps that position and ends at rest (a stock controller's rule)
        np.testing.assert_allclose(
            positions[1:-1] - positions[:-2], velocities[1:-1] * DT, atol=1e-5
        )
        assert not velocities[-1].any()
        assert np.abs(velocities).max() <= MAX_VELOCITY + 1e-5  # limits act on the velocities
        chunk = chunks.get(stamp_ns(trajectory.header.stamp))
        gripper = grippers.get(stamp_ns(trajectory.header.stamp))
        if chunk is None or gripper is None:
            continue
        matched += 1
        assert chunk.action_space == "velocity"
        published = np.array(chunk.actions, dtype=np.float64).reshape(
            chunk.horizon, chunk.action_dim
        )
        # arm: velocities (the model's, also at the last step), integrated into the positions
        np.testing.assert_allclose(published[:-1, :7], velocities[:-1], atol=1e-5)
        np.testing.assert_allclose(positions[-1] - positions[-2], published[-1, :7] * DT, atol=1e-5)
        # gripper: positions, on ~/gripper_trajectory
        assert list(gripper.joint_names) == [JOINTS[7]]
        gripper_positions = np.array([p.positions for p in gripper.points])[:, 0]
        np.testing.assert_allclose(published[:, 7], gripper_positions, atol=1e-5)
    assert matched >= 1, "no trajectory matched an ActionChunk by stamp"
