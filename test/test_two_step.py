"""Two-step instructions ("put the red cube on the green pad, then touch the blue cube"): their
texts, their scoring in order on the real sim, the subtasks across the steps, the scripted
expert, and the benches' and the dataset tool's handling of them."""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco's first import, as oxygen_ros.sim does

import argparse  # noqa: E402
import math  # noqa: E402

import mujoco  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from oxygen_ros.sim import grounding  # noqa: E402
from oxygen_ros.sim.episode import (  # noqa: E402
    RUNNING,
    SUCCESS,
    TIMEOUT,
    UNDONE,
    WRONG_CUBE,
    Simulation,
)
from oxygen_ros.sim.expert import HOVER_Z  # noqa: E402
from oxygen_ros.sim.headless import drive_expert, run_expert_episode  # noqa: E402
from oxygen_ros.sim.language import SceneFacts, current_phase, every_phase  # noqa: E402
from oxygen_ros.sim.recording import EpisodeSpec, episode_task  # noqa: E402
from oxygen_ros.sim.tasks import (  # noqa: E402
    PLACE,
    TASK_KINDS,
    TOUCH,
    TWO_STEP,
    Task,
    TaskError,
    cube_on_pad,
    parse_task,
    random_task,
    two_step,
)
from oxygen_ros.tools import sim_dataset  # noqa: E402
from oxygen_ros.tools.benches import closed_loop, harness  # noqa: E402
from oxygen_ros.tools.benches import closed_loop_metrics as m  # noqa: E402

PLACE_THEN_TOUCH = "put the red cube on the green pad, then touch the blue cube"
PLACE_THEN_PLACE = "put the green cube on the blue pad, then put the red cube on the green pad"
SEED = 11  # a layout both forms above succeed on, step by step, in a few sim seconds


@pytest.fixture(scope="module")
def sim():
    simulation = Simulation(episode_timeout_s=30.0)
    yield simulation
    simulation.world.close()


def drive_until(sim: Simulation, done, **kwargs) -> None:
    """Drive the expert on the running episode until ``done()`` holds or the episode ends."""
    for _ in drive_expert(sim, **kwargs):
        if done():
            return


def distinct(values: list) -> list:
    """``values`` with consecutive repeats dropped."""
    return [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]


# -- texts -----------------------------------------------------------------------------------------
def test_two_step_texts_round_trip_and_expose_their_steps():
    touch = parse_task(PLACE_THEN_TOUCH)
    assert touch == two_step(Task(PLACE, "red", "green"), Task(TOUCH, "blue"))
    assert (touch.kind, touch.cube, touch.pad) == (TWO_STEP, "red", "green")
    assert touch.steps == (Task(PLACE, "red", "green"), Task(TOUCH, "blue"))
    assert touch.text == PLACE_THEN_TOUCH and parse_task(touch.text) == touch
    place = parse_task(PLACE_THEN_PLACE.upper() + ".")
    assert place.steps == (Task(PLACE, "green", "blue"), Task(PLACE, "red", "green"))
    assert place.text == PLACE_THEN_PLACE
    assert parse_task("put the red cube on the green pad then touch the blue cube") == touch
    # the one-step kinds are what they were
    assert Task(TOUCH, "red").steps == (Task(TOUCH, "red"),)
    assert parse_task("touch the red cube") == Task(TOUCH, "red")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("put the red cube on the green pad, then touch the red cube", "red cube twice"),
        ("put the red cube on the green pad, then put the red cube on the blue pad", "twice"),
        ("put the red cube on the green pad, then put the blue cube on the green pad", "pad twice"),
        ("touch the red cube, then touch the blue cube", "unknown task"),
        ("put the red cube on the green pad, then touch the purple cube", "no purple cube"),
        ("put the red cube on the green pad, then stack the cubes", "unknown task"),
    ],
)
def test_bad_two_step_texts_are_refused_clearly(text, error):
    with pytest.raises(TaskError, match=error):
        parse_task(text)


def test_random_tasks_draw_two_step_only_when_asked():
    assert TWO_STEP not in TASK_KINDS
    for seed in range(40):
        assert random_task(np.random.default_rng(seed)).kind in TASK_KINDS
        task = random_task(np.random.default_rng(seed), TWO_STEP)
        first, then = task.steps
        assert first.kind == PLACE and then.cube != first.cube
        assert then.kind == TOUCH or then.pad != first.pad
        assert parse_task(task.text) == task
    forms = {random_task(np.random.default_rng(s), TWO_STEP).then.kind for s in range(40)}
    assert forms == {TOUCH, PLACE}
    assert episode_task(EpisodeSpec(TWO_STEP, 5)).kind == TWO_STEP


def test_the_language_follows_the_current_step():
    task = parse_task(PLACE_THEN_TOUCH)
    far = SceneFacts(False, None, 0.2, math.inf, False, "near left")
    assert current_phase(task, far).subtask == "reach the red cube, near left"
    second = SceneFacts(False, None, 0.2, math.inf, False, "near left", step=1)
    assert current_phase(task, second).subtask == "touch the blue cube, near left"
    phases = every_phase(task)
    assert set(every_phase(Task(PLACE, "red", "green"))) <= set(phases)
    assert set(every_phase(Task(TOUCH, "blue"))) <= set(phases)
    assert len(phases) == len(set(phases))


# -- scoring on the sim ----------------------------------------------------------------------------
def test_the_second_step_done_first_does_not_count(sim):
    task = parse_task(PLACE_THEN_PLACE)
    first, second = task.steps
    sim.reset(task, SEED, timeout_s=16.0)

    def resting(step: Task) -> bool:
        world = sim.world
        cube, pad = world.cube_position(step.cube), world.pad_center(step.pad)
        return cube_on_pad(cube, world.cube_speed(step.cube), pad)

    def placed(step: Task) -> bool:  # on its pad, let go and the hand back up
        return resting(step) and sim.world.tip_position()[2] > HOVER_Z - 0.01

    drive_until(sim, lambda: placed(second), expert_task=second)  # the second place first
    assert sim.status == RUNNING and sim.step == 0  # it counts for nothing
    for _ in drive_expert(sim, expert_task=first):  # then the first: the order is still wrong
        pass
    assert resting(first) and resting(second)
    assert sim.status == TIMEOUT
    report = sim.episode_report()
    assert report["step"] == 2 and len(report["steps_done_s"]) == 1


@pytest.mark.parametrize("text", [PLACE_THEN_TOUCH, PLACE_THEN_PLACE])
def test_both_steps_in_order_succeed_and_the_subtasks_follow_them(sim, text):
    task = parse_task(text)
    sim.reset(task, SEED)
    phases = [(sim.step, sim.phase.key)]
    subtasks = [sim.phase.subtask]
    for _ in drive_expert(sim):
        phases.append((sim.step, sim.phase.key))
        subtasks.append(sim.phase.subtask)
    assert sim.status == SUCCESS, sim.episode_report()
    place = [(0, "reach"), (0, "grasp"), (0, "carry"), (0, "release")]
    if task.then.kind == TOUCH:
        assert distinct(phases) == [*place, (1, "reach")]
        assert sim.phase.key == "done" and sim.phase.subtask == "touch the blue cube"
    else:
        assert distinct(phases) == [*place, *((1, key) for _, key in place)]
        assert sim.phase.key == "done" and sim.phase.narration == "the red cube is on the green pad"
    second = subtasks[phases.index((1, "reach"))]
    assert second.startswith(f"{'touch' if task.then.kind == TOUCH else 'reach'} the ")
    assert task.then.cube in second
    report = sim.episode_report()
    assert report["step"] == 2 and report["steps"] == 2 and report["reason"] == ""
    assert report["step_task"] == task.then.text and len(report["steps_done_s"]) == 2
    first = task.steps[0]
    pad = sim.world.pad_center(first.pad)
    assert cube_on_pad(sim.world.cube_position(first.cube), 0.0, pad)  # the first still holds


def move_cube(sim: Simulation, colour: str, xyz: tuple[float, float, float]) -> None:
    """Put the cube of ``colour`` at ``xyz``, still, through the world's MuJoCo state."""
    model, data = sim.world.model, sim.world.data
    joint = model.joint(f"cube_{colour}")
    adr, dof = joint.qposadr[0], joint.dofadr[0]
    data.qpos[adr : adr + 3] = xyz
    data.qvel[dof : dof + 6] = 0.0
    mujoco.mj_forward(model, data)


def test_the_first_cube_moved_off_its_pad_undoes_the_episode(sim):
    task = parse_task(PLACE_THEN_TOUCH)
    sim.reset(task, SEED)
    drive_until(sim, lambda: sim.step == 1)
    assert sim.status == RUNNING and sim.step == 1
    for _ in range(20):  # the second step under way, the first cube resting on its pad
        sim.control_step()
    assert sim.status == RUNNING
    x, y = sim.world.pad_center("green")
    move_cube(sim, "red", (x, y + 0.06, 0.015))  # slid off the pad's edge onto the table
    sim.control_step()
    assert sim.status == UNDONE
    report = sim.episode_report()
    assert report["status"] == UNDONE and report["step"] == 2
    assert report["reason"] == "the red cube left the green pad after it was placed"


def test_a_touch_step_touching_another_cube_first_fails(sim):
    task = parse_task(PLACE_THEN_TOUCH)
    sim.reset(task, SEED)
    # the first step done and the hand back above the pad, clear of the placed cube
    drive_until(sim, lambda: sim.step == 1 and sim.world.tip_position()[2] > HOVER_Z - 0.01)
    for _ in drive_expert(sim, expert_task=Task(TOUCH, "green")):  # the wrong cube
        pass
    assert sim.status == WRONG_CUBE
    report = sim.episode_report()
    assert report["touched_first"] == ["green"]
    assert report["reason"] == "touched the green cube before the blue cube"


# -- the expert ------------------------------------------------------------------------------------
def test_the_expert_does_both_steps_of_each_form(sim):
    forms = set()
    for round_index in range(6):
        task, seed = harness.round_task(round_index, 777, TWO_STEP)
        forms.add(task.then.kind)
        result = run_expert_episode(sim, task, seed)
        assert result.status == SUCCESS, (task.text, seed, sim.episode_report())
    assert forms == {TOUCH, PLACE}


# -- benches and data ------------------------------------------------------------------------------
def test_bench_rounds_are_deterministic_and_leave_touch_and_place_alone():
    rounds = [harness.round_task(i, 777, TWO_STEP) for i in range(8)]
    assert rounds == [harness.round_task(i, 777, TWO_STEP) for i in range(8)]
    assert [task.then.kind for task, _ in rounds] == [TOUCH, PLACE] * 4
    assert [seed for _, seed in rounds] == [777_000 + i for i in range(8)]
    for i in range(8):  # the first step is the round's place
        assert rounds[i][0].steps[0] == harness.round_task(i, 777, PLACE)[0]


def test_closed_loop_takes_two_step_with_its_own_timeout():
    parser = argparse.ArgumentParser()
    closed_loop.add_arguments(parser)
    two = parser.parse_args(["--tasks", "two_step"])
    assert harness.episode_timeout_s(two, two.tasks) == closed_loop.TWO_STEP_TIMEOUT_S
    touch = parser.parse_args([])
    assert harness.episode_timeout_s(touch, touch.tasks) == closed_loop.DEFAULT_TIMEOUT_S
    given = parser.parse_args(["--tasks", "two_step", "--timeout-s", "12"])
    assert harness.episode_timeout_s(given, given.tasks) == 12.0


def test_the_words_are_judged_against_the_current_step():
    task = parse_task(PLACE_THEN_TOUCH)
    timeline = [
        (0.0, "reach the red cube, near right"),
        (1.0, "carry the red cube to the green pad"),
        (3.0, "touch the blue cube, far left"),
    ]
    assert m.sim_phases(task, timeline, None, 1.5, 2.0) == {"1/carry"}
    assert m.sim_phases(task, timeline, None, 3.5, 4.0) == {"2/reach"}
    assert m.sim_phases(task, timeline, 4.5, 4.0, 5.0) == {"2/reach", "2/done"}
    assert m.judge_text(task, "carrying the red cube to the green pad", {"1/carry"})
    assert not m.judge_text(task, "carrying the red cube", {"1/carry"})  # the pad unnamed
    assert m.judge_text(task, "reaching for the blue cube", {"2/reach"})
    assert not m.judge_text(task, "reaching for the red cube", {"2/reach"})  # step 1's cube
    assert not m.judge_text(task, "reaching for the blue cube", {"1/reach"})
    assert m.step_at(task, timeline, 2.0) == task.steps[0]
    assert m.step_at(task, timeline, 3.5) == task.then
    assert m.step_at(task, timeline, float("nan")) == task.steps[0]
    place = parse_task(PLACE_THEN_PLACE)
    assert "1/done" not in m.task_phases(place) and m.done_key(place) == "2/done"
    assert m.phases_of_subtask(place, "done") == {"2/done"}


def test_the_dataset_tool_records_two_step_from_its_own_seeds():
    args = sim_dataset._parse_args(["demos", "--out", "x", "--touch", "0", "--two-step", "3"])
    assert args.two_step == 3 and args.two_step_seed == sim_dataset.DEFAULT_TWO_STEP_SEED
    block = grounding.SEED_BLOCK
    others = {
        sim_dataset.DEFAULT_TOUCH_SEED // block,
        sim_dataset.DEFAULT_PLACE_SEED // block,
        grounding.TRAIN_SEED0 // block,
        grounding.HELDOUT_SEED0 // block,
    }
    assert sim_dataset.DEFAULT_TWO_STEP_SEED // block not in others
