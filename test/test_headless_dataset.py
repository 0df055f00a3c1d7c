"""Both ways of making demonstrations give the same frames for one seed: the bag path
(``oxygen-collect`` -> rosbag2 -> ``oxygen-bag-to-lerobot`` with ``config/sim_dataset.yaml``:
every message through DDS, the expert in lockstep with the sim) and the headless path
(:mod:`oxygen_ros.sim.recording`, no ROS).

What differs, and why (each asserted exactly):

* the bag's frame grid starts at the sim's first camera image, which the sim node publishes after
  the episode's first control step (10 ms in), where the headless recorder renders before it. So
  the bag's frames lie 10 ms after the headless ones; from frame 1 on they hold the same camera
  images and joint states (both taken at the camera's ticks), frame 0 holds them one control step
  later (the same joint state, an image a few pixels apart);
* actions are sampled one frame period after each frame, so on the bag's grid 10 ms later: the same
  plans, a tenth of a planning interval further along (< 0.01 rad);
* the bag has a few more frames: ``oxygen-collect`` records ``TAIL_S`` of sim time after the
  episode ends (the arm holding still, the success sentence said on the first of them), and the
  headless recorder stops at the end;
* strings carry no stamp: the bag places each where the recorder received it (its clock follows
  ``/clock``, published after the strings of the same step, and a busy recorder receives late),
  so a sentence or a new subtask may land one frame apart from where the headless recorder puts
  it; the same strings, in the same order, either way. The sim runs paced (real time): unpaced, a
  recorder that falls behind places strings frames late (states, images and actions stay exact).
"""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco's first import

from pathlib import Path

import numpy as np
import pytest

from oxygen_ros.data.bag_to_lerobot import convert_bags
from oxygen_ros.data.lerobot_dataset import LeRobotDatasetContent, read_dataset
from oxygen_ros.data.mapping import load_mapping
from oxygen_ros.sim.episode import Simulation
from oxygen_ros.sim.recording import EpisodeSpec, write_demonstrations
from oxygen_ros.tools.collect import TAIL_S
from oxygen_ros.tools.collect import main as collect_main

pytestmark = [pytest.mark.ros, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
MAPPING = REPO / "config" / "sim_dataset.yaml"
SEED = 3  # a touch episode of 1.5 sim s: 15 frames
FPS = 10
EPOCH_S = 1000.0


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> tuple[LeRobotDatasetContent, LeRobotDatasetContent]:
    """(bag path, headless path) datasets of the touch episode of SEED."""
    root = tmp_path_factory.mktemp("paths")
    bags = root / "bags"
    args = ["--out", str(bags), "--episodes", "1", "--kind", "touch", "--seed", str(SEED)]
    # both sim clocks start at EPOCH_S: the same floating-point times, hence the same arithmetic
    # (and no trajectory stamped 0, which ROS reads as "start on receipt")
    ros_args = ["--ros-args", "-p", f"sim_epoch_s:={EPOCH_S}"]
    assert collect_main([*args, *ros_args]) == 0
    convert_bags(sorted(bags.iterdir()), root / "bag_ds", load_mapping(MAPPING))
    sim = Simulation(epoch_s=EPOCH_S)
    try:
        report = write_demonstrations(root / "headless_ds", [EpisodeSpec("touch", SEED)], sim)
    finally:
        sim.world.close()
    assert report.episodes == 1
    return read_dataset(root / "bag_ds"), read_dataset(root / "headless_ds")


def said(column: list[str]) -> list[tuple[int, str]]:
    """(frame, text) of each non-empty string of an event column."""
    return [(frame, text) for frame, text in enumerate(column) if text]


def changes(column: list[str]) -> list[tuple[int, str]]:
    """(frame, text) where a latest-value column takes a new value."""
    return [(f, t) for f, t in enumerate(column) if f == 0 or t != column[f - 1]]


def test_same_layout_task_and_words(datasets) -> None:
    bag, headless = datasets
    assert bag.info["features"] == headless.info["features"]
    assert (bag.info["fps"], bag.info["robot_type"]) == (headless.info["fps"], "so101_sim")
    assert bag.tasks == headless.tasks and bag.tasks[0].startswith("touch the ")
    n = len(headless.frames["action"])
    cube = bag.tasks[0].split()[2]
    for events, column in ((said, "narration"), (changes, "subtask")):
        ours, theirs = events(bag.frames[column][:n]), events(headless.frames[column])
        assert [text for _, text in ours] == [text for _, text in theirs], column
        assert all(abs(a - b) <= 1 for (a, _), (b, _) in zip(ours, theirs, strict=True)), column
    # the end, said once the episode has ended: after the headless recorder's last frame
    assert said(bag.frames["narration"][n:])[0][1] == f"the gripper is touching the {cube} cube"


def test_the_bag_adds_only_the_tail_after_the_episode(datasets) -> None:
    bag, headless = datasets
    n = len(headless.frames["action"])
    tail = len(bag.frames["action"]) - n
    # the frames at or after the end (the first one hears the success sentence): TAIL_S, one
    # frame less where the end falls late in a frame period (the headless recorder already took
    # that frame), plus the steps the sim ran while oxygen-collect (polling every 20 ms of wall
    # time) paused it
    assert round(TAIL_S * FPS) - 1 <= tail <= round(TAIL_S * FPS) + 10
    assert said(bag.frames["narration"][n:])  # the tail is there: it hears the success sentence


def test_same_states_images_and_actions(datasets) -> None:
    bag, headless = datasets
    n = len(headless.frames["action"])
    ours, theirs = bag.frames["observation.state"][:n], headless.frames["observation.state"]
    np.testing.assert_array_equal(ours[1:], theirs[1:])
    np.testing.assert_allclose(ours[0], theirs[0], atol=1e-6)  # one control step later, at rest
    for key in ("observation.images.scene", "observation.images.wrist"):
        ours, theirs = bag.frames[key][:n].astype(int), headless.frames[key].astype(int)
        np.testing.assert_array_equal(ours[1:], theirs[1:])
        assert np.abs(ours[0] - theirs[0]).mean() < 1.0  # one control step later
    actions, expected = bag.frames["action"][:n], headless.frames["action"]
    np.testing.assert_array_equal(actions[:, 5], expected[:, 5])  # the gripper's one-point plans
    np.testing.assert_allclose(actions[:, :5], expected[:, :5], atol=0.01)
    # the same arm plans sampled 10 ms further along: apart by about a tenth of the way to the
    # next frame's label (less where a plan reaches its target within the frame)
    step = np.linalg.norm(np.diff(expected[:, :5], axis=0), axis=1)
    apart = np.linalg.norm(actions[:-1, :5] - expected[:-1, :5], axis=1)
    assert np.all(apart <= 0.15 * step), (apart / step).round(3)
