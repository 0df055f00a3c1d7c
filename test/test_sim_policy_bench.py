"""``oxygen-bench sim-policy --subtask flat|oracle|lying|predicted`` with the shipped checkpoint
(models/sim_so101) on fixed held-out layouts (round seed 4242: layouts never trained on).

Each mode runs end to end and reports its keys; oracle and lying differ only by their place words,
and those words reach the model (the same noise gives another chunk); predicted's subtasks are the
engine's, the checkpoint's greedy subtask of the frame. Episodes are cut short (``--timeout-s``):
success is the bench's to measure, not the tests'.
"""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco's first import, as oxygen_ros.sim does

import json  # noqa: E402
import math  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from sim_policy_helpers import (  # noqa: E402
    CHECKPOINT,
    FORMAT,
    HELDOUT_SEED,
    bench_args,
    touch_simulation,
)

from oxygen_ros.engine.runtime import ModelSpec, load_policy  # noqa: E402
from oxygen_ros.tools.benches import sim_policy  # noqa: E402
from oxygen_ros.tools.benches.closed_loop import round_task  # noqa: E402
from oxygen_ros.tools.benches.subtask_modes import (  # noqa: E402
    SIDE_AZIMUTH,
    ConditionedChunk,
    EngineChunks,
    PromptedChunks,
    lying_subtask,
    named_azimuth,
    place_of,
)

NUM_STEPS = 10
# The shipped checkpoint follows its place words: a lie turns the first chunk's heading towards
# the side it names (measured: ~1 rad between the two sides; 0.012 rad before it was trained on
# them).
MIN_HEADING_SHIFT_RAD = 0.2


@pytest.fixture(scope="module")
def policy():
    return load_policy(ModelSpec(checkpoint_dir=str(CHECKPOINT)))


@pytest.fixture()
def sim():
    sim = touch_simulation()
    yield sim
    sim.world.close()


# -- the words ---------------------------------------------------------------------------------


def test_a_lie_names_another_side_at_the_same_depth():
    assert lying_subtask("touch the red cube, far left") == "touch the red cube, far right"
    assert lying_subtask("reach the blue cube, near right") == "reach the blue cube, near left"
    assert lying_subtask("touch the red cube, near centre") == "touch the red cube, near left"
    assert lying_subtask("grasp the red cube") == "grasp the red cube"  # no place to lie about
    assert place_of("touch the red cube, far left") == "far left"
    assert place_of("carry the red cube to the green pad") is None
    assert named_azimuth("touch the red cube, near right") == SIDE_AZIMUTH["right"] < 0
    assert SIDE_AZIMUTH["left"] == pytest.approx(-SIDE_AZIMUTH["right"])


def test_heading_noise_share_is_the_noises_part_of_the_variance():
    # two layouts, two draws each: noise variance 0.02, layout means +-0.5
    noise = sim_policy.heading_noise([[0.4, 0.6], [-0.6, -0.4]])
    assert noise["within_layout_sd_rad"] == pytest.approx(0.02**0.5)
    assert noise["layout_sd_rad"] == pytest.approx((0.5 - 0.02 / 2) ** 0.5)
    assert noise["share"] == pytest.approx(0.02 / (0.02 + 0.49))
    # the same draws on every layout: the scene picks nothing
    assert sim_policy.heading_noise([[0.1, 0.5], [0.1, 0.5]])["share"] == pytest.approx(1.0)
    assert math.isnan(sim_policy.heading_noise([[0.1, 0.5]])["share"])  # one layout: no share


def test_subtask_tally_counts_exact_words_and_right_places():
    tally = sim_policy.SubtaskTally()
    tally.add("touch the red cube, far left", "touch the red cube, far left")
    tally.add("touch the red  cube, far left", "touch the red cube, far left")  # spacing aside
    tally.add("touch the blue cube, far left", "touch the red cube, far left")  # place right
    tally.add("touch the red cube", "touch the red cube, near right")
    tally.add("grasp the red cube", "grasp the red cube")  # no place named
    record = tally.record()
    assert (record["subtask_frames"], record["subtask_exact_frames"]) == (5, 3)
    assert (record["placed_frames"], record["place_right_frames"]) == (4, 3)
    shares = sim_policy.subtask_shares([record])
    assert shares["subtask_exact"] == pytest.approx(3 / 5)
    assert shares["subtask_place_right"] == pytest.approx(3 / 4)
    # one flip: the third frame's words changed while the sim's stayed (spacing is no change, and
    # a change of the sim's own subtask is none)
    assert record["subtask_flips"] == 1
    # two wrong changes: to the blue cube, and to words not the sim's new ones
    assert record["subtask_wrong_changes"] == 2
    late = sim_policy.SubtaskTally()  # follows the sim's change a frame late: a flip, not wrong
    for decoded, truth in (("reach a", "reach a"), ("reach a", "grasp a"), ("grasp a", "grasp a")):
        late.add(decoded, truth)
    assert (late.record()["subtask_flips"], late.record()["subtask_wrong_changes"]) == (1, 0)
    steady = sim_policy.SubtaskTally()
    for _ in range(3):
        steady.add("touch the red cube, far left", "touch the red cube, far left")
    assert steady.record()["subtask_flips"] == 0
    both = sim_policy.subtask_shares([record, steady.record()])
    assert (both["episodes_with_flips"], both["subtask_flips_per_episode"]) == (1, 0.5)
    assert both["subtask_wrong_changes_per_episode"] == 1.0
    # per phase the sim was in, the share of each decoded phase: 4 + 3 touch frames, 1 grasp
    assert both["phase_frames"] == {
        "grasp": {"frames": 1, "grasp": 1.0},
        "touch": {"frames": 7, "touch": 1.0},
    }


def test_phase_confusion_says_where_the_decoded_phase_differs():
    tally = sim_policy.SubtaskTally()
    for decoded, truth in [
        ("carry the red cube to the green pad, far left", "grasp the red cube"),
        ("grasp the red cube", "grasp the red cube"),
        ("reach the red cube, near left", "grasp the red cube"),
        ("", "carry the red cube to the green pad, far left"),
    ]:
        tally.add(decoded, truth)
    table = sim_policy.subtask_shares([tally.record()])["phase_frames"]
    assert table["grasp"]["frames"] == 3
    assert table["grasp"]["carry"] == table["grasp"]["reach"] == pytest.approx(1 / 3, abs=1e-3)
    assert table["carry"] == {"frames": 1, "": 1.0}  # an empty decode is its own column


# -- the four modes end to end -------------------------------------------------------------------

MODE_KEYS = {
    "flat": set(),
    "oracle": set(),
    "lying": {"heading_follows_lie"},
    "predicted": {"subtask_exact", "subtask_place_right", "subtask_frames", "episodes_with_flips"},
}


@pytest.mark.parametrize("mode", list(MODE_KEYS))
def test_each_mode_drives_the_sim_and_reports_its_keys(mode, tmp_path):
    out = tmp_path / "sp.json"
    args = bench_args(
        "--subtask", mode, "--seed", str(HELDOUT_SEED), "--episodes", "3", "--timeout-s", "0.3",
        "--noise-layouts", "2", "--noise-draws", "2", "--json", str(out),
    )  # fmt: skip
    result = sim_policy.run(args)
    assert json.loads(out.read_text())["subtask"] == mode
    common = {"success_rate", "heading_correlation", "closest_tip_to_cube_m", "heading_noise_share"}
    assert common | MODE_KEYS[mode] <= set(result)
    assert not {"heading_follows_lie", "subtask_exact"} - MODE_KEYS[mode] & set(result)
    assert 0.0 <= result["heading_noise_share"] <= 1.0
    runs = result["runs"]
    assert [run["status"] for run in runs] == ["timeout"] * 3
    assert all(run["rejected"] == {} for run in runs)
    assert all(run["closest_tip_to_cube_m"] <= run["final_tip_to_cube_m"] for run in runs)
    assert result["closest_tip_to_cube_m"] == sorted(r["closest_tip_to_cube_m"] for r in runs)[1]
    # draw 0 of the heading-noise measurement is the episode's own first chunk
    firsts = [run["first_chunk_pan_rad"] for run in runs[:2]]
    assert [row[0] for row in result["heading_noise"]["headings_rad"]] == firsts
    if mode == "flat":
        assert all(run["first_subtask"] == "" for run in runs)
    if mode in ("oracle", "lying"):
        assert all(place_of(run["first_subtask"]) for run in runs)
    if mode == "lying":
        assert all(run["words_azimuth_rad"] != 0.0 for run in runs)  # always left or right
        assert -1.0 <= result["heading_follows_lie"] <= 1.0
    if mode == "predicted":  # a subtask from every frame, the start pose's included
        assert result["subtask_frames"] == 3 * len(runs)  # frames at 0, 0.1 and 0.2 s
        assert all(run["said"] and run["first_subtask"] == run["said"][0] for run in runs)


def test_noise_offsets_redraw_the_policys_noise_on_the_same_layouts(tmp_path):
    def run(*offsets: str) -> dict:
        args = bench_args(
            "--subtask", "oracle", "--seed", str(HELDOUT_SEED), "--episodes", "2",
            "--timeout-s", "0.2", "--noise-layouts", "0", "--noise-offsets", *offsets,
        )  # fmt: skip
        return sim_policy.run(args)

    once, pooled = run("0"), run("0", "100000")
    same, other = pooled["runs"][:2], pooled["runs"][2:]
    rerun = [r["first_chunk_pan_rad"] for r in once["runs"]]
    assert rerun == [r["first_chunk_pan_rad"] for r in same]  # a rerun is the same run
    assert [r["noise_offset"] for r in pooled["runs"]] == [0, 0, 100_000, 100_000]
    assert [r["seed"] for r in other] == [r["seed"] for r in same]  # the same layouts
    assert [r["start_tip_to_cube_m"] for r in other] == [r["start_tip_to_cube_m"] for r in same]
    for drawn, redrawn in zip(same, other, strict=True):
        assert drawn["first_chunk_pan_rad"] != redrawn["first_chunk_pan_rad"]
    assert pooled["episodes"] == 4
    assert pooled["successes_by_noise_offset"] == {"0": 0, "100000": 0}  # 0.2 s: no touch yet
    assert "successes_by_noise_offset" not in once


# -- oracle against lying ------------------------------------------------------------------------


def first_chunk(source, sim, layout: int):
    """``source``'s first chunk at the start pose of held-out layout ``layout``, and its prompt."""
    task, seed = round_task(layout, HELDOUT_SEED, "touch")
    sim.reset(task, seed)
    source.start(sim, seed)
    observation = sim_policy.observe(sim)
    prompt = source.frame_prompt(observation, source.subtask(sim))
    return source.chunk(sim, observation), prompt


def test_oracle_and_lying_words_reach_the_model_on_the_same_noise(policy, sim):
    sources = {
        mode: PromptedChunks(policy, FORMAT, mode, NUM_STEPS) for mode in ("oracle", "lying")
    }
    for layout in range(2):
        (oracle, oracle_prompt), (lying, lying_prompt) = (
            first_chunk(sources[mode], sim, layout) for mode in ("oracle", "lying")
        )
        assert lying.subtask == lying_subtask(oracle.subtask) != oracle.subtask
        assert named_azimuth(lying.subtask) != named_azimuth(oracle.subtask)
        # the prompts differ in the subtask's place words only: the shared part is the same
        assert oracle_prompt.ids != lying_prompt.ids
        assert oracle_prompt.ids[: oracle_prompt.shared] == lying_prompt.ids[: lying_prompt.shared]
        # and the model follows them: the same noise, the heading turned towards the lie's side
        shift = float(lying.actions[-1, 0]) - float(oracle.actions[-1, 0])
        towards = named_azimuth(lying.subtask) - named_azimuth(oracle.subtask)
        assert abs(shift) > MIN_HEADING_SHIFT_RAD, (oracle.subtask, lying.subtask, shift)
        assert np.sign(shift) == np.sign(towards), (oracle.subtask, lying.subtask, shift)


# -- predicted: the engine's subtasks ------------------------------------------------------------


@torch.inference_mode()
def greedy_subtask(policy, observation, max_tokens: int = 64) -> str:
    """Reference: the checkpoint's greedy subtask of one frame, uncached, one token at a time
    (reading the images and the shared part of the conditioned prompt, as the engine's
    same_frame request does)."""
    empty = policy.frame_prompt(observation.state, observation.prompt, FORMAT, True, None)
    shared = type(empty)(empty.ids[: empty.shared], empty.shared)
    inputs = policy.encode(observation.images, observation.state, observation.prompt, shared)
    tokens: list[int] = []
    for _ in range(max_tokens):
        text = torch.tensor([tokens], dtype=torch.long)
        logits = policy.model.text_logits_uncached(
            inputs.images, inputs.image_masks, inputs.tokens, inputs.token_masks, text
        )
        token = int(logits[0, -1].argmax())
        if token == policy.tokenizer.eos_id:
            break
        tokens.append(token)
    return policy.tokenizer.decode(tokens).strip()


def test_predicted_subtasks_are_the_engines_greedy_decode_of_each_frame(policy, sim):
    source = EngineChunks(policy, FORMAT, NUM_STEPS, subtask_every=1, action_dt=0.1)
    task, seed = round_task(0, HELDOUT_SEED, "touch")
    sim.reset(task, seed)
    source.start(sim, seed)
    try:
        start = sim_policy.observe(sim)
        first = source.chunk(sim, start)
        engine = source.engine
        # two engine frames at the start pose: the first decoded the subtask the second carries
        # (none is due again before the sim moves)
        assert engine.frame_count == 2 and engine.subtasks.refreshes == 1
        assert first.decoded == greedy_subtask(policy, start) != ""
        assert first.subtask == first.decoded  # the executed chunk was conditioned on it
        sim_policy.send(sim, first.actions, 0.1)
        for _ in range(10):
            sim.control_step()
        later = sim_policy.observe(sim)
        second = source.chunk(sim, later)
        assert engine.frame_count == 3 and engine.subtasks.refreshes == 2
        assert second.decoded == greedy_subtask(policy, later)
        assert engine.subtasks.current.text.text == second.decoded
    finally:
        source.close()
    assert source.engine is None


@pytest.mark.parametrize("mode", ["oracle", "predicted"])
def test_a_format_without_a_subtask_prompt_is_refused_before_loading(mode, tmp_path):
    args = bench_args("--subtask", mode, "--prompt-format", "openpi", "--episodes", "1")
    args.checkpoint = tmp_path / "none"  # never read: the refusal comes first
    with pytest.raises(SystemExit, match=f"--subtask {mode}: .*openpi"):
        sim_policy.run(args)


# -- the gripper's planned switches ---------------------------------------------------------------


class RecedingGripper:
    """Holds the arm where it is and plans, every frame, to close the gripper 3 steps ahead."""

    mode, policy = "oracle", None

    def start(self, sim, noise_seed: int) -> None:
        pass

    def chunk(self, sim, observation) -> ConditionedChunk:
        actions = np.tile(np.append(sim.world.arm_positions(), 0.0), (10, 1))
        actions[3:, -1] = 1.0
        return ConditionedChunk(actions, "")

    def published(self) -> None:
        pass

    def close(self) -> None:
        pass


def sources() -> dict:
    """The receding source alone and with the sim's gripper commitment."""
    from oxygen_ros.engine.switch_commit import SwitchCommitment
    from oxygen_ros.sim.scene import ARM_JOINTS

    commitment = SwitchCommitment((len(ARM_JOINTS),), sim_policy.SIM_GRIPPER_LEVEL, 0.1)
    return {
        "alone": RecedingGripper(),
        "kept": sim_policy.CommittedChunks(RecedingGripper(), commitment),
    }


def test_gripper_commit_wraps_the_source():
    source = sim_policy.make_source(bench_args("--subtask", "oracle", "--gripper-commit"))
    assert isinstance(source, sim_policy.CommittedChunks)
    assert not isinstance(sim_policy.make_source(bench_args("--subtask", "oracle")), type(source))


def test_gripper_commit_closes_a_gripper_the_policy_keeps_planning_to_close():
    from oxygen_ros.sim.episode import Simulation

    sim = Simulation(episode_timeout_s=0.75)  # ends while the switch made holds
    try:
        task, seed = round_task(0, HELDOUT_SEED, "place")
        gripper = {}
        for name, source in sources().items():
            sim_policy.run_episode(sim, source, task, seed, 0.1)
            gripper[name] = sim.privileged_state().gripper
    finally:
        sim.world.close()
    assert gripper["alone"] < 0.1  # each chunk's first step says open: it never closes
    assert gripper["kept"] > 0.9


def test_the_on_policy_driver_keeps_the_switches_too():
    from oxygen_ros.sim.episode import Simulation

    sim = Simulation(episode_timeout_s=5.0)
    try:
        task, seed = round_task(0, HELDOUT_SEED, "place")
        gripper = {}
        for name, source in sources().items():
            sim.reset(task, seed)
            driver = sim_policy.PolicyDriver(source, 0.1)
            driver.start(sim, seed)
            for _ in range(6):  # 0.6 s: the switch planned at 0.4 s runs, and holds
                driver.act(sim, {}, np.zeros(6))
                for _ in range(round(0.1 / sim.control_dt)):
                    sim.control_step()
            gripper[name] = sim.privileged_state().gripper
    finally:
        sim.world.close()
    assert gripper["alone"] < 0.1 and gripper["kept"] > 0.9
