"""On-policy recording (`oxygen_ros.sim.on_policy`, ``oxygen-sim-dataset on-policy``): whoever
drives, every frame is labelled with the plan the expert makes from that frame's state, failed
episodes are kept, and the expert takes up a cube the driver grasped."""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco's first import

import dataclasses
import json

import numpy as np
import pytest

from oxygen_ros.sim.episode import (
    ARM_CONTROLLER,
    GRIPPER_CONTROLLER,
    RUNNING,
    SUCCESS,
    Simulation,
)
from oxygen_ros.sim.expert import (
    CARRY,
    DESCEND,
    HOVER_Z,
    LIFT,
    LOWER,
    OPEN,
    RELEASE_ACROSS,
    ScriptedExpert,
)
from oxygen_ros.sim.headless import drive_expert, steps_per_plan
from oxygen_ros.sim.on_policy import TAKEOVER_WITHIN_S, record_on_policy_episode, takeover_time
from oxygen_ros.sim.recording import EpisodeSpec, episode_task, expert_label, write_demonstrations
from oxygen_ros.sim.scene import CUBE_SIZE, HOME, PAD_THICKNESS
from oxygen_ros.tools.sim_dataset import main as sim_dataset_main
from oxygen_ros.training.dataset import load_training_frames

SEED = 5_900_000


@pytest.fixture(scope="module")
def sim():
    sim = Simulation(episode_timeout_s=12.0)
    yield sim
    sim.world.close()


class ExpertDriver:
    """Drives with an expert of its own, keeping the labels it sent."""

    def __init__(self) -> None:
        self.sent: list[np.ndarray] = []

    def start(self, sim, noise_seed: int) -> None:
        self.expert = ScriptedExpert(corrective=True)  # the labeller's kind, to get its plans

    def act(self, sim, images, state) -> None:
        assert set(images) == {"scene", "wrist"}
        planned = self.expert.plan(sim.privileged_state())
        sim.receive(ARM_CONTROLLER, planned[0])
        sim.receive(GRIPPER_CONTROLLER, planned[1])
        self.sent.append(expert_label(planned, sim.now_s))

    def close(self) -> None:
        pass


class StillDriver:
    """Never moves the arm."""

    def start(self, sim, noise_seed: int) -> None:
        self.frames = 0

    def act(self, sim, images, state) -> None:
        self.frames += 1

    def close(self) -> None:
        pass


@pytest.mark.parametrize("kind", ["place", "two_step"])
def test_an_expert_driver_gets_its_own_plans_as_labels(sim, kind):
    driver = ExpertDriver()
    spec = EpisodeSpec(kind, SEED, timeout_s=30.0)
    episode = record_on_policy_episode(sim, spec, driver, labels="per_frame")
    assert episode.status == SUCCESS
    assert episode.task == episode_task(spec).text
    assert len(episode) == len(driver.sent) > 20
    np.testing.assert_allclose(np.stack(episode.frames["action"]), np.stack(driver.sent))
    assert any(s.startswith("carry the ") for s in episode.frames["subtask"])
    if kind == "two_step":  # the second step's subtask follows the first's
        second = episode_task(spec).steps[1]
        assert any(f"the {second.cube} cube" in s for s in episode.frames["subtask"][-5:])


def test_a_still_arm_is_labelled_towards_the_cube_and_kept_when_failures_are(tmp_path, sim):
    driver = StillDriver()
    spec = EpisodeSpec("touch", SEED + 1, timeout_s=2.05)
    episode = record_on_policy_episode(sim, spec, driver, labels="per_frame")
    assert episode.status != SUCCESS
    assert len(episode) == driver.frames == 21  # 0 s to 2 s at 10 fps
    states = np.stack(episode.frames["observation.state"])
    actions = np.stack(episode.frames["action"])
    np.testing.assert_allclose(states[0], states[-1], atol=1e-3)  # nothing moved it
    # the expert plans a move away from where the arm stays, every frame
    assert (np.abs(actions[:, :5] - states[:, :5]).max(axis=1) > 1e-3).all()

    def record(sim, spec):
        return record_on_policy_episode(sim, spec, StillDriver(), labels="per_frame")

    with pytest.raises(ValueError, match="1 failed, 0 succeeded with no frame recorded"):
        write_demonstrations(tmp_path / "dropped", [spec], sim, record=record)
    report = write_demonstrations(tmp_path / "kept", [spec], sim, record=record, keep_failures=True)
    assert (report.episodes, report.frames, report.failed) == (1, 21, [spec])
    frames = load_training_frames(tmp_path / "kept")
    assert len(frames) == 21


def test_the_expert_takes_over_from_where_the_policy_left_the_arm_and_only_that_is_recorded(sim):
    spec = EpisodeSpec("place", SEED + 5, timeout_s=30.0)
    takeover = takeover_time(spec)
    assert takeover == takeover_time(spec)  # drawn from the seed
    assert 0.0 <= takeover < TAKEOVER_WITHIN_S["place"]
    driver = StillDriver()
    episode = record_on_policy_episode(sim, spec, driver)  # labels="takeover"
    assert driver.frames == int(np.ceil(takeover * 10 - 1e-9))  # it drove the frames before
    assert episode.status == SUCCESS  # the expert finished the place from there
    states = np.stack(episode.frames["observation.state"])
    actions = np.stack(episode.frames["action"])
    assert len(episode) > 20
    # the first recorded frame is where the still policy left the arm (the start pose); from
    # there each label is the next frame's command of one trajectory, which the arm follows
    np.testing.assert_allclose(states[0, :5], HOME, atol=2e-2)
    assert np.abs(actions[:-1, :5] - states[1:, :5]).max() < 0.15
    with pytest.raises(ValueError, match="labels must be one of"):
        record_on_policy_episode(sim, spec, driver, labels="every_frame")


def test_an_episode_the_policy_finished_before_the_takeover_is_counted_not_written(tmp_path, sim):
    seeds = (SEED + k for k in range(100))
    spec = next(
        s for s in (EpisodeSpec("touch", seed) for seed in seeds) if takeover_time(s) > 2.5
    )  # the expert touches in about 1.5 s
    with pytest.raises(ValueError, match="0 failed, 1 succeeded with no frame recorded"):
        write_demonstrations(
            tmp_path / "none",
            [spec],
            sim,
            record=lambda sim, spec: record_on_policy_episode(sim, spec, ExpertDriver()),
        )


def test_the_expert_lifts_a_cube_someone_else_grasped(sim):
    task = episode_task(EpisodeSpec("place", SEED + 2))
    sim.reset(task, SEED + 2)
    for _ in drive_expert(sim):
        if sim.privileged_state().grasped == task.cube:
            break
    else:
        pytest.fail("the expert never grasped the cube")
    fresh = ScriptedExpert()  # it starts at the approach, as if it had not grasped
    _, gripper = fresh.plan(sim.privileged_state())
    assert fresh.step == LIFT
    assert gripper.points[0].positions[0] == 1.0  # it keeps the gripper closed


def _grasped_place(sim, seed: int):
    """A place episode driven by the expert up to the moment it holds the cube."""
    task = episode_task(EpisodeSpec("place", seed))
    sim.reset(task, seed)
    for _ in drive_expert(sim):
        state = sim.privileged_state()
        if state.grasped == task.cube:
            return task, state
    pytest.fail("the expert never grasped the cube")


def test_a_corrective_expert_lowers_from_the_height_a_policy_carries_at(sim):
    task, held = _grasped_place(sim, SEED + 3)
    pad = np.array(held.pads[task.pad])
    grip = held.tip - held.cubes[task.cube]

    def carried(x: float, y: float, z: float):  # the held cube goes where the tip goes
        tip = np.array([x, y, z])
        return dataclasses.replace(held, tip=tip, cubes={**held.cubes, task.cube: tip - grip})

    experts = {"corrective": ScriptedExpert(corrective=True), "demonstrating": ScriptedExpert()}
    targets = {}
    for name, expert in experts.items():
        expert.target(carried(*held.tip[:2], 0.06))  # lifted 6 cm, below the hover height
        targets[name], gripper = expert.target(carried(pad[0] + 0.015, pad[1], 0.06))
        assert gripper == 1.0
    # 1.5 cm beside the pad's centre: straight down onto it, not back up to the hover height
    assert experts["corrective"].step == LOWER
    np.testing.assert_allclose(targets["corrective"][:2], pad)
    assert targets["corrective"][2] < 0.04
    assert experts["demonstrating"].step == LIFT  # it lifts to its hover height first
    assert targets["demonstrating"][2] == pytest.approx(HOVER_Z)
    # 3 cm beside it: across at this height; 5 cm beside and low: up, then across
    corrective = experts["corrective"]
    target, _ = corrective.target(carried(pad[0] + 0.03, pad[1], 0.06))
    assert corrective.step == CARRY
    np.testing.assert_allclose(target, [pad[0], pad[1], 0.06])
    target, _ = corrective.target(carried(pad[0] + 0.05, pad[1], 0.04))
    assert corrective.step == CARRY and target[2] == pytest.approx(HOVER_Z)


def test_a_corrective_expert_lets_a_cube_go_wherever_it_lands_on_the_pad(sim):
    task, held = _grasped_place(sim, SEED + 3)
    pad = np.array(held.pads[task.pad])
    grip = held.tip - held.cubes[task.cube]

    def cube_at(x: float, y: float, bottom: float):  # the held cube's centre and bottom height
        cube = np.array([x, y, PAD_THICKNESS + bottom + CUBE_SIZE / 2])
        return dataclasses.replace(held, tip=cube + grip, cubes={**held.cubes, task.cube: cube})

    corrective, demonstrating = ScriptedExpert(corrective=True), ScriptedExpert()
    for expert in (corrective, demonstrating):
        expert.target(cube_at(*held.cubes[task.cube][:2], 0.04))  # lifted, below the hover height
    # the cube 2 cm off the centre along one edge and 2 cm along the other (2.8 cm away): down
    corrective.target(cube_at(pad[0] + 0.02, pad[1] - 0.02, 0.03))
    assert corrective.step == LOWER
    # 4 mm above the pad there: open, holding still
    low = cube_at(pad[0] + 0.02, pad[1] - 0.02, 0.004)
    target, gripper = corrective.target(low)
    assert corrective.step == OPEN and gripper == 0.0
    np.testing.assert_allclose(target, low.tip)
    # 3 cm off along one edge the cube might land on the pad's rim: carry it across first
    again = ScriptedExpert(corrective=True)
    again.target(cube_at(*held.cubes[task.cube][:2], 0.04))
    target, gripper = again.target(cube_at(pad[0] + 0.03, pad[1], 0.004))
    assert again.step == CARRY and gripper == 1.0
    # the demonstrating expert only lets go at the pad's centre
    demonstrating.target(low)
    assert demonstrating.step != OPEN


def test_a_cube_let_go_at_the_corner_of_the_release_zone_lands_on_the_pad(sim):
    task = episode_task(EpisodeSpec("place", SEED + 5))
    sim.reset(task, SEED + 5)
    pad = np.array(sim.privileged_state().pads[task.pad])
    corner = pad - RELEASE_ACROSS * np.sign(pad)  # towards the base, where the arm reaches
    expert = ScriptedExpert()  # it lets go where it thinks the pad's centre is: the corner
    while sim.status == RUNNING:  # the episode times out after 12 s
        state = sim.privileged_state()
        planned = expert.plan(dataclasses.replace(state, pads={**state.pads, task.pad: corner}))
        sim.receive(ARM_CONTROLLER, planned[0])
        sim.receive(GRIPPER_CONTROLLER, planned[1])
        for _ in range(steps_per_plan(sim, 10.0)):
            sim.control_step()
    assert sim.status == SUCCESS
    landed = sim.privileged_state().cubes[task.cube][:2]
    np.testing.assert_allclose(np.abs(landed - pad), RELEASE_ACROSS, atol=0.006)


def test_a_corrective_expert_goes_down_to_a_cube_from_a_cone_above_it(sim):
    task = episode_task(EpisodeSpec("place", SEED + 4))
    sim.reset(task, SEED + 4)
    state = sim.privileged_state()
    cube = state.cubes[task.cube]
    grasp = cube + [0.0, 0.0, 0.002]

    def tip_at(dx: float, z: float):
        return dataclasses.replace(state, tip=np.array([cube[0] + dx, cube[1], z]))

    expert = ScriptedExpert(corrective=True)
    # 2 cm beside at 6 cm the fingers would catch the cube's top on the way down: re-centre there
    target, gripper = expert.target(tip_at(0.02, 0.06))
    assert expert.step != DESCEND and gripper == 0.0
    np.testing.assert_allclose(target, [cube[0], cube[1], 0.06])
    # 1 cm beside at 6 cm: straight down to the grasp point
    target, _ = expert.target(tip_at(0.01, 0.06))
    assert expert.step == DESCEND
    np.testing.assert_allclose(target, grasp)
    # 1.5 cm beside, low: out of the cone, and too low to move across: up first
    target, _ = expert.target(tip_at(0.015, 0.03))
    assert expert.step != DESCEND and target[2] == pytest.approx(HOVER_Z)


def test_the_command_records_a_checkpoint_driving(tmp_path, capsys):
    out = tmp_path / "on_policy"
    rc = sim_dataset_main(
        ["on-policy", "--out", str(out), "--checkpoint", "models/sim_so101", "--touch", "1",
         "--continuity", "none", "--labels", "per_frame"]
    )  # fmt: skip
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["episodes"] == summary["written"] == 1 and summary["frames"] > 0
    info = json.loads((out / "meta" / "info.json").read_text())
    assert info["total_frames"] == summary["frames"]


def test_the_command_refuses_no_episodes(capsys):
    with pytest.raises(SystemExit):
        sim_dataset_main(["on-policy", "--out", "x", "--checkpoint", "models/sim_so101"])
    assert "episode counts" in capsys.readouterr().err
