"""PaliGemma-style sentencepiece tokenizer and the encoding of pi0.5 prompts.

`Pi05Tokenizer` wraps a sentencepiece model file (PaliGemma's own `paligemma_tokenizer.model` for
real checkpoints, or a tiny one from `oxygen_ros.tools.tiny_tokenizer` for the `tiny`/`small`
presets) and encodes a frame's prompt in a prompt format (`oxygen_ros.policy_io.prompts`; the
default ``openpi`` is exactly openpi's `PaligemmaTokenizer.tokenize` for pi0.5, where the robot
state enters the network only as discrete bins inside the prompt text). The format strings and the
task cleaning live in ``prompts``; this module owns the state bins and the length rule, for every
format.

A prompt longer than the model's ``max_token_len`` is never cut at its end (that would drop the
state bins and the ``Action:`` cue): :func:`fit_task` shortens the task text, token by token, and
keeps everything after it; a prompt whose fixed part alone does not fit raises
:class:`PromptTooLong`. :meth:`Pi05Tokenizer.check_task` is the set-time side of that rule: it
refuses a task that would need shortening with any state of a given width.

`StreamDecoder` turns a growing list of generated token ids into text deltas for streaming.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Union

import numpy as np
import sentencepiece

from .prompts import DEFAULT_FORMAT, preset

PathLike = Union[str, "os.PathLike[str]"]

# pi0.5 discretises the normalised state into 256 bins over [-1, 1]
# (openpi: np.linspace(-1, 1, 257)[:-1]).
STATE_BINS = np.linspace(-1.0, 1.0, 256 + 1)[:-1]
_REPLACEMENT_CHAR = "\ufffd"


class TokenizerError(ValueError):
    """A sentencepiece model that cannot be used (corrupt file, missing special ids)."""


class PromptTooLong(ValueError):
    """A prompt that cannot fit the model's ``max_token_len`` without losing more than task text."""


@dataclasses.dataclass(frozen=True)
class TaskShortened:
    """One prompt whose task was shortened to fit: task tokens kept of how many, prompt tokens
    before and after, and the limit."""

    kept: int
    task_tokens: int
    prompt_tokens: int
    fitted_tokens: int
    max_len: int


def fit_task(
    task_ids: Sequence[int], render: Callable[[Sequence[int]], list[int]], max_len: int
) -> tuple[list[int], int]:
    """The long-prompt rule: shorten the task, never what follows it (the robot state, the
    format's fixed text).

    ``render(ids)`` builds the whole prompt's token ids around a task given by its ids (a prefix of
    ``task_ids``). Returns the prompt of the longest task prefix that fits ``max_len`` tokens
    (``render(task_ids)`` itself when it fits) and how many task tokens were dropped.

    Raises:
        PromptTooLong: even the empty task does not fit (naming the tokens and the limit).
    """
    whole = render(task_ids)
    if len(whole) <= max_len:
        return whole, 0
    bare = render(task_ids[:0])
    if len(bare) > max_len:
        raise PromptTooLong(
            f"the prompt needs {len(bare)} tokens without any task text (robot state and format), "
            f"more than the model's max_token_len {max_len}"
        )
    # the longest prefix that fits (prompt length grows with the task; bisect on it)
    kept, prompt, low, high = 0, bare, 1, len(task_ids) - 1
    while low <= high:
        mid = (low + high) // 2
        candidate = render(task_ids[:mid])
        if len(candidate) <= max_len:
            kept, prompt, low = mid, candidate, mid + 1
        else:
            high = mid - 1
    return prompt, len(task_ids) - kept


def state_for_bin(bin_index: int, dim: int) -> np.ndarray:
    """A normalised ``dim``-value state whose every value lands in ``bin_index`` (-1 to 255)."""
    value = -2.0 if bin_index < 0 else float(STATE_BINS[bin_index])
    return np.full(dim, value)


def discretize_state(state: np.ndarray) -> np.ndarray:
    """Map a normalised 1-D state to openpi's 256 bins: ``np.digitize(state, STATE_BINS) - 1``.

    Like openpi, values are not clipped first: a value >= 0.9921875 (even > 1) lands in bin 255,
    and a value below -1 lands in bin -1 (openpi emits "-1" in that case, and so do we, because the
    model was trained on exactly those strings). NaN and infinities are rejected: openpi would
    silently map NaN to bin 255, which hides a broken sensor or broken norm stats.

    Raises:
        ValueError: if ``state`` is not 1-D or holds a non-finite value.
    """
    state = np.asarray(state)
    if state.ndim != 1:
        raise ValueError(f"state must be a 1-D vector, got shape {state.shape}")
    if not np.issubdtype(state.dtype, np.number) or np.issubdtype(state.dtype, np.complexfloating):
        raise ValueError(f"state must be real-valued, got dtype {state.dtype}")
    bad = ~np.isfinite(state)
    if bad.any():
        raise ValueError(
            f"state has non-finite values at indices {np.flatnonzero(bad).tolist()}: "
            f"{state[bad].tolist()}"
        )
    return np.digitize(state, bins=STATE_BINS) - 1


def format_prompt(task: str, state: np.ndarray) -> str:
    """The pi0.5 prompt text for a task and a normalised state (openpi's exact format)."""
    return preset("openpi").action_text(task, discretize_state(state).tolist())


def _format(prompt_format):
    """``prompt_format``, or openpi's when None."""
    return prompt_format or preset(DEFAULT_FORMAT)


HF_TOKENIZER_MODEL = "tokenizer.model"  # the sentencepiece model in a Hugging Face tokenizer


def tokenizer_model_path(path: PathLike) -> Path:
    """``path`` itself, or the sentencepiece ``tokenizer.model`` inside a Hugging Face tokenizer
    folder (LeRobot tokenizes with ``google/paligemma-3b-pt-224``'s, which holds PaliGemma's
    sentencepiece model: the same ids as openpi's ``paligemma_tokenizer.model``).

    Raises:
        FileNotFoundError: a folder without ``tokenizer.model``.
    """
    path = Path(path)
    if not path.is_dir():
        return path
    model = path / HF_TOKENIZER_MODEL
    if not model.is_file():
        present = sorted(p.name for p in path.iterdir())[:10]
        raise FileNotFoundError(
            f"tokenizer folder {path} has no {HF_TOKENIZER_MODEL} (found {present}); give a "
            "sentencepiece model or a Hugging Face tokenizer folder that holds one"
        )
    return model


class Pi05Tokenizer:
    """A PaliGemma-compatible sentencepiece tokenizer.

    Args:
        path: a sentencepiece ``.model`` file, or a Hugging Face tokenizer folder holding one
            (`tokenizer_model_path`).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        TokenizerError: if the file is not a sentencepiece model or lacks bos/eos/pad ids.
    """

    def __init__(self, path: PathLike) -> None:
        self.path = tokenizer_model_path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer model not found: {self.path}")
        proto = self.path.read_bytes()
        processor = sentencepiece.SentencePieceProcessor()
        try:
            processor.LoadFromSerializedProto(proto)
        except Exception as exc:  # sentencepiece raises RuntimeError/OSError with terse messages
            raise TokenizerError(
                f"{self.path} is not a valid sentencepiece model ({len(proto)} bytes): {exc}"
            ) from exc
        if processor.GetPieceSize() <= 0:
            raise TokenizerError(f"{self.path} holds an empty sentencepiece vocabulary")
        for name, value in (
            ("bos", processor.bos_id()),
            ("eos", processor.eos_id()),
            ("pad", processor.pad_id()),
        ):
            if value < 0:
                raise TokenizerError(
                    f"{self.path} defines no {name} token; pi0.5 prompts need bos, eos and pad ids"
                )
        self._sp = processor
        self.tasks_shortened = 0  # prompts whose task `encode_prompt` shortened to fit
        self.last_shortened: TaskShortened | None = None
        self._worst_bins: dict[int, int] = {}  # state width -> the bin of the longest state text

    # -- vocabulary ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self._sp.GetPieceSize())

    @property
    def bos_id(self) -> int:
        return int(self._sp.bos_id())

    @property
    def eos_id(self) -> int:
        return int(self._sp.eos_id())

    @property
    def pad_id(self) -> int:
        return int(self._sp.pad_id())

    def __repr__(self) -> str:
        return f"Pi05Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"

    # -- encoding --------------------------------------------------------------------------------
    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` without bos/eos (e.g. a request appended after a prefix)."""
        return [int(i) for i in self._sp.EncodeAsIds(text)]

    def encode_prompt(
        self, task: str, state: np.ndarray | None, max_len: int, prompt_format=None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize a task (and state) into a frame's action prompt, right-padded to ``max_len``.

        In the default ``openpi`` format this is exactly openpi's ``PaligemmaTokenizer.tokenize``:
        with a state (pi0.5) ``"Task: {task}, State: {bins};\\nAction: "`` after a bos; with
        ``state=None`` the pi0 format (bos + cleaned task, then a separately encoded "\\n"), which
        openpi's ``TokenizePrompt`` uses for pi0.5 checkpoints trained with
        ``discrete_state_input=False`` (pi05_libero) too. Pass the quantile-normalised, *unpadded*
        robot state: openpi tokenizes before ``PadStatesAndActions``. Padding is id 0 (openpi pads
        with ``False``; PaliGemma's pad id is 0 too) with a False mask. See `frame_prompt`.

        A prompt longer than ``max_len`` keeps its state and its end: the task text is shortened
        (`fit_task`; openpi would cut the end, state bins included). Each such prompt is counted in
        ``tasks_shortened`` and described by ``last_shortened``; nothing is logged here (callers
        report it, throttled).

        Returns:
            tokens int64 [max_len] and mask bool [max_len] (True for real tokens).

        Raises:
            PromptTooLong: the state and the format alone exceed ``max_len``.
            ValueError: ``max_len`` below 1, or a state `discretize_state` refuses.
        """
        prompt = self.frame_prompt(task, state, max_len, prompt_format)
        n = len(prompt.ids)
        ids = np.zeros(max_len, dtype=np.int64)
        ids[:n] = prompt.ids
        mask = np.zeros(max_len, dtype=bool)
        mask[:n] = True
        return ids, mask

    def frame_prompt(
        self,
        task: str,
        state: np.ndarray | None,
        max_len: int,
        prompt_format=None,
        conditioned: bool = False,
        subtask=None,
    ):
        """A frame's prompt ids and attention layout (`prompts.FramePrompt`) in ``prompt_format``
        (a `prompts.PromptFormat`; None: openpi's), conditioned on ``subtask`` when
        ``conditioned``. ``state``: the normalised state, or None for robots trained without it.

        A prompt longer than ``max_len`` has its task shortened (`fit_task`), never its state, its
        subtask or the format's fixed text; counted in ``tasks_shortened``.

        Raises:
            PromptTooLong: the prompt without any task text exceeds ``max_len``.
            ValueError: ``max_len`` < 1, a bad state, or a format that needs state bins without one.
        """
        if max_len < 1:
            raise ValueError(f"max_len must be >= 1, got {max_len}")
        fmt = _format(prompt_format)
        bins = discretize_state(state).tolist() if state is not None else None

        def render(text: str):
            return fmt.frame_prompt(self, text, bins, conditioned, subtask)

        prompt = render(task)
        if len(prompt.ids) <= max_len:
            return prompt
        task_ids = self.encode_text(fmt.clean_task(task))
        _, dropped = fit_task(task_ids, lambda ids: list(render(self.decode(ids)).ids), max_len)
        fitted = render(self.decode(task_ids[: len(task_ids) - dropped]))
        self.tasks_shortened += 1
        self.last_shortened = TaskShortened(
            len(task_ids) - dropped, len(task_ids), len(prompt.ids), len(fitted.ids), max_len
        )
        return fitted

    def _prompt_ids(
        self, task: str, state: np.ndarray | None, prompt_format=None, conditioned: bool = False
    ) -> list[int]:
        """The action prompt's ids (bos first) of a task text, with or without a state
        (``conditioned``: the subtask-conditioned prompt with an empty subtask)."""
        bins = discretize_state(state).tolist() if state is not None else None
        return list(_format(prompt_format).frame_prompt(self, task, bins, conditioned).ids)

    def longest_prompt(
        self, task: str, state_dim: int | None, prompt_format=None, conditioned: bool = False
    ) -> int:
        """Tokens of ``task``'s prompt with the longest state text a ``state_dim``-value state can
        have (every value in the bin whose text takes the most tokens; with tokenizers that split
        digits, as PaliGemma's does, no state takes more), or with no state (``None``: robots
        without the state in the prompt), in ``prompt_format`` (None: openpi's; ``conditioned``:
        its subtask-conditioned prompt with an empty subtask)."""
        state = None if state_dim is None else self.worst_state(state_dim)
        return len(self._prompt_ids(task, state, prompt_format, conditioned))

    def check_task(
        self,
        task: str,
        state_dim: int | None,
        max_len: int,
        prompt_format=None,
        conditioned: bool = False,
        subtask_tokens: int = 0,
    ) -> None:
        """Refuse (at set time) a task whose prompt would need shortening, measured as
        :meth:`longest_prompt` does. With ``conditioned``, the task must also leave a subtask
        ``subtask_tokens`` of ``max_len``: the subtask rides in the same prompt and gets only the
        room the task leaves (`engine.base.subtask_token_limit`).

        Raises:
            PromptTooLong: naming the prompt's tokens, the state's share, the subtask's room and
                ``max_len``.
        """
        need = self.longest_prompt(task, state_dim, prompt_format, conditioned)
        what = f"a {state_dim}-value robot state" if state_dim is not None else "no state"
        room = max_len - need
        if conditioned and 0 <= room < subtask_tokens:
            raise PromptTooLong(
                f"the task makes a {need}-token subtask-conditioned prompt with {what} (worst "
                f"case), which leaves a subtask {room} of the model's max_token_len {max_len} "
                f"tokens; a subtask needs at least {subtask_tokens}: shorten the task by at least "
                f"{subtask_tokens - room} tokens (or lower subtask_max_tokens)"
            )
        if need <= max_len:
            return
        fixed = self.longest_prompt("", state_dim, prompt_format, conditioned)
        if fixed > max_len:
            raise PromptTooLong(
                f"the prompt with {what} needs {fixed} tokens before any task text, more than the "
                f"model's max_token_len {max_len}"
            )
        raise PromptTooLong(
            f"the task makes a {need}-token prompt with {what} (worst case), over the model's "
            f"max_token_len {max_len}: shorten it by at least {need - max_len} tokens (about "
            f"{max_len - fixed} tokens are left for the task)"
        )

    def worst_state(self, state_dim: int) -> np.ndarray:
        """The normalised ``state_dim``-value state whose prompt text takes the most tokens (one bin
        for every value; measured once per width)."""
        if state_dim not in self._worst_bins:
            self._worst_bins[state_dim] = max(
                range(-1, len(STATE_BINS)),
                key=lambda b: len(self._prompt_ids("", state_for_bin(b, state_dim))),
            )
        return state_for_bin(self._worst_bins[state_dim], state_dim)

    # -- decoding --------------------------------------------------------------------------------
    def decode(self, ids: Iterable[int]) -> str:
        """Text of token ids; control tokens (bos/eos/pad) decode to nothing.

        Raises:
            ValueError: if an id is outside ``[0, vocab_size)``.
        """
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:10]}")
        return self._sp.DecodeIds(ids)


class StreamDecoder:
    """Incremental detokenisation: feed generated ids one at a time, receive text deltas.

    The deltas always concatenate to ``tokenizer.decode(all_ids)`` (after `flush`). Each step
    decodes a short window of ids that starts at a settled token boundary (so sentencepiece
    spacing is decoded in context) and emits the part of the window's text not emitted before.
    Trailing U+FFFD characters are held back: they are byte-fallback pieces of a multi-byte
    character whose remaining bytes have not arrived yet. `flush` releases them at the end.

    Example:
        dec = StreamDecoder(tok)
        for token in generated: publish(dec.push(token))
        publish(dec.flush())
    """

    def __init__(self, tokenizer: Pi05Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._start = 0  # window start: all text of earlier tokens has been emitted
        self._emitted = ""  # text of the window already emitted

    @property
    def ids(self) -> list[int]:
        """All ids pushed so far (a copy)."""
        return list(self._ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text (possibly empty)."""
        self._ids.append(int(token_id))
        return self._advance(final=False)

    def flush(self) -> str:
        """Emit whatever is held back (a dangling partial character at the end of a stream)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        text = self._tok.decode(self._ids[self._start :])
        stable = text if final else text.rstrip(_REPLACEMENT_CHAR)
        if not stable.startswith(self._emitted):
            return ""  # the held-back tail is still incomplete
        delta = stable[len(self._emitted) :]
        self._emitted = stable
        if stable == text and len(self._ids) - self._start > 1:
            # Slide the window to the last token: it stays as context for the next piece's spacing.
            start = len(self._ids) - 1
            context = self._tok.decode(self._ids[start:])
            if _REPLACEMENT_CHAR not in context:
                self._start, self._emitted = start, context
        return delta
