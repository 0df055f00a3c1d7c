"""Headless demonstrations (`oxygen_ros.sim.recording`): what each frame holds, the clean label
under DART drift, and the dataset the trainer reads back."""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco's first import

import numpy as np
import pytest

from oxygen_ros.sim.episode import SUCCESS, Simulation
from oxygen_ros.sim.recording import (
    CAMERA_PX,
    EpisodeSpec,
    demonstration_specs,
    episode_task,
    record_episode,
    write_demonstrations,
)
from oxygen_ros.sim.scene import HOME
from oxygen_ros.sim.tasks import parse_task, random_layout
from oxygen_ros.tools.sim_dataset import main as sim_dataset_main
from oxygen_ros.training.dataset import load_training_frames

SEED = 4_600_000


@pytest.fixture(scope="module")
def sim():
    sim = Simulation(episode_timeout_s=12.0)
    yield sim
    sim.world.close()


def test_a_touch_episode_records_every_frame_of_the_expert(sim):
    episode = record_episode(sim, EpisodeSpec("touch", SEED))
    assert episode.status == SUCCESS
    n = len(episode)
    assert n > 3
    assert episode.task == episode_task(EpisodeSpec("touch", SEED)).text
    for key in ("observation.images.scene", "observation.images.wrist"):
        assert len(episode.frames[key]) == n
        assert episode.frames[key][0].shape == (CAMERA_PX, CAMERA_PX, 3)
    states = np.stack(episode.frames["observation.state"])
    actions = np.stack(episode.frames["action"])
    np.testing.assert_allclose(states[0, :5], HOME, atol=1e-3)
    # an action is where the command asks the joints to be by the next frame: the arm gets there
    assert (
        np.abs(actions[:-1, :5] - states[1:, :5]).mean()
        < np.abs(states[:-1, :5] - states[1:, :5]).mean()
    )
    assert not (np.abs(np.diff(actions, axis=0)).max(axis=1) == 0).any()  # no repeated labels
    cube = episode.task.split()[2]
    assert episode.frames["subtask"][0].startswith(f"touch the {cube} cube, ")
    said = [s for s in episode.frames["narration"] if s]
    assert said[0].startswith(f"reaching for the {cube} cube, ")
    assert episode.frames["narration"][0] == said[0]  # said on the first frame


def test_settling_records_the_whole_reach_and_a_moment_at_the_goal(sim):
    """Past the touch (the first contact) the expert keeps its finger on the cube's top and holds
    there, without pushing the cube; the settling frames keep the reach's labels."""
    plain = record_episode(sim, EpisodeSpec("touch", SEED))
    settled = record_episode(sim, EpisodeSpec("touch", SEED, settle_s=1.0))
    assert settled.status == SUCCESS
    extra = len(settled) - len(plain)
    assert 9 <= extra <= 11  # 1 s at 10 fps
    for key in ("observation.state", "action", "subtask", "narration"):
        assert len(settled.frames[key]) == len(settled)
    np.testing.assert_allclose(
        np.stack(settled.frames["action"][: len(plain)]), np.stack(plain.frames["action"])
    )
    assert set(settled.frames["subtask"][len(plain) :]) == {plain.frames["subtask"][-1]}
    cube = parse_task(settled.task).cube  # the scene as the last settling frame left it
    assert cube in sim.world.cubes_touched()  # still resting on the cube
    start = random_layout(np.random.default_rng(SEED)).cubes[cube][:2]
    assert np.linalg.norm(sim.world.cube_position(cube)[:2] - start) < 0.003  # not pushed away
    states = np.stack(settled.frames["observation.state"])
    assert np.abs(states[-1] - states[-3]).max() < 0.02  # holding, not moving on
    with pytest.raises(ValueError, match="settle_s"):
        record_episode(sim, EpisodeSpec("touch", SEED, settle_s=-1.0))


def test_dart_drift_moves_the_arm_but_not_the_label_at_the_start(sim):
    clean = record_episode(sim, EpisodeSpec("touch", SEED + 1))
    drifted = record_episode(sim, EpisodeSpec("touch", SEED + 1, perturbation_rad=0.05))
    np.testing.assert_allclose(clean.frames["action"][0], drifted.frames["action"][0], atol=1e-6)
    n = min(len(clean), len(drifted))
    gap = np.abs(
        np.stack(clean.frames["observation.state"][:n])
        - np.stack(drifted.frames["observation.state"][:n])
    )
    assert gap.max() > 1e-3


def test_specs_spread_the_perturbed_share_evenly():
    specs = demonstration_specs("place", 10, 10, 0.3, 0.02)
    assert [s.seed for s in specs] == list(range(10, 20))
    assert sum(s.perturbation_rad > 0 for s in specs) == 3
    with pytest.raises(ValueError, match="perturbed_share"):
        demonstration_specs("touch", 0, 3, 1.5, 0.02)


def test_the_written_dataset_trains_as_recorded(tmp_path, sim):
    out = tmp_path / "ds"
    report = write_demonstrations(out, demonstration_specs("touch", SEED + 10, 2, 0.0, 0.0), sim)
    frames = load_training_frames(out)
    assert report.episodes == 2 and len(frames) == report.frames
    assert frames.num_episodes == 2
    assert set(frames.tasks) <= {f"touch the {c} cube" for c in ("red", "green", "blue")}
    assert all(frames.subtasks) and all(frames.narrations)  # held narration on every frame
    assert frames.images["observation.images.scene"].shape[1:] == (CAMERA_PX, CAMERA_PX, 3)


def test_the_command_refuses_nothing_to_do(capsys):
    with pytest.raises(SystemExit):
        sim_dataset_main(["demos", "--out", "/nonexistent/x", "--touch", "0", "--place", "0"])
    assert "not all 0" in capsys.readouterr().err
