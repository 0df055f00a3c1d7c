"""Language decoding over the unified KV pool: admit requests onto a frame prefix, then advance any
set of active requests — from any frames, of any lengths — by one token in one batched step.

A fault inside a language stage (admission, decode step, detokenising, a static replay) never
escapes: the requests it hit end with a final ``failed`` delta carrying the error, their KV goes
back to the pool, and the fault is counted by stage; requests it did not hit go on. These guards sit
at the injector's hooks; an exception that leaves a stage as a whole anyway (from code outside
them, or a stage replaced by one that raises) is caught one level up, at the engine's boundary
(`EngineBase._serve`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..policy_io.policy import Pi05Policy
from .faults import NO_FAULTS, FaultInjector, describe, stage_of
from .frames import FramePrefix
from .kv_cache import KVPool
from .requests import LanguageRequest, RequestState
from .static_paths import StaticRunner, TextRow
from .types import TextDelta


class LanguageDecoder:
    """Stateless driver: all state lives in the requests and the pool.

    With a ``runner`` the batched model calls go through the fixed-shape text steps
    (`StaticRunner.text`: one upload, one replay and one token readback per step); without, through
    the eager `Pi05Model.forward_text` over a padded gather. Both write the same KV and pick the
    same tokens (the eager one also when a frozen runner has no captured bucket for the step).

    faults: checked at "admission", "decode_step" and "detokenise". fault_counts: stage -> faults
    caught here (shared with the engine that owns this decoder).
    """

    def __init__(
        self,
        policy: Pi05Policy,
        pool: KVPool,
        runner: StaticRunner | None = None,
        faults: FaultInjector = NO_FAULTS,
        fault_counts: dict[str, int] | None = None,
    ) -> None:
        self.policy = policy
        self.pool = pool
        self.runner = runner
        self.faults = faults
        self.fault_counts: dict[str, int] = {} if fault_counts is None else fault_counts

    def attach(self, requests: Sequence[LanguageRequest], frame: FramePrefix) -> list[TextDelta]:
        """Give requests a reference to ``frame``'s prefix and their own KV, prefill their kind text
        on top of the shared prefix (images are never re-encoded), and sample each first token.

        The caller has checked that the pool can hold ``kv_tokens_needed`` for each request. Never
        raises for a fault in here: see the module docstring.
        """
        if not requests:
            return []
        pool = self.pool
        fed: list[list[int]] = []
        try:
            for r in requests:
                fed.append(r.attach_to(frame))
                r.prefix = pool.retain(frame.segment)
                r.own = pool.allocate(r.kv_tokens_needed, owner=f"request {r.request_id}")
                r.state = RequestState.ACTIVE
            tokens = None
            if self.runner is not None:
                rows = [
                    TextRow([(frame.segment, r.read_len)], feed, r.read_len, r.own)
                    for r, feed in zip(requests, fed, strict=True)
                ]
                tokens = self._static_step(requests, rows)
            if tokens is None:
                tokens = self._eager_attach(requests, frame, fed)
            self.faults.check("admission")
        except Exception as error:
            return self.fail(requests, error, "admission")
        for r, feed in zip(requests, fed, strict=True):
            r.position = r.read_len + len(feed)
        return self._accept(requests, tokens)

    def _eager_attach(
        self, requests: Sequence[LanguageRequest], frame: FramePrefix, fed: Sequence[list[int]]
    ) -> list[int]:
        model, pool = self.policy.model, self.pool
        device = model.device
        lengths = [len(feed) for feed in fed]
        width = max(lengths)
        tokens = torch.zeros(len(requests), width, dtype=torch.long)
        valid = torch.zeros(len(requests), width, dtype=torch.bool)
        for i, feed in enumerate(fed):
            tokens[i, : lengths[i]] = torch.tensor(feed)
            valid[i, : lengths[i]] = True
        context = pool.gather([[(frame.segment, r.read_len)] for r in requests])
        starts = torch.tensor([r.read_len for r in requests])
        positions = starts[:, None] + torch.arange(width)[None]
        out = model.forward_text(context, tokens.to(device), positions.to(device), valid.to(device))
        last = torch.tensor(lengths) - 1
        logits = model.logits(out.hidden[torch.arange(len(requests)), last.to(device)])
        for i, r in enumerate(requests):
            pool.write(
                r.own,
                [k[i, : lengths[i]] for k in out.keys],
                [v[i, : lengths[i]] for v in out.values],
            )
        return [r.choose(logits[i]) for i, r in enumerate(requests)]

    def step(self, requests: Sequence[LanguageRequest]) -> list[TextDelta]:
        """One batched decode step: feed each request's pending token, sample its next one.

        Never raises for a fault in here: see the module docstring.
        """
        try:
            tokens = None
            if self.runner is not None:
                rows = [
                    TextRow(
                        [(r.prefix, r.read_len), (r.own, r.own.length)],
                        [r.pending_token],
                        r.position,
                        r.own,
                    )
                    for r in requests
                ]
                tokens = self._static_step(requests, rows)
            if tokens is None:
                tokens = self._eager_step(requests)
            self.faults.check("decode_step")
        except Exception as error:
            return self.fail(requests, error, "decode_step")
        for r in requests:
            r.position += 1
        return self._accept(requests, tokens)

    def _accept(
        self, requests: Sequence[LanguageRequest], tokens: Sequence[int]
    ) -> list[TextDelta]:
        """Each request records its sampled token; one whose detokenising raises fails alone."""
        deltas = []
        for r, token in zip(requests, tokens, strict=False):
            try:
                self.faults.check("detokenise")
                deltas.append(r.accept(token))
            except Exception as error:
                deltas += self.fail([r], error, "detokenise")
        return deltas

    def fail(
        self, requests: Sequence[LanguageRequest], error: BaseException, default_stage: str
    ) -> list[TextDelta]:
        """End ``requests`` (hit by ``error``) with a final ``failed`` delta each, release their KV
        and count the fault once under its stage. Returns the final deltas."""
        name = stage_of(error, default_stage)
        self.fault_counts[name] = self.fault_counts.get(name, 0) + 1
        detail = describe(error)
        deltas = [r.fail(detail) for r in requests if r.state is not RequestState.FINISHED]
        for r in requests:
            self.release(r)
        return deltas

    def _eager_step(self, requests: Sequence[LanguageRequest]) -> list[int]:
        model, pool = self.policy.model, self.pool
        device = model.device
        rows = [[(r.prefix, r.read_len), (r.own, r.own.length)] for r in requests]
        context = pool.gather(rows)
        tokens = torch.tensor([[r.pending_token] for r in requests], device=device)
        positions = torch.tensor([[r.position] for r in requests], device=device)
        out = model.forward_text(context, tokens, positions)
        logits = model.logits(out.hidden[:, 0])
        pool.append_one(
            [r.own for r in requests], [k[:, 0] for k in out.keys], [v[:, 0] for v in out.values]
        )
        return [r.choose(logits[i]) for i, r in enumerate(requests)]

    def _static_step(
        self, requests: Sequence[LanguageRequest], rows: Sequence[TextRow]
    ) -> list[int] | None:
        """Greedy rows take the step's on-device argmax; sampling rows draw from its logits. None:
        the frozen runner has no bucket for these rows (run the eager step)."""
        # the on-device argmax knows no suppressed ids: such rows pick from their logits
        sampled = [r.sampling.temperature > 0.0 or bool(r.suppress) for r in requests]
        result = self.runner.text(rows, sampled)
        if result is None:
            return None
        greedy, logits = result
        return [
            r.choose(logits[i]) if sampled[i] else int(greedy[i]) for i, r in enumerate(requests)
        ]

    def run_to_completion(
        self, request: LanguageRequest, frame: FramePrefix, out: list[TextDelta]
    ) -> int:
        """Attach one request to ``frame`` and decode it alone until it finishes, then release its
        KV (the baselines' way). Its deltas are appended to ``out`` as they are made (so an
        exception half-way loses none of the earlier ones); returns the model steps taken (=
        tokens sampled)."""
        out += self.attach([request], frame)
        steps = 1
        while request.state is RequestState.ACTIVE:
            out += self.step([request])
            steps += 1
        self.release(request)
        return steps

    def release(self, request: LanguageRequest) -> None:
        """Return a finished request's KV: its own segment and its reference to the frame prefix."""
        if request.own is not None:
            self.pool.release(request.own)
            request.own = None
        if request.prefix is not None:
            self.pool.release(request.prefix)
            request.prefix = None
