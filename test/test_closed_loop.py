"""The closed-loop bench (``oxygen-bench closed-loop``): its metrics on hand-made data, its
machinery over DDS for a few short episodes (the expert succeeds in all, a policy setting runs end
to end through the real node and reports every field, no controller rejections), the trained
policy when its checkpoint is present, and the node starting a fresh run on activation."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from oxygen_ros.sim.episode import SUCCESS, TIMEOUT, WRONG_CUBE
from oxygen_ros.sim.tasks import Task, parse_task
from oxygen_ros.tools.benches import closed_loop
from oxygen_ros.tools.benches import closed_loop_metrics as m
from oxygen_ros.tools.benches.closed_loop_ros import Recording
from oxygen_ros.tools.benches.closed_loop_settings import (
    Setting,
    all_settings,
    parse_delays,
    random_variant,
    select,
)

REPO = Path(__file__).resolve().parents[1]
ENDS = (SUCCESS, TIMEOUT, WRONG_CUBE)  # the sim's verdicts on an episode
TRAINED = REPO / "models" / "sim_so101"
SIM_CAMERAS = ("observation.images.scene", "observation.images.wrist")


# -- metrics on hand-made data --------------------------------------------------------------------
def test_wilson_interval_matches_the_textbook_values():
    assert m.wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert m.wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert m.wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert m.wilson_interval(0, 0) == (0.0, 1.0)


def test_jerk_is_the_third_derivative_and_a_gap_is_not_a_jerk():
    t = np.arange(0, 1.0, 0.02)
    q = np.stack([t**3, 2 * t**3], axis=1)  # jerk 6 and 12
    assert m.rms_jerk(t, q) == pytest.approx(math.sqrt((36 + 144) / 2), rel=1e-6)
    line = np.stack([t, -t], axis=1)
    assert m.rms_jerk(t, line) == pytest.approx(0.0, abs=1e-6)
    # a lost sample (a gap of two steps) leaves those windows out instead of reading as a jerk
    kept = np.delete(np.arange(len(t)), 20)
    assert m.rms_jerk(t[kept], line[kept]) == pytest.approx(0.0, abs=1e-6)
    assert math.isnan(m.rms_jerk(t[:3], line[:3]))


def test_chunk_switch_jump_is_the_reference_discontinuity_at_arrival():
    ramp = m.Plan(np.array([0.0, 1.0]), np.array([[0.0, 0.0], [1.0, 2.0]]))
    continued = m.Plan(np.array([0.5, 1.5]), np.array([[0.5, 1.0], [1.5, 3.0]]))
    jumped = m.Plan(np.array([0.5, 1.5]), np.array([[0.8, 1.0], [0.8, 1.0]]))
    assert m.switch_jumps([ramp, continued], [0.0, 0.5]) == pytest.approx([0.0])
    assert m.switch_jumps([ramp, jumped], [0.0, 0.5]) == pytest.approx([0.3])
    # before its first point a plan holds it: arriving at 0.25, the new plan says 0.8
    assert m.switch_jumps([ramp, jumped], [0.0, 0.25]) == pytest.approx([0.55])


def test_language_judging_against_the_sims_own_texts():
    place = Task("place", "red", "green")
    for key, phase in m.task_phases(place).items():
        for text in (phase.subtask, phase.narration):
            if text != "done":
                assert m.judge_text(place, text, {key}), (key, text)
    assert not m.judge_text(place, "grasping the blue cube", {"grasp"})  # wrong object
    assert not m.judge_text(place, "carrying the red cube to the green pad", {"reach"})  # phase
    assert not m.judge_text(place, "carrying the red cube", {"carry"})  # the pad unnamed
    touch = Task("touch", "blue")
    assert m.phases_of_subtask(touch, "touch the blue cube") == {"reach", "done"}
    assert m.phases_of_subtask(touch, "touch the blue cube, near right") == {"reach", "done"}
    timeline = [(0.0, "touch the blue cube")]
    assert m.sim_phases(touch, timeline, None, 1.0, 2.0) == {"reach"}
    assert m.sim_phases(touch, timeline, 1.5, 1.0, 2.0) == {"reach", "done"}
    assert m.judge_text(touch, "reaching for the blue cube", {"reach"})
    assert m.judge_text(touch, "touch the blue cube", {"reach"})  # the subtask of both phases
    assert not m.judge_text(touch, "the gripper is touching the blue cube", {"reach"})
    steps = [(0.0, "reach the red cube"), (3.0, "grasp the red cube")]
    assert m.sim_phases(place, steps, None, 2.5, 3.5) == {"reach", "grasp"}
    assert m.strip_kind("[narration] reaching for the red cube") == (
        "narration",
        "reaching for the red cube",
    )
    assert m.names_colour("the red one", "red") and not m.names_colour("red or blue", "red")


def test_place_words_are_judged_against_the_sims_own_at_that_moment():
    touch = Task("touch", "red")
    timeline = [(0.0, "touch the red cube, far left"), (5.0, "touch the red cube, near centre")]
    assert m.said_place("Touch the red cube,  far left") == "far left"
    assert m.said_place("reaching for the red cube") == ""
    places = m.sim_places(timeline, 1.0, 2.0)
    assert places == {"far left"}
    wrong = "touch the red cube, near right"
    assert m.judge_text(touch, wrong, {"reach"})  # the right cube and phase ...
    assert m.judge_place(wrong, places) is False  # ... in the wrong place
    assert m.judge_place("reaching for the red cube, far left", places) is True
    assert m.judge_place("reaching for the red cube", places) is False  # the sim said where
    assert m.judge_place("touch the red cube, far left", set()) is False  # the sim said nowhere
    assert m.judge_place("touch the red cube", set()) is None  # neither: nothing to judge
    # a window over the sim's change of place: either place was the sim's then
    assert m.sim_places(timeline, 4.5, 5.5) == {"far left", "near centre"}
    assert m.judge_place(wrong, m.sim_places(timeline, 4.5, 5.5)) is False


def test_an_episode_naming_the_right_cube_in_the_wrong_place_is_cube_right_place_wrong():
    task = Task("touch", "red")
    rec = Recording("")
    rec.reports = [
        (0.0, {"episode": 1, "status": "running"}),
        (9.0, {"episode": 1, "status": "timeout", "elapsed_s": 8.0}),
    ]
    rec.sim_subtasks = [(0.5, "touch the red cube, far left")]
    rec.narrations = [
        (2.0, "[narration] reaching for the red cube, near right"),
        (3.0, "[narration] reaching for the red cube, far left"),
    ]
    rec.policy_subtasks = [(2.5, "touch the red cube, near right")]
    episode = closed_loop.measure(rec, task, 1, answer=(4.0, "the red cube, near right"))
    assert episode["narrations_right"] == 2 and episode["narrations_placed"] == 2
    assert episode["narrations_place_right"] == 1
    assert episode["subtasks_right"] == 1 and episode["subtasks_place_right"] == 0
    assert episode["answer_names_target"] and episode["answer_place_right"] is False
    episode |= {"setting": "ask", "wall_s": 1.0}
    (row,) = closed_loop.summarise([Setting("ask")], [episode])
    assert (row["narr_ok"], row["narr_place_ok"]) == (1.0, 0.5)
    assert (row["subtask_ok"], row["subtask_place_ok"]) == (1.0, 0.0)
    assert (row["ask_ok"], row["ask_place_ok"]) == (1.0, 0.0)
    assert set(closed_loop.COLUMNS) <= set(row)
    # an episode that ended before the question was asked is not judged as a wrong answer
    unasked = closed_loop.measure(rec, task, 1) | {"setting": "ask", "wall_s": 1.0}
    assert "answer_names_target" not in unasked
    (row,) = closed_loop.summarise([Setting("ask")], [episode, unasked])
    assert (row["n"], row["asked"], row["ask_ok"]) == (2, 1, 1.0)
    # the trained answer says no place: its cube is judged, its place is not
    plain = closed_loop.measure(rec, task, 1, answer=(4.0, "the red cube"))
    assert plain["answer_names_target"] and "answer_place_right" not in plain


def test_settings_delays_and_selection():
    assert parse_delays("0,2,250ms", 0.1) == [(0.0, 0.0), (2.0, 200.0), (2.5, 250.0)]
    settings = all_settings(parse_delays("0,5", 0.1), trained_rtc=False)
    names = [s.name for s in settings]
    assert "trained/d0" not in names and "identity/d5" in names
    assert [s.name for s in select(settings, "expert,none")] == ["expert", "none/d0", "none/d5"]
    with pytest.raises(ValueError):
        select(settings, "bogus")
    with_trained = all_settings(parse_delays("0", 0.1), trained_rtc=True)
    assert "trained/d0" in [s.name for s in with_trained]
    # guided and trained RTC on the same weights, told apart by rtc_mode
    modes = {s.name: s.configure.get("rtc_mode") for s in with_trained if s.continuity}
    assert modes == {"none/d0": None, "identity/d0": "guided", "trained/d0": "trained"}
    assert {s.checkpoint for s in with_trained if s.continuity} == {"trained"}


def test_checkpoint_variants(tmp_path: Path):
    src = tmp_path / "ckpt"
    src.mkdir()
    save_file(
        {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}, str(src / "model.safetensors")
    )
    (src / "config.json").write_text(json.dumps({"type": "pi05", "rtc_training_max_delay": 3}))
    (src / "tokenizer.model").write_text("t")
    shuffled = load_file(str(random_variant(src, tmp_path / "random") / "model.safetensors"))["w"]
    assert shuffled.shape == (3, 4) and sorted(shuffled.flatten().tolist()) == list(range(12))
    assert shuffled.flatten().tolist() != list(range(12))


# -- the node's clock during a tick --------------------------------------------------------------
def test_sim_time_moves_on_during_a_tick_at_the_measured_speed():
    from oxygen_ros.ros.tick_clock import TickClock

    ros, steady, simulated = [10_000], [0], [True]
    clock = TickClock(lambda: ros[0], lambda: simulated[0], lambda: steady[0], 2.0)
    assert clock.now_ns() == 10_000
    ros[0], steady[0] = 10_000 + 500, 1_000  # /clock stepped: half a simulated ns per steady ns
    assert clock.now_ns() == 10_500
    steady[0] = 1_400  # a tick runs: no /clock taken, the clock reads the same
    assert clock.now_ns() == 10_500 + 200
    ros[0] = 10_800  # the next /clock: as given
    assert clock.now_ns() == 10_800
    simulated[0] = False  # wall-clock ROS time is always current
    steady[0] = 5_000
    assert clock.now_ns() == 10_800
    simulated[0] = True
    steady[0] = 10**12  # a paused simulation: extrapolation stops at 2 s (at speed 0.5 here)
    assert clock.now_ns() - 10_800 <= 2e9


# -- the node starts a fresh run on activation ----------------------------------------------------
@pytest.mark.ros
def test_activation_forgets_the_executed_chunk_and_restarts_the_subtask(tiny_checkpoint):
    import rclpy
    from rclpy.parameter import Parameter

    from oxygen_ros.ros.node import OxygenNode

    context = rclpy.Context()
    rclpy.init(context=context)
    node = OxygenNode(
        "fresh_run_test",
        context=context,
        parameter_overrides=[
            Parameter("checkpoint_dir", value=str(tiny_checkpoint)),
            Parameter("chunk_continuity", value="rtc"),
            Parameter("autostart", value=False),
        ],
    )
    try:
        assert node.start()
        assert node.trigger_deactivate().name == "SUCCESS"
        continuity = node._engine.continuity
        continuity._latest = continuity._published = object()  # a chunk of the previous run
        node._loop.restart_subtask = False
        assert node.trigger_activate().name == "SUCCESS"
        assert continuity.previous is None
        assert node._loop.restart_subtask
    finally:
        node.release()
        node.destroy_node()
        context.try_shutdown()


# -- the bench over DDS ---------------------------------------------------------------------------
def bench_args(checkpoint: Path, tmp_path: Path, **overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    closed_loop.add_arguments(parser)
    args = parser.parse_args(["--checkpoint", str(checkpoint), "--work", str(tmp_path / "work")])
    for name, value in overrides.items():
        setattr(args, name, value)
    args.json = tmp_path / "bench.json"
    return args


@pytest.fixture(scope="module")
def sim_checkpoint(tmp_path_factory):
    """A random-weight LeRobot tiny folder named like the sim's (scene and wrist cameras)."""
    from oxygen_ros.tools import make_checkpoint

    out = tmp_path_factory.mktemp("sim_ckpt") / "random"
    original = make_checkpoint.LEROBOT_CAMERAS
    make_checkpoint.LEROBOT_CAMERAS = SIM_CAMERAS
    try:
        return make_checkpoint.make_lerobot_checkpoint(out, "tiny", seed=0)
    finally:
        make_checkpoint.LEROBOT_CAMERAS = original


@pytest.mark.ros
@pytest.mark.slow
def test_the_bench_runs_the_expert_and_a_policy_through_the_node(sim_checkpoint, tmp_path):
    args = bench_args(
        sim_checkpoint, tmp_path, episodes=2, settings="expert,none/d0", timeout_s=4.0
    )
    out = closed_loop.run(args)
    rows = {row["setting"]: row for row in out["rows"]}
    assert set(rows) == {"expert", "none/d0"}
    assert rows["expert"]["success"] == 1.0, out["episodes"]
    policy = [e for e in out["episodes"] if e["setting"] == "none/d0"]
    assert len(policy) == 2
    for episode in policy:
        assert episode["status"] in ENDS, episode
        # the node drove the arm chunk after chunk (a random arm may touch a cube at once, which
        # ends the episode under the contact rule; three sim seconds show several chunks)
        assert episode["chunks"] >= 1, episode
        if episode["elapsed_s"] >= 3.0:
            assert episode["chunks"] > 5 and episode["switches"] > 5, episode
        assert math.isfinite(episode["jerk_rms"])
        # a jump needs a switch: an episode a quick touch ends on its first trajectory has none
        assert math.isfinite(episode["switch_jump_rad"]) == (episode["switches"] > 0), episode
        assert episode["rejected"] == 0, episode["rejected_by_reason"]
    for row in out["rows"]:
        assert set(closed_loop.COLUMNS) <= set(row)
        assert row["rejected"] == 0
    assert json.loads(args.json.read_text())["rows"] == json.loads(json.dumps(out["rows"]))


@pytest.mark.ros
@pytest.mark.slow
def test_the_shipped_policy_drives_the_arm_and_names_its_target(tmp_path):
    """The checkpoint trained here (models/sim_so101) through the real node: every episode ends
    with the sim's verdict, no trajectory is refused, and every narration names the task's cube
    (a touch quicker than the first narration may end with none). Its success rate is the
    bench's to report, not a test's."""
    args = bench_args(TRAINED, tmp_path, episodes=2, settings="none/d0", timeout_s=8.0)
    args.tasks = "touch"
    out = closed_loop.run(args)
    (row,) = out["rows"]
    assert row["rejected"] == 0 and row["chunks"] > 0
    for episode in out["episodes"]:
        assert episode["status"] in ENDS, episode
        colour = parse_task(episode["task"]).cube
        narrations = [text for text, *_ in episode["texts"]["narration"]]
        assert narrations or episode["status"] == "success", f"no narration: {episode}"
        assert all(colour in text for text in narrations), (episode["task"], narrations)
