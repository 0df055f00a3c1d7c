"""Tokenizer: openpi's pi0.5 prompt format, state bins, round trips and streaming detokenisation."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from oxygen_ros.model.tokenizer import (
    Pi05Tokenizer,
    StreamDecoder,
    TokenizerError,
    discretize_state,
    format_prompt,
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


def test_encode_prompt_truncates_with_warning(tok, caplog):
    state = np.linspace(-1, 1, 20)
    full, _ = tok.encode_prompt("stack every block on the tray", state, max_len=200)
    with caplog.at_level(logging.WARNING):
        tokens, mask = tok.encode_prompt("stack every block on the tray", state, max_len=10)
    assert tokens.tolist() == full[:10].tolist() and mask.all()
    assert "exceeds max length (10), truncating" in caplog.text


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
