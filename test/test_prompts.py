"""Prompt formats as data: every preset's exact token ids (written out here from the published
format strings, encoded with the tiny tokenizer), the shared/causal split, the eos, the kinds'
texts, custom formats from YAML and the refusals of bad ones."""

from __future__ import annotations

import numpy as np
import pytest

from oxygen_ros.policy_io.prompts import (
    PALIGEMMA_LOC_IDS,
    PRESETS,
    PromptFormatError,
    SubtaskText,
    custom_format,
    preset,
    resolve_format,
)
from oxygen_ros.policy_io.tokenizer import Pi05Tokenizer
from oxygen_ros.tools.tiny_tokenizer import train_tiny_tokenizer

BINS = [12, 200, 128]
TASK = "  Pick_up the red\ncup! "


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Pi05Tokenizer:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    return Pi05Tokenizer(train_tiny_tokenizer(path, vocab_size=512))


@pytest.fixture(scope="module")
def subtask(tok) -> SubtaskText:
    # the ids a decoder produced (not necessarily how the text would re-tokenise)
    ids = tuple(tok.encode_text("grasp")) + tuple(tok.encode_text(" the cup"))
    return SubtaskText(ids, "grasp  the cup", subtask_id=3)


def enc(tok, *pieces) -> list[int]:
    """bos, then each piece encoded alone; ints are token ids as they are."""
    ids = [tok.bos_id]
    for piece in pieces:
        ids += list(piece) if isinstance(piece, (tuple, list)) else tok.encode_text(piece)
    return ids


def test_openpi_is_todays_action_prompt_and_pi0_format_without_state(tok):
    fmt = preset("openpi")
    prompt = fmt.frame_prompt(tok, TASK, BINS)
    assert list(prompt.ids) == enc(tok, "Task: Pick up the red cup!, State: 12 200 128;\nAction: ")
    assert prompt.shared == len(prompt.ids) and prompt.causal_from is None
    assert not prompt.causal_mask().any()
    no_state = fmt.frame_prompt(tok, TASK, None)
    assert list(no_state.ids) == enc(tok, "Pick up the red cup!", "\n")
    assert preset("oxygen").frame_prompt(tok, TASK, BINS) == prompt
    assert not fmt.has_subtask


def test_openpi_subtask_pr942_shared_prefix_then_causal_subtask_eos_action(tok, subtask):
    fmt = preset("openpi_subtask")
    prompt = fmt.frame_prompt(tok, TASK, BINS, conditioned=True, subtask=subtask)
    shared = enc(tok, "Task: Pick up the red cup!, State: 12 200 128;\nSubtask: ")
    tail = [*subtask.ids, tok.eos_id, *tok.encode_text("\nAction: ")]
    assert list(prompt.ids) == shared + tail
    assert prompt.shared == len(shared) and prompt.causal_from == len(shared)
    assert prompt.causal_mask().tolist() == [False] * len(shared) + [True] * len(tail)
    assert prompt.subtask_id == 3
    # before the first subtask: the same shared prefix, an empty subtask
    empty = fmt.frame_prompt(tok, TASK, BINS, conditioned=True)
    assert list(empty.ids) == shared + [tok.eos_id, *tok.encode_text("\nAction: ")]
    # without state bins (#942: "Task: {clean};\nSubtask: ")
    no_state = fmt.frame_prompt(tok, TASK, None, conditioned=True, subtask=subtask)
    assert list(no_state.ids) == enc(tok, "Task: Pick up the red cup!;\nSubtask: ") + tail
    # the subtask kind decodes right after the shared prefix: no text of its own
    assert fmt.kind("subtask").reads == "shared" and fmt.kind_ids(tok, "subtask", task=TASK) == []
    assert fmt.kind("subtask").max_tokens == 64 and fmt.same_frame_exact


def test_opentau_response_then_eos_semicolon_action(tok, subtask):
    fmt = preset("opentau")
    prompt = fmt.frame_prompt(tok, TASK, BINS, conditioned=True, subtask=subtask)
    shared = enc(tok, "Task: Pick up the red cup!, State: 12 200 128;\nResponse: ")
    tail = [*subtask.ids, tok.eos_id, *tok.encode_text(";\n"), *tok.encode_text("Action: ")]
    assert list(prompt.ids) == shared + tail
    assert (prompt.shared, prompt.causal_from) == (len(shared), len(shared))
    with pytest.raises(PromptFormatError, match="without state bins"):
        fmt.frame_prompt(tok, TASK, None, conditioned=True)


def test_brunofang_lower_cased_period_no_state_whole_prompt_causal(tok, subtask):
    fmt = preset("brunofang")
    prompt = fmt.frame_prompt(tok, TASK, BINS, conditioned=True, subtask=subtask)
    shared = enc(tok, "Task: pick up the red cup. Subtask: ")
    assert list(prompt.ids) == shared + list(subtask.ids)  # the eos ends the generation only
    assert prompt.shared == len(shared) and prompt.causal_from == 0
    assert prompt.causal_mask().all()
    # the state never enters this format: with or without bins the prompt is the same
    assert fmt.frame_prompt(tok, TASK, None, conditioned=True, subtask=subtask) == prompt


def test_pi052_blend_rewrites_the_subtask_text_and_drops_the_task(tok, subtask):
    fmt = preset("pi052")
    prompt = fmt.frame_prompt(tok, TASK, BINS, conditioned=True, subtask=subtask)
    # re-tokenised, whitespace-normalised text, all bidirectional
    assert list(prompt.ids) == enc(tok, "User: grasp the cup, State: 12 200 128;\n")
    assert prompt.causal_from is None and prompt.shared == len(prompt.ids)
    before = fmt.frame_prompt(tok, TASK, BINS)
    # PI052 normalises whitespace only (no openpi cleaning of underscores)
    assert list(before.ids) == enc(tok, "User: Pick_up the red cup!, State: 12 200 128;\n")
    assert fmt.kind_ids(tok, "subtask", task=TASK) == tok.encode_text(
        "User: Pick_up the red cup!\nAssistant:"
    )
    memory = fmt.kind_ids(tok, "memory", task=TASK, memory="cup seen", previous="open gripper")
    assert memory == tok.encode_text(
        "User: Pick_up the red cup!\nAssistant: Previous memory: cup seen\nUser: Completed "
        "subtask: open gripper\nAssistant:"
    )
    assert fmt.kind_ids(tok, "answer", text="where?") == tok.encode_text("User: where?\nAssistant:")
    assert fmt.kind("subtask").suppress == (PALIGEMMA_LOC_IDS,) == ((256000, 257023),)
    assert fmt.kind("memory").suppress == (PALIGEMMA_LOC_IDS,) and not fmt.kind("answer").suppress
    assert fmt.kind("subtask").max_tokens == 128 and fmt.memory_on_subtask_change
    assert not fmt.same_frame_exact
    with pytest.raises(PromptFormatError, match="libero"):
        fmt.frame_prompt(tok, TASK, None)


def test_pi052_joint_layout_carries_task_and_subtask_with_eos(tok, subtask):
    fmt = preset("pi052_joint")
    prompt = fmt.frame_prompt(tok, TASK, BINS, conditioned=True, subtask=subtask)
    assert list(prompt.ids) == enc(
        tok, "User: Pick_up the red cup!, State: 12 200 128;\nAssistant: grasp the cup", [1], "\n"
    )
    assert tok.eos_id == 1 and prompt.causal_from is None


def test_our_kinds_are_todays_prompts_and_marked_ours(tok):
    for name in PRESETS:
        fmt = preset(name)
        assert fmt.kind_ids(tok, "narration") == tok.encode_text("\nNarrate: ")
        assert fmt.kind("narration").ours
    fmt = preset("openpi")
    assert fmt.kind_ids(tok, "answer", text="why?") == tok.encode_text("\nQuestion: why?\nAnswer: ")
    assert fmt.kind_ids(tok, "memory") == tok.encode_text("\nMemory note: ")
    assert all(k.ours for k in fmt.kinds.values())
    assert not preset("pi052").kind("answer").ours


def test_tokenizer_encode_prompt_pads_the_format_ids(tok, subtask):
    fmt = preset("openpi_subtask")
    ids, mask = tok.encode_prompt(TASK, np.array([-0.9, 0.57, 0.0]), 64, fmt)
    assert ids[: mask.sum()].tolist() == enc(
        tok, "Task: Pick up the red cup!, State: 12 200 128;\nAction: "
    )
    assert not ids[mask.sum() :].any()


CUSTOM_YAML = """
name: my_finetune
base: openpi_subtask
subtask_action: ["Goal: {task}, State: {state};\\nStep: ", "{subtask}", "<eos>", "\\nAction: "]
kinds:
  subtask: {max_tokens: 16}
  answer: {text: "\\nQ: {text}\\nA: "}
"""


def test_custom_format_from_yaml(tok, subtask):
    fmt = resolve_format("my_finetune", CUSTOM_YAML)
    prompt = fmt.frame_prompt(tok, "go", BINS, conditioned=True, subtask=subtask)
    shared = enc(tok, "Goal: go, State: 12 200 128;\nStep: ")
    assert list(prompt.ids) == shared + [*subtask.ids, 1, *tok.encode_text("\nAction: ")]
    assert prompt.causal_from == len(shared)
    assert fmt.kind("subtask").max_tokens == 16 and fmt.kind("subtask").reads == "shared"
    assert fmt.kind_ids(tok, "answer", text="hi") == tok.encode_text("\nQ: hi\nA: ")
    json_fmt = custom_format('{"name": "j", "action": "Do {task} now: "}')
    assert list(json_fmt.frame_prompt(tok, "x", BINS).ids) == enc(tok, "Do x now: ")


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"name": "x", "action": "Task: {tsk}"}, r"unknown field\(s\) \['tsk'\]"),
        ({"name": "x", "action": "Task: {task"}, "bad template"),
        ({"name": "x", "action": "Task: {task!r}"}, "bad field"),
        ({"name": "x", "action": ""}, "non-empty"),
        ({"name": "x", "colour": "red"}, r"unknown key\(s\) \['colour'\]"),
        ({"name": "x", "base": "nope"}, "unknown prompt format 'nope'"),
        ({"action": "a"}, "non-empty 'name'"),
        (
            {"name": "x", "base": "openpi_subtask", "subtask_action": ["A {task}", "B"]},
            "never uses the {subtask}",
        ),
        (
            {"name": "x", "base": "openpi_subtask", "causal_from": 7},
            "causal_from 7 must split",
        ),
        (
            {"name": "x", "base": "pi052", "kinds": {"subtask": {"reads": "shared"}}},
            "needs a subtask_action with a causal tail",
        ),
        ({"name": "x", "kinds": {"poem": {"text": "write"}}}, "unknown language kind"),
        ({"name": "x", "kinds": {"answer": {"reads": "sideways"}}}, "reads must be one of"),
        ({"name": "x", "kinds": {"answer": {"text": "{question}"}}}, "unknown field"),
        ({"name": "x", "task_style": "shout"}, "task_style must be one of"),
    ],
)
def test_bad_custom_formats_are_refused_with_the_reason(spec, message):
    with pytest.raises(PromptFormatError, match=message):
        custom_format(spec)


def test_resolve_refuses_unknown_names_and_mismatched_custom_formats():
    with pytest.raises(PromptFormatError, match="presets: openpi, oxygen"):
        resolve_format("openpi2")
    with pytest.raises(PromptFormatError, match="named 'my_finetune'"):
        resolve_format("other", CUSTOM_YAML)
    with pytest.raises(PromptFormatError, match="neither JSON nor YAML"):
        custom_format("name: [unclosed")


@pytest.mark.parametrize("name", list(PRESETS))
def test_a_long_task_is_shortened_never_the_state_or_the_subtask_in_every_preset(tok, name):
    fmt = preset(name)
    state = np.array([-0.9, 0.57, 0.0])  # bins 12 200 128
    long_task = "pick up the red cup and put it on the tray " * 6
    ids = tuple(tok.encode_text("grasp the cup"))
    for conditioned in (False, True) if fmt.has_subtask else (False,):
        subtask = SubtaskText(ids, "grasp the cup", 1) if conditioned else None
        full = fmt.frame_prompt(tok, long_task, BINS, conditioned, subtask)
        bare = fmt.frame_prompt(tok, "", BINS, conditioned, subtask)
        if full == bare:
            continue  # this prompt carries no task (pi052's blend layout carries the subtask)
        max_len = len(bare.ids) + 6
        fitted = tok.frame_prompt(long_task, state, max_len, fmt, conditioned, subtask)
        assert len(fitted.ids) <= max_len < len(full.ids)
        text = tok.decode(fitted.ids)
        if "{state}" in "".join(fmt.template(conditioned, True)):
            assert "12 200 128" in text, text
        assert text.endswith(tok.decode(bare.ids[bare.shared :]) if conditioned else "")
        if conditioned and fitted.causal_from is not None:
            tail = full.ids[full.shared :]  # subtask ids, eos, action cue: all kept
            assert fitted.ids[-len(tail) :] == tail and fitted.shared == len(fitted.ids) - len(tail)
