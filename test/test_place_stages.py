"""Place, stage by stage (`oxygen_ros.tools.benches.place_stages`), on the real sim: the scripted
expert's place goes through every phase with one close that holds the cube on both fingers and
one release over the pad; a gripper closed high above the cube holds nothing; a chunk over the pad
is followed to where it would take the cube; each episode ends at one stage."""

from __future__ import annotations

import numpy as np
import pytest

from oxygen_ros.ros.convert import chunk_to_joint_trajectory, seconds_to_stamp
from oxygen_ros.sim.episode import GRIPPER_CONTROLLER, Simulation
from oxygen_ros.sim.headless import drive_expert
from oxygen_ros.sim.scene import GRIPPER_JOINT
from oxygen_ros.sim.tasks import Task
from oxygen_ros.tools.benches import place_stages
from oxygen_ros.tools.benches.place_stages import PlaceStages

TASK = Task("place", "red", "green")


@pytest.fixture(scope="module")
def sim():
    simulation = Simulation(episode_timeout_s=20.0)
    yield simulation
    simulation.world.close()


def test_the_experts_place_goes_through_every_stage(sim):
    sim.reset(TASK, 3)
    stages = PlaceStages(TASK)
    for _ in drive_expert(sim):
        if sim.now_s > 0:
            stages.observe(sim)
    stages.observe(sim)
    record = stages.record()
    assert sim.status == "success"
    assert record["furthest_phase"] == "done"
    assert record["held"]
    holding = [close for close in record["closes"] if close["held"]]
    assert len(holding) == 1 and holding[0]["fingers_touching"] == 2
    assert abs(holding[0]["tip_above_cube_m"]) < 0.01  # the expert closes at the cube's centre
    assert holding[0]["tip_speed_m_s"] < 0.05  # ... at rest
    assert holding[0]["off_faces_rad"] < 0.05  # ... square on to the cube's faces
    assert record["releases"] == 1 and record["releases_over_pad"] == 1
    (release,) = record["release_events"]
    assert release["from_pad_centre_m"] < 0.01 and abs(release["above_pad_m"]) < 0.005
    assert record["held_over_pad_s"] > 1.0 and abs(record["lowest_over_pad_m"]) < 0.005
    summary = place_stages.summarise([record])
    assert summary["held_over_pad_1s_episodes"] == 1 and summary["releases"] == 1
    assert summary["reached_phase"] == {p: 1 for p in place_stages.PHASES}
    assert summary["held_episodes"] == 1 and summary["released_over_pad_episodes"] == 1


def test_a_gripper_closed_above_the_cube_holds_nothing(sim):
    sim.reset(TASK, 3)
    stages = PlaceStages(TASK)
    closed = np.ones((3, 1))
    close = chunk_to_joint_trajectory(closed, [GRIPPER_JOINT], 0.1, seconds_to_stamp(sim.now_s))
    sim.receive(GRIPPER_CONTROLLER, close)
    for _ in range(150):
        sim.control_step()
        stages.observe(sim)
    record = stages.record()
    assert record["furthest_phase"] == "reach"
    assert not record["held"] and record["releases"] == 0
    assert record["held_over_pad_s"] == 0.0 and record["lowest_over_pad_m"] is None
    assert len(record["closes"]) == 1
    assert record["closes"][0]["fingers_touching"] == 0
    assert record["closes"][0]["tip_above_cube_m"] > 0.05  # the arm's start pose, far above
    summary = place_stages.summarise([record])
    assert summary["reached_phase"]["reach"] == 1 and summary["reached_phase"]["grasp"] == 0
    assert summary["closes"] == 1 and summary["closes_held"] == 0


def test_a_chunk_over_the_pad_is_followed_to_where_it_takes_the_cube(sim):
    sim.reset(TASK, 3)
    stages = PlaceStages(TASK)
    turned = 0
    for _ in drive_expert(sim):
        arm = sim.world.arm_positions()
        # the physics step's own kinematics, a fraction of a millimetre behind its state
        assert np.allclose(sim.world.tip_for(arm), sim.world.tip_position(), atol=1e-3)
        stay = np.tile(np.append(arm, 1.0), (10, 1))  # a chunk holding the arm where it is
        stages.plan(sim, stay)
        if sim.phase.key == "release" and sim.facts().grasped == TASK.cube and not turned:
            away = stay.copy()
            away[:, 0] += 1.0  # the base turned a radian: the cube swung far off the pad
            stages.plan(sim, away)
            turned = len(stages.release_aims)
    assert sim.status == "success" and turned
    aims = stages.record()["release_aims"]
    assert aims  # planned only while the cube was held over the pad
    swung = aims.pop(turned - 1)
    assert swung["planned_off_pad"]
    assert swung["planned_from_centre_m"] > swung["from_centre_m"] + 0.05
    for aim in aims:  # holding still: the cube stays where it is, over the pad
        assert aim["planned_from_centre_m"] == pytest.approx(aim["from_centre_m"], abs=1e-4)
        assert not aim["planned_off_pad"]
    record = stages.record()
    summary = place_stages.summarise([record])
    assert summary["release_plans"] == len(aims) + 1 and summary["release_plans_off_pad"] == 1


def test_each_episode_ends_at_the_stage_it_got_furthest_to():
    def episode(furthest, releases=0, over_pad=0):
        return {"furthest_phase": furthest, "releases": releases, "releases_over_pad": over_pad}

    endings = [
        place_stages.ended_at(e)
        for e in (
            episode("reach"),
            episode("grasp", releases=2),
            episode("carry", releases=1),
            episode("release", releases=2),
            episode("release"),
            episode("release", releases=2, over_pad=1),
            episode("done", releases=1, over_pad=1),
        )
    ]
    assert endings == list(place_stages.ENDINGS)
