"""Grounding co-training: scenes rendered from the sim with labels read off its state, questions
whose answers those labels give, seeds kept apart, the symmetry-breaking warm-up, text-only
batches laid out as the node's Ask request, and the trainer mixing them with demonstrations
(fixed sin-cos image positions, the probe, resuming)."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco's first import

import numpy as np
import pytest
import torch

from oxygen_ros.model.config import get_preset
from oxygen_ros.model.objectives import text_only_loss
from oxygen_ros.model.siglip import sincos_positions
from oxygen_ros.policy_io.prompts import SubtaskText, resolve_format
from oxygen_ros.policy_io.tokenizer import Pi05Tokenizer
from oxygen_ros.sim import grounding
from oxygen_ros.sim import questions as qa
from oxygen_ros.sim.episode import Simulation
from oxygen_ros.sim.headless import drive_expert
from oxygen_ros.sim.language import place_words
from oxygen_ros.sim.recording import demonstration_specs, write_demonstrations
from oxygen_ros.sim.scene import CUBE_COLORS
from oxygen_ros.sim.tasks import TOUCH, Task, random_layout
from oxygen_ros.tools.benches.closed_loop import round_task
from oxygen_ros.tools.sim_dataset import (
    DEFAULT_GROUNDING_SEED,
    DEFAULT_PLACE_SEED,
    DEFAULT_TOUCH_SEED,
)
from oxygen_ros.tools.train import dataset_tokenizer
from oxygen_ros.tools.train import main as train_main
from oxygen_ros.training.grounding import GroundingBatchMaker, answers_right, probe
from oxygen_ros.training.trainer import (
    TrainSettings,
    freeze_sincos_positions,
    gates_met,
    model_config,
    new_model,
    parse_gate,
    parse_question_weight,
)

HELDOUT = grounding.HELDOUT_SEED0 + 500_000  # the tests' own held-out layouts


@pytest.fixture(scope="module")
def scenes() -> qa.GroundingScenes:
    return grounding.render_scenes(HELDOUT, 3, poses_per_layout=3)


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demos") / "ds"
    write_demonstrations(out, demonstration_specs("touch", 4_500_000, 3, 0.0, 0.0))
    return out


@pytest.fixture(scope="module")
def tokenizer_path(demos, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    return dataset_tokenizer([demos], out, get_preset("sim").vocab_size, grounding=True)


def test_labels_are_the_sims_state_at_the_start_pose(scenes):
    start_rows = np.flatnonzero(np.r_[True, scenes.seeds[1:] != scenes.seeds[:-1]])
    assert len(start_rows) == 3
    for row in start_rows:
        layout = random_layout(np.random.default_rng(int(scenes.seeds[row])))
        questions = {q.text: q.answer for q in qa.scene_questions(scenes, row)}
        for k, colour in enumerate(CUBE_COLORS):
            x, y, _ = layout.cubes[colour]
            np.testing.assert_allclose(scenes.cubes[row, k, :2], (x, y), atol=2e-3)
            assert questions[f"where is the {colour} cube?"] == place_words(x, y)
            assert questions[f"is the {colour} cube on a pad?"] == "no"
        assert questions["which cube does the gripper hold?"] == "none"
        listing = questions["where are the cubes?"].split(", ")
        assert [item.split(" ", 1)[0] for item in listing] == list(CUBE_COLORS)


def test_later_poses_move_the_arm_and_their_labels_follow(scenes):
    later = np.flatnonzero(np.r_[False, scenes.seeds[1:] == scenes.seeds[:-1]])
    assert len(later) > 0
    for row in later:
        assert np.abs(scenes.state[row] - scenes.state[row - 1]).max() > 1e-3
        held = int(scenes.grasped[row])
        answer = {q.kind: q.answer for q in qa.scene_questions(scenes, row)}["held"]
        assert answer == ("none" if held < 0 else f"the {CUBE_COLORS[held]} cube")


def test_scene_questions_are_vqa_and_the_task_question_is_an_ask(scenes, tokenizer_path):
    maker = _maker(scenes, tokenizer_path)
    tok = maker.tokenizer
    for q in qa.scene_questions(scenes, 0):
        layout = maker.layout(0, q)
        answer = tok.encode_text(q.answer) + [tok.eos_id]
        assert [i for i, s in zip(layout.ids, layout.supervised, strict=True) if s] == answer
        n_prefix = len(layout.ids) - len(answer)
        if q.layout == qa.VQA:
            assert layout.ids[:n_prefix] == [tok.bos_id] + tok.encode_text(q.text + "\n")
            assert layout.causal == [False] * n_prefix + [True] * len(answer)
        else:
            assert (q.kind, q.layout) in {(qa.TARGET, qa.ASK), (qa.SUBTASK, qa.SUBTASK_PROMPT)}


def test_which_at_answers_agree_with_where_answers(scenes):
    for row in range(len(scenes)):
        questions = qa.scene_questions(scenes, row)
        where = {q.subject: q.answer for q in questions if q.kind == qa.WHERE}
        for q in (q for q in questions if q.kind == qa.WHICH_AT):
            there = [c for c, place in where.items() if place == q.subject]
            assert q.answer == (f"the {there[0]} cube" if there else "none")


def test_seed_ranges_are_disjoint():
    bench = {seed for i in range(1000) for seed in [round_task(i, 777, "touch")[1]]}
    blocks = {
        "grounding train": grounding.TRAIN_SEED0 // grounding.SEED_BLOCK,
        "grounding held out": grounding.HELDOUT_SEED0 // grounding.SEED_BLOCK,
        "touch demos": DEFAULT_TOUCH_SEED // grounding.SEED_BLOCK,
        "place demos": DEFAULT_PLACE_SEED // grounding.SEED_BLOCK,
        "bench": min(bench) // grounding.SEED_BLOCK,
    }
    assert len(set(blocks.values())) == len(blocks), blocks
    assert max(bench) // grounding.SEED_BLOCK == blocks["bench"]
    assert DEFAULT_GROUNDING_SEED == grounding.TRAIN_SEED0
    with pytest.raises(ValueError, match="cross"):
        grounding.render_scenes(grounding.HELDOUT_SEED0 + grounding.SEED_BLOCK - 1, 2)


def test_the_warm_up_asks_one_colour_and_the_listing_only(scenes):
    questions = qa.scene_questions(scenes, 0)
    warm = qa.curriculum_questions(questions, one_colour=True)
    assert [(q.kind, q.subject) for q in warm] == [(qa.WHERE, CUBE_COLORS[0])]
    assert qa.curriculum_questions(questions, one_colour=False) == questions


def test_questions_are_drawn_by_kind_weights(scenes):
    questions = qa.scene_questions(scenes, 0)
    rng = np.random.default_rng(0)
    drawn = [qa.draw_question(questions, rng).kind for _ in range(4000)]
    kinds = {q.kind for q in questions}
    total = sum(qa.KIND_WEIGHTS[k] for k in kinds)
    for kind in kinds:
        expected = qa.KIND_WEIGHTS[kind] / total
        assert abs(drawn.count(kind) / len(drawn) - expected) < 0.03, kind


def test_scenes_round_trip_through_a_file(scenes, tmp_path):
    scenes.save(tmp_path / "s.npz")
    back = qa.GroundingScenes.load(tmp_path / "s.npz")
    assert back.tasks == scenes.tasks
    np.testing.assert_array_equal(back.scene, scenes.scene)
    both = qa.GroundingScenes.concatenate([scenes, back])
    assert len(both) == 2 * len(scenes)


def _maker(scenes, tokenizer_path) -> GroundingBatchMaker:
    config = get_preset("sim")
    return GroundingBatchMaker(
        scenes,
        config,
        Pi05Tokenizer(tokenizer_path),
        resolve_format("openpi_subtask"),
        lambda state: np.clip(state / 2.0, -1, 1),
        ["observation.images.scene", "observation.images.wrist"],
    )


def test_the_task_question_is_laid_out_as_an_ask_request(scenes, tokenizer_path):
    maker = _maker(scenes, tokenizer_path)
    tok = maker.tokenizer
    question = [q for q in maker.questions(0) if q.kind == qa.TARGET][0]
    layout = maker.layout(0, question)
    answer = tok.encode_text(question.answer) + [tok.eos_id]
    cue = maker.format.kind_ids(tok, "answer", text=question.text)
    assert layout.ids[-len(answer) :] == answer
    assert layout.ids[-len(answer) - len(cue) : -len(answer)] == cue
    assert [i for i, s in zip(layout.ids, layout.supervised, strict=True) if s] == answer
    n_prompt = sum(layout.action_reads)
    assert layout.action_reads == [True] * n_prompt + [False] * (len(cue) + len(answer))
    batch = maker.examples([0, 1], [question, maker.questions(1)[0]])
    assert batch.images.shape == (2, 2, 3, 128, 128)
    assert int(batch.text_loss_mask.sum()) == len(answer) + len(
        tok.encode_text(maker.questions(1)[0].answer) + [tok.eos_id]
    )


def test_grounding_loss_trains_the_backbone_and_vision_not_the_expert(scenes, tokenizer_path):
    maker = _maker(scenes, tokenizer_path)
    model = new_model(maker.config, seed=1)
    loss, count = text_only_loss(model, maker.batch(4, np.random.default_rng(0)))
    assert count > 0
    loss.backward()
    vision = model.paligemma_with_expert.paligemma.model.vision_tower.vision_model
    assert float(vision.embeddings.patch_embedding.weight.grad.abs().sum()) > 0
    assert float(model.backbone.layers[0].self_attn.k_proj.weight.grad.abs().sum()) > 0
    assert model.expert.layers[0].self_attn.q_proj.weight.grad is None


def test_a_right_answer_is_counted_right_and_a_wrong_one_wrong(scenes, tokenizer_path):
    maker = _maker(scenes, tokenizer_path)
    model = new_model(maker.config, seed=2)
    batch = maker.examples([0], maker.questions(0)[:1])
    assert not answers_right(model, batch)[0]  # random weights
    # a model that always predicts the target: logits peaked on the next token
    target = batch.text_targets[batch.text_loss_mask]
    original = model.logits
    calls = []

    def oracle(hidden):
        out = original(hidden)
        calls.append(1)
        peaked = torch.full_like(out, -1e4)
        rows = torch.arange(out.shape[1])
        peaked[0, rows[batch.text_loss_mask[0]], target] = 1e4
        return peaked

    model.logits = oracle
    assert answers_right(model, batch)[0]
    assert calls


def test_sincos_positions_are_frozen_into_the_position_table():
    config = get_preset("sim")
    model = new_model(config, seed=0)
    freeze_sincos_positions(model)
    table = model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings
    grid = config.vision.image_size // config.vision.patch_size
    expected = sincos_positions(grid, config.vision.width)
    torch.testing.assert_close(table.position_embedding.weight.data, expected)
    assert not table.position_embedding.weight.requires_grad
    # distinct patches get distinct positions, neighbours closer than far patches
    distance = torch.cdist(expected, expected)
    assert distance[0, 1] < distance[0, grid - 1]
    assert float(distance.masked_fill(torch.eye(len(expected), dtype=torch.bool), 1).min()) > 0


def test_recorded_demonstrations_train_with_grounding_probe_and_resume(
    demos, scenes, tokenizer_path, tmp_path
):
    scene_file = tmp_path / "scenes.npz"
    scenes.save(scene_file)
    out = tmp_path / "ckpt"
    common = [
        "--dataset", str(demos), "--out", str(out), "--preset", "sim", "--batch-size", "2",
        "--grounding", str(scene_file), "--grounding-heldout", str(scene_file),
        "--grounding-batch-size", "2", "--grounding-only-steps", "2", "--one-colour-steps", "3",
        "--image-positions", "sincos", "--probe-every", "3", "--probe-scenes", "1",
        "--tokenizer", str(tokenizer_path), "--threads", "1", "--no-augment",
        "--resume-every-min", "0.0001", "--log-every", "1",
    ]  # fmt: skip
    assert train_main([*common, "--steps", "4"]) == 0
    first = json.loads((out / "training.json").read_text())
    assert first["steps_done"] == 4
    history = first["history"]
    assert [h["flow"] == 0.0 for h in history] == [True, True, False, False]  # warm-up: text only
    assert all(h["grounding"] > 0 for h in history)
    assert [p["step"] for p in first["probes"]] == [3, 4]
    assert set(first["probes"][0]) >= {"step", "all", "where", "all_cubes"}
    assert (out / "resume.pt").exists()
    readme = (out / "README.md").read_text()
    assert "co-trained on" in readme and "held-out grounding probe at step 4" in readme
    assert train_main([*common, "--steps", "6", "--resume"]) == 0
    resumed = json.loads((out / "training.json").read_text())
    assert resumed["steps_done"] == 6
    assert resumed["history"][:4] == history  # the first four steps carried over, not redone
    config = model_config(
        TrainSettings(datasets=(demos,), out=out, tokenizer=tokenizer_path, preset="sim"),
        __import__("oxygen_ros.training.dataset", fromlist=["x"]).load_training_frames(demos),
    )
    assert config.num_image_slots == 2


def test_probe_reports_every_kind_asked(scenes, tokenizer_path):
    maker = _maker(scenes, tokenizer_path)
    result = probe(new_model(maker.config, seed=3), maker, max_scenes=2)
    assert set(result) >= {"where", "all_cubes", "held", "on_pad", "all"}
    assert all(0.0 <= v <= 1.0 for v in result.values())


@pytest.fixture(scope="module")
def moved() -> qa.GroundingScenes:
    """Two layouts seen at the start and at three moments of each view kind's episode."""
    return qa.GroundingScenes.concatenate(
        [
            grounding.render_scenes(HELDOUT + 100 * k, 2, 4, views=(view,))
            for k, view in enumerate(grounding.VIEWS)
        ]
    )


def test_each_row_keeps_its_view_and_the_sims_subtask_for_the_task(moved):
    assert set(moved.views) == {qa.START, *grounding.VIEWS}
    assert moved.starts().sum() == 2 * len(grounding.VIEWS)
    for row in range(len(moved)):
        task = qa.parse_task(moved.tasks[row])
        assert f"the {task.cube} cube" in moved.subtasks[row] or moved.subtasks[row] == "done"
        asked = [q for q in qa.scene_questions(moved, row) if q.kind == qa.SUBTASK]
        assert [(q.answer, q.layout) for q in asked] == [(moved.subtasks[row], qa.SUBTASK_PROMPT)]


def test_an_off_course_reach_ends_at_the_decoy_cube_not_the_tasks():
    sim = Simulation(episode_timeout_s=4.0)
    try:
        rng = np.random.default_rng(0)
        task = sim.reset(Task(TOUCH, "red"), HELDOUT + 300)
        decoy = grounding._decoy(task, rng)
        for _ in drive_expert(sim, expert_task=decoy):
            pass
        tip = sim.world.tip_position()
        to_decoy = np.linalg.norm(sim.world.cube_position(decoy.cube) - tip)
        to_task = np.linalg.norm(sim.world.cube_position(task.cube) - tip)
    finally:
        sim.world.close()
    assert decoy.cube != task.cube and sim.status != "success"
    assert to_decoy < 0.04 < to_task
    assert sim.phase.subtask.startswith(f"touch the {task.cube} cube")  # labels stay the task's


def test_rendering_in_two_processes_gives_the_same_scenes():
    one = grounding.render_scenes(HELDOUT + 900, 2, 2, views=("dart",))
    two = grounding.render_scenes(HELDOUT + 900, 2, 2, views=("dart",), workers=2)
    np.testing.assert_array_equal(one.scene, two.scene)
    np.testing.assert_array_equal(one.state, two.state)
    assert (one.subtasks, one.views) == (two.subtasks, two.views)
    with pytest.raises(ValueError, match="views"):
        grounding.render_scenes(HELDOUT, 1, 2, views=("sideways",))


def test_pad_questions_and_carry_subtasks_say_where_the_pad_is(scenes, tmp_path):
    for row in range(len(scenes)):
        questions = qa.scene_questions(scenes, row)
        where = {q.subject: q.answer for q in questions if q.kind == qa.WHERE_PAD}
        for k, pad in enumerate(qa.PAD_COLORS):
            x, y = scenes.pads[row, k]
            assert where[pad] == place_words(float(x), float(y))
    # a file rendered before the carry named its pad's place: the label gets it on loading
    arrays = {k: v for k, v in np.load(_saved(scenes, tmp_path)).items()}
    subtasks = arrays["subtasks"].astype(object)
    subtasks[0], subtasks[1] = "carry the red cube to the blue pad", "grasp the red cube"
    arrays["subtasks"] = subtasks.astype(str)
    tasks = arrays["tasks"].astype(object)
    tasks[0] = tasks[1] = "put the red cube on the blue pad"
    arrays["tasks"] = tasks.astype(str)
    np.savez(tmp_path / "old.npz", **arrays)
    old = qa.GroundingScenes.load(tmp_path / "old.npz")
    blue = qa.PAD_COLORS.index("blue")
    pad = place_words(*map(float, scenes.pads[0, blue]))
    assert old.subtasks[0] == f"carry the red cube to the blue pad, {pad}"
    assert old.subtasks[1] == "grasp the red cube"


def test_files_without_subtasks_or_views_load_with_them_empty(scenes, tmp_path):
    arrays = {k: v for k, v in np.load(_saved(scenes, tmp_path)).items()}
    del arrays["subtasks"], arrays["views"]
    np.savez(tmp_path / "old.npz", **arrays)
    old = qa.GroundingScenes.load(tmp_path / "old.npz")
    assert old.subtasks == [""] * len(scenes) and old.views == [""] * len(scenes)
    assert qa.SUBTASK not in {q.kind for q in qa.scene_questions(old, 0)}


def _saved(scenes: qa.GroundingScenes, tmp_path: Path) -> Path:
    scenes.save(tmp_path / "s.npz")
    return tmp_path / "s.npz"


def test_the_subtask_question_is_the_demonstrations_subtask_prompt(moved, tokenizer_path):
    maker = _maker(moved, tokenizer_path)
    tok = maker.tokenizer
    row = int(np.flatnonzero(~moved.starts())[0])
    question = [q for q in maker.questions(row) if q.kind == qa.SUBTASK][0]
    layout = maker.layout(row, question)
    conditioned = tok.frame_prompt(
        moved.tasks[row],
        maker.states[row],
        maker.config.max_token_len,
        maker.format,
        True,
        SubtaskText(tuple(tok.encode_text(question.answer)), question.answer),
    )
    assert layout.ids == list(conditioned.ids)  # the same tokens the action prompt holds
    assert layout.causal == conditioned.causal_mask().tolist()
    supervised = [i for i, s in zip(layout.ids, layout.supervised, strict=True) if s]
    assert supervised == tok.encode_text(question.answer) + [tok.eos_id]
    first = layout.supervised.index(True)
    assert first == conditioned.shared  # generated right after the shared prefix


def test_the_probe_splits_by_pose(moved, tokenizer_path):
    maker = _maker(moved, tokenizer_path)
    result = probe(new_model(maker.config, seed=3), maker, max_scenes=len(moved))
    for group in ("start", "along"):
        assert {f"{group}/where", f"{group}/subtask", f"{group}/all_cubes"} <= set(result)
    assert all(0.0 <= v <= 1.0 for v in result.values())


def test_question_weights_parse_and_steer_what_a_batch_asks(scenes, tokenizer_path):
    assert parse_question_weight("where_pad=0.2") == ("where_pad", 0.2)
    for bad in ("where_pad", "where_pad=-1", "elsewhere=0.2", "where=x"):
        with pytest.raises(ValueError, match="question weight"):
            parse_question_weight(bad)
    only_pads = {kind: 0.0 for kind in qa.QUESTION_KINDS} | {qa.WHERE_PAD: 1.0}
    maker = _maker(scenes, tokenizer_path)
    maker.weights = only_pads
    _, asked = maker.draw(20, np.random.default_rng(0))
    assert [q.kind for q in asked] == [qa.WHERE_PAD] * 20
    assert _maker(scenes, tokenizer_path).weights == qa.KIND_WEIGHTS


def test_gates_parse_and_read_the_probe():
    assert parse_gate("start/where>=0.95") == ("start/where", 0.95)
    for bad in ("start/where>0.9", ">=0.5", "where>=1.5", "where>=x"):
        with pytest.raises(ValueError, match="gate"):
            parse_gate(bad)
    gates = [("start/where", 0.9), ("along/where", 0.9)]
    assert gates_met(gates, {"start/where": 0.95, "along/where": 0.9})
    assert not gates_met(gates, {"start/where": 0.95, "along/where": 0.89})
    assert not gates_met(gates, {"start/where": 0.95})  # a figure the probe lacks is not met
    assert not gates_met([], {"start/where": 1.0})


def test_stages_resume_the_last_weights_with_their_own_schedule(
    demos, moved, tokenizer_path, tmp_path
):
    heldout = _saved(moved, tmp_path)
    out = tmp_path / "staged"
    common = [
        "--dataset", str(demos), "--out", str(out), "--preset", "tiny", "--batch-size", "2",
        "--grounding", str(heldout), "--grounding-heldout", str(heldout),
        "--grounding-batch-size", "2", "--probe-every", "2", "--probe-scenes", "6",
        "--tokenizer", str(tokenizer_path), "--threads", "1", "--no-augment",
        "--log-every", "1", "--warmup-steps", "2", "--lr", "1e-3",
    ]  # fmt: skip
    # a gate every probe meets ends the first stage at its first probe, not at its 50 steps
    first = [*common, "--stage", "ground", "--steps", "50", "--grounding-only-steps", "50"]
    assert train_main([*first, "--gate", "all>=0.0"]) == 0
    record = json.loads((out / "training.json").read_text())
    assert record["steps_done"] == 2
    assert record["stages"][0]["gated"] and record["stages"][0]["ended"] == "gates met at step 2"
    # a gate no probe meets: the stage runs to its steps and says so
    second = ["--stage", "ground2", "--steps", "3", "--grounding-only-steps", "3"]
    with pytest.raises(SystemExit):
        train_main([*common, "--resume", *second, "--gate", "all>=1.1"])  # refused
    assert train_main([*common, "--resume", *second, "--gate", "where>=1.0"]) == 0
    assert train_main([*common, "--resume", "--stage", "demos", "--steps", "3"]) == 0
    record = json.loads((out / "training.json").read_text())
    assert [s["stage"] for s in record["stages"]] == ["ground", "ground2", "demos"]
    assert [s["gated"] for s in record["stages"]] == [True, False, False]
    assert [(s["first_step"], s["last_step"]) for s in record["stages"]] == [(0, 2), (2, 5), (5, 8)]
    lrs = [h["lr"] for h in record["history"]]
    assert lrs[2] == lrs[5] == lrs[0]  # each stage warms up from its own first step
    flows = [h["flow"] for h in record["history"]]
    assert flows[:5] == [0.0] * 5 and all(f > 0 for f in flows[5:])  # demos join in "demos"
    # an earlier stage, once a later one ran, is skipped; the last goes on to more steps
    assert train_main([*first, "--resume", "--gate", "all>=0.0"]) == 0
    assert train_main([*common, "--resume", "--stage", "demos", "--steps", "4"]) == 0
    record = json.loads((out / "training.json").read_text())
    assert record["steps_done"] == 9 and record["stages"][-1]["last_step"] == 9
