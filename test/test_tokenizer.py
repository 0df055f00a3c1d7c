"""Tokenizer: openpi's pi0.5 prompt format, state bins, round trips and streaming detokenisation."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from oxygen_ros.policy_io.prompts import preset
from oxygen_ros.policy_io.tokenizer import (
    Pi05Tokenizer,
    PromptTooLong,
    StreamDecoder,
    TokenizerError,
    discretize_state,
    fit_task,
    format_prompt,
    state_for_bin,
)
from oxygen_ros.tools.tiny_tokenizer import train_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory):
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.model", vocab_size=512)


@pytest.fixture(scope="module")
def tok(tokenizer_path) -> Pi05Tokenizer:
    return Pi05Tokenizer(tokenizer_path)


def openpi_bins(state):
    """openpi's expression, verbatim."""
    return np.digitize(state, bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1


# -- prompt text ------------------------------------------------------------------------------


def test_prompt_text_equals_openpi_format_for_known_state():
    state = np.array([-1.0, 1.0, 0.999, 0.0, -0.5, 0.25, -1.2, 1.5], dtype=np.float32)
    text = format_prompt("  pick_up the red\ncup \n", state)
    assert text == "Task: pick up the red cup, State: 0 255 255 128 64 160 -1 255;\nAction: "


@pytest.mark.parametrize(
    "value, expected",
    [
        (-1.0, 0),  # first edge belongs to bin 0
        (-0.9921875, 1),  # second edge starts bin 1
        (-0.993, 0),
        (0.0, 128),
        (0.9921874, 254),
        (0.9921875, 255),  # last edge
        (0.999, 255),
        (1.0, 255),
        (7.0, 255),  # above the range: openpi does not clip, digitize saturates at 255
        (-1.0001, -1),  # below the range: openpi emits bin -1, and so do we
    ],
)
def test_state_bins_at_edges_match_openpi(value, expected):
    assert discretize_state(np.array([value])).tolist() == [expected]
    assert openpi_bins(np.array([value])).tolist() == [expected]


def test_state_bins_equal_openpi_on_random_states():
    state = np.random.default_rng(0).uniform(-1.2, 1.2, 1000)
    np.testing.assert_array_equal(discretize_state(state), openpi_bins(state))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_state_is_rejected(bad):
    # openpi would silently turn NaN into bin 255; a broken sensor must not look like a valid state.
    with pytest.raises(ValueError, match="non-finite"):
        discretize_state(np.array([0.1, bad]))


def test_state_must_be_a_vector():
    with pytest.raises(ValueError, match="1-D"):
        discretize_state(np.zeros((2, 3)))


# -- encode_prompt ----------------------------------------------------------------------------


def test_encode_prompt_is_bos_plus_encoded_text_then_padding(tok):
    state = np.array([0.1, -0.3, 0.9])
    tokens, mask = tok.encode_prompt("open the drawer", state, max_len=64)
    expected = [tok.bos_id] + tok.encode_text(format_prompt("open the drawer", state))
    n = len(expected)
    assert tokens.dtype == np.int64 and mask.dtype == bool
    assert tokens.shape == mask.shape == (64,)
    assert tokens[:n].tolist() == expected
    assert mask[:n].all() and not mask[n:].any()
    assert (tokens[n:] == 0).all() and tok.pad_id == 0
    assert tok.decode(tokens[:n]) == "Task: open the drawer, State: 140 89 243;\nAction: "


# -- the long-prompt rule (issue 18): shorten the task, never the state -------------------------

TASK_IDS = list(range(100, 140))  # hand-made ids: 40 task tokens
STATE_IDS = [900, 901, 902, 903]  # the state bins
END_IDS = [12, *STATE_IDS, 13, 14]  # ", State: <bins>;\nAction: "


def render(task_ids):
    """A prompt around a task, by ids: bos, "Task: " (2 ids), the task, then the state part."""
    return [2, 10, 11, *task_ids, *END_IDS]


def test_fit_task_leaves_a_prompt_that_fits_as_it_is():
    assert fit_task(TASK_IDS, render, 50) == (render(TASK_IDS), 0)


@pytest.mark.parametrize("max_len", [10, 11, 30, 48])
def test_fit_task_shortens_the_task_and_keeps_every_state_id(max_len):
    prompt, dropped = fit_task(TASK_IDS, render, max_len)
    kept = max_len - len(render([]))
    assert len(prompt) == max_len and prompt[-len(END_IDS) :] == END_IDS
    assert prompt == render(TASK_IDS[:kept]) and dropped == len(TASK_IDS) - kept


def test_fit_task_keeps_the_longest_task_prefix_when_tokens_merge():
    """A render whose length is not one id per task id (here every id divisible by 3 becomes two,
    as re-encoded text can): the result is still the longest prefix that fits."""

    def uneven(task_ids):
        return render([x for i in task_ids for x in ([i, i] if i % 3 == 0 else [i])])

    for max_len in range(len(uneven([])), len(uneven(TASK_IDS))):
        prompt, dropped = fit_task(TASK_IDS, uneven, max_len)
        longest = max(k for k in range(len(TASK_IDS) + 1) if len(uneven(TASK_IDS[:k])) <= max_len)
        assert prompt == uneven(TASK_IDS[:longest]) and dropped == len(TASK_IDS) - longest
        assert prompt[-len(END_IDS) :] == END_IDS


def test_fit_task_refuses_a_state_that_alone_does_not_fit():
    with pytest.raises(
        PromptTooLong, match="needs 10 tokens without any task text.*max_token_len 9"
    ):
        fit_task(TASK_IDS, render, 9)


def test_a_long_task_keeps_every_state_bin_and_logs_nothing(tok, caplog):
    state = np.linspace(-0.95, 0.95, 8)
    task = "pick up the red cup and place it on the tray " * 12  # ~500 characters
    bins = " ".join(map(str, discretize_state(state).tolist()))
    before = tok.tasks_shortened
    with caplog.at_level(logging.DEBUG):
        tokens, mask = tok.encode_prompt(task, state, max_len=96)
    text = tok.decode(tokens[mask])
    assert text.startswith("Task: pick up the red cup and place it")
    assert text.endswith(f", State: {bins};\nAction: ")  # every bin, and the Action cue
    assert mask.sum() <= 96 and tok.tasks_shortened == before + 1
    shortened = tok.last_shortened
    assert shortened.max_len == 96 and shortened.fitted_tokens == mask.sum()
    assert 0 < shortened.kept < shortened.task_tokens and shortened.prompt_tokens > 96
    assert not caplog.records  # the caller reports it, throttled; never a line per call here


def test_a_long_task_without_state_keeps_its_newline(tok):
    tokens, mask = tok.encode_prompt("wipe the table " * 20, None, max_len=12)
    ids = tokens[mask].tolist()
    assert (
        len(ids) == 12
        and ids[0] == tok.bos_id
        and ids[-len(tok.encode_text("\n")) :] == (tok.encode_text("\n"))
    )


def test_a_state_too_wide_for_the_limit_is_an_error_not_a_cut(tok):
    with pytest.raises(PromptTooLong, match="max_token_len 10"):
        tok.encode_prompt("stack every block on the tray", np.linspace(-1, 1, 20), max_len=10)


def test_check_task_refuses_a_task_that_cannot_fit_naming_the_limit(tok):
    tok.check_task("open the drawer", 7, 96)
    tok.check_task("open the drawer " * 40, None, 400)
    with pytest.raises(PromptTooLong, match=r"7-value robot state .*max_token_len 96: shorten"):
        tok.check_task("open the drawer " * 30, 7, 96)
    with pytest.raises(PromptTooLong, match="needs .* tokens before any task text"):
        tok.check_task("open", 60, 96)


def test_check_task_refuses_a_conditioned_prompt_that_leaves_a_subtask_too_little(tok):
    fmt = preset("openpi_subtask")
    need = tok.longest_prompt("open the drawer", 7, fmt, True)
    tok.check_task("open the drawer", 7, need + 4, fmt, True, subtask_tokens=4)
    with pytest.raises(PromptTooLong, match=r"leaves a subtask 3 of the model's max_token_len"):
        tok.check_task("open the drawer", 7, need + 3, fmt, True, subtask_tokens=4)
    tok.check_task("open the drawer", 7, need + 3, fmt, False, subtask_tokens=4)  # unconditioned


def test_a_task_accepted_at_set_time_is_never_shortened_later(tok):
    """check_task measures the worst state: the longest task it accepts fits with any state."""
    words = "pick up the red cup and put it in the bowl".split()
    task = ""
    for i in range(200):
        longer = f"{task} {words[i % len(words)]}".strip()
        try:
            tok.check_task(longer, 7, 96)
        except PromptTooLong:
            break
        task = longer
    assert 30 < len(task) < 400
    rng = np.random.default_rng(0)
    before = tok.tasks_shortened
    for _ in range(300):
        tok.encode_prompt(task, rng.uniform(-1.3, 1.3, 7), max_len=96)
    for b in (-1, 0, 9, 99, 100, 127, 255):  # every value in one bin
        tok.encode_prompt(task, state_for_bin(b, 7), max_len=96)
    assert tok.tasks_shortened == before


def test_encode_prompt_without_state_uses_openpi_pi0_format(tok):
    tokens, mask = tok.encode_prompt("wipe_the table\n", None, max_len=32)
    expected = [tok.bos_id] + tok.encode_text("wipe the table") + tok.encode_text("\n")
    assert tokens[: mask.sum()].tolist() == expected


# -- decoding and streaming -------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Narration: the gripper is closed.",
        "Answer: 42 blocks;\nAction: ",
        "café ✓",
        "日本語 ok",
        "  two  spaces\ttab",
    ],
)
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode_text(text)
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.decode(ids) == text


def test_decode_skips_control_tokens_and_rejects_out_of_range_ids(tok):
    ids = [tok.bos_id] + tok.encode_text("memory") + [tok.eos_id]
    assert tok.decode(ids) == "memory"
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


@pytest.mark.parametrize(
    "text",
    [
        "The answer is: café ✓ done",
        "ünïcödé — ✓✓ 🙂 end",
        "plain words only",
        "✓",
        "é\n🙂🙂 x ✓",
    ],
)
def test_stream_decoder_deltas_concatenate_to_full_decode(tok, text):
    ids = tok.encode_text(text) + [tok.eos_id]
    decoder = StreamDecoder(tok)
    deltas = [decoder.push(i) for i in ids]
    deltas.append(decoder.flush())
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas), "partial UTF-8 characters must be held back"
    assert decoder.ids == ids


def test_stream_decoder_holds_back_partial_character_until_complete(tok):
    ids = tok.encode_text("✓")  # not in the tiny vocabulary: three byte-fallback tokens
    assert len(ids) == 3
    decoder = StreamDecoder(tok)
    assert [decoder.push(i) for i in ids] == ["", "", "✓"]


def test_stream_decoder_flush_emits_dangling_bytes(tok):
    decoder = StreamDecoder(tok)
    pushed = "".join(decoder.push(i) for i in tok.encode_text("ok ✓")[:-1])
    assert pushed == "ok "  # complete text is not held
    tail = decoder.flush()
    assert tail and set(tail) == {"\ufffd"}  # the two bytes of an unfinished "✓"
    assert "ok " + tail == tok.decode(decoder.ids)
    assert decoder.flush() == ""


# -- loading and training ---------------------------------------------------------------------


def test_tiny_tokenizer_has_paligemma_special_ids_and_exact_vocab(tok):
    assert (tok.pad_id, tok.eos_id, tok.bos_id) == (0, 1, 2)
    assert tok.vocab_size == 512


def test_tiny_tokenizer_training_is_deterministic(tmp_path, tokenizer_path):
    again = train_tiny_tokenizer(tmp_path / "again.model", vocab_size=512)
    assert again.read_bytes() == tokenizer_path.read_bytes()


def test_tiny_tokenizer_other_vocab_size(tmp_path):
    assert (
        Pi05Tokenizer(train_tiny_tokenizer(tmp_path / "t.model", vocab_size=400)).vocab_size == 400
    )
    with pytest.raises(ValueError, match="too small"):
        train_tiny_tokenizer(tmp_path / "small.model", vocab_size=100)


def test_missing_tokenizer_file_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer model not found"):
        Pi05Tokenizer(tmp_path / "nope.model")


def test_corrupt_tokenizer_file_is_a_clear_error(tmp_path, tokenizer_path):
    bad = tmp_path / "bad.model"
    bad.write_bytes(tokenizer_path.read_bytes()[:100])
    with pytest.raises(TokenizerError, match="not a valid sentencepiece model"):
        Pi05Tokenizer(bad)
    bad.write_bytes(b"\x00garbage" * 20)
    with pytest.raises(TokenizerError):
        Pi05Tokenizer(bad)


def test_stream_decoder_on_random_token_sequences(tok):
    rng = np.random.default_rng(0)
    for _ in range(50):
        ids = rng.integers(0, tok.vocab_size, rng.integers(1, 40)).tolist()
        decoder = StreamDecoder(tok)
        text = "".join(decoder.push(i) for i in ids) + decoder.flush()
        assert text == tok.decode(ids)
