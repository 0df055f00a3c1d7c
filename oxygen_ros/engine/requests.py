"""Language requests as resumable state.

A request remembers everything needed to continue decoding in any later batched step: the frame
prefix it reads (by reference), its own KV segment, its next position, the token sampled last (not
yet fed), its sampling settings and random generator, and its streaming detokeniser.
"""

from __future__ import annotations

import dataclasses
import enum

import torch
from torch import Tensor

from ..policy_io.tokenizer import Pi05Tokenizer, StreamDecoder
from .kv_cache import KVSegment
from .types import LANGUAGE_KINDS, TextDelta


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a request picks tokens and when it stops.

    temperature 0 is greedy; otherwise tokens are drawn from softmax(logits / temperature) with a
    generator seeded by ``seed`` (so a request's text is reproducible whatever it is batched with).
    """

    max_tokens: int = 30
    temperature: float = 0.0
    seed: int = 0
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


class RequestState(enum.Enum):
    QUEUED = "queued"  # waiting for admission (memory or concurrency limit)
    ACTIVE = "active"  # holds KV, advances one token per batched decode step
    FINISHED = "finished"


class LanguageRequest:
    def __init__(
        self,
        request_id: int,
        kind: str,
        prompt: list[int],
        sampling: SamplingParams,
        tokenizer: Pi05Tokenizer,
        reads_shared: bool = False,
        suppress: tuple[tuple[int, int], ...] = (),
    ) -> None:
        """reads_shared: the request reads only the frame's shared prefix (`FramePrefix`), and
        re-feeds its last token before ``prompt``; suppress: inclusive id ranges never sampled."""
        if kind not in LANGUAGE_KINDS:
            raise ValueError(f"unknown language kind {kind!r}; expected one of {LANGUAGE_KINDS}")
        self.request_id = request_id
        self.kind = kind
        self.prompt = prompt  # the kind's own text, prefilled on top of the shared prefix
        self.reads_shared = reads_shared
        self.suppress = suppress
        self.read_len = 0  # prefix tokens of its frame it reads (set at admission)
        self.sampling = sampling
        self.state = RequestState.QUEUED
        self.frame_id: int | None = None
        self.prefix: KVSegment | None = None
        self.own: KVSegment | None = None
        self.position = 0  # RoPE position of the next token fed
        self.pending_token: int | None = None  # sampled, not yet fed back
        self.tokens: list[int] = []
        self.finish_reason = ""
        self.waited_frames = 0  # frames spent queued
        self.stalled_frames = 0  # consecutive frames active without a decode step
        self._eos = tokenizer.eos_id
        self._vocab = tokenizer.vocab_size  # never sample an id the tokenizer cannot decode
        self._stream = StreamDecoder(tokenizer)
        self._text = ""
        self._generator = torch.Generator().manual_seed(sampling.seed)

    @property
    def kv_tokens_needed(self) -> int:
        """Own-segment tokens: its prompt plus every generated token except the last (never fed)."""
        return len(self.prompt) + int(self.reads_shared) + self.sampling.max_tokens - 1

    def attach_to(self, frame) -> list[int]:
        """Read ``frame`` (a `frames.FramePrefix`): set what it reads; returns the tokens its
        admission feeds (the kind text, after the shared part's last token when it reads that)."""
        self.frame_id = frame.frame_id
        if self.reads_shared:
            self.read_len = frame.shared_length - 1
            return [frame.last_shared_token, *self.prompt]
        self.read_len = frame.length
        return list(self.prompt)

    @property
    def text(self) -> str:
        return self._text

    def choose(self, logits: Tensor) -> int:
        """Pick the next token from float32 logits [model vocab]."""
        logits = logits[: self._vocab]
        if self.suppress:
            logits = logits.clone()
            for low, high in self.suppress:
                logits[low : high + 1] = float("-inf")
        if self.sampling.temperature == 0.0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float().cpu() / self.sampling.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._generator))

    def accept(self, token: int) -> TextDelta:
        """Record a sampled token; returns the text delta (final when this token ends the
        request)."""
        if token == self._eos:
            return self.finish("eos")
        self.tokens.append(token)
        delta = self._stream.push(token)
        self._text += delta
        for stop in self.sampling.stop:
            cut = self._text.find(stop)
            if cut >= 0:
                already = len(self._text) - len(delta)
                self._text = self._text[: cut + len(stop)]
                return self.finish("stop", self._text[already:])
        if len(self.tokens) >= self.sampling.max_tokens:
            return self.finish("length", delta)
        self.pending_token = token
        return TextDelta(
            self.request_id,
            self.kind,
            delta,
            token_count=len(self.tokens),
            frame_id=self.frame_id or 0,
        )

    def fail(self, detail: str) -> TextDelta:
        """End the request because a stage serving it raised: its final delta says why."""
        delta = self.finish("failed")
        delta.detail = detail
        return delta

    def finish(self, reason: str, delta: str = "") -> TextDelta:
        if reason in ("eos", "length"):
            tail = self._stream.flush()
            self._text += tail
            delta += tail
        self.state = RequestState.FINISHED
        self.finish_reason = reason
        self.pending_token = None
        return TextDelta(
            self.request_id,
            self.kind,
            delta,
            final=True,
            token_count=len(self.tokens),
            finish_reason=reason,
            frame_id=self.frame_id or 0,
        )
