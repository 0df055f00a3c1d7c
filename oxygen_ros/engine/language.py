"""Language decoding over the unified KV pool: admit requests onto a frame prefix, then advance any
set of active requests — from any frames, of any lengths — by one token in one batched step.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from ..model.policy import Pi05Policy
from .frames import FramePrefix
from .kv_cache import KVPool
from .requests import LanguageRequest, RequestState
from .types import TextDelta

DEFAULT_KIND_PROMPTS: Dict[str, str] = {
    "narration": "\nNarrate: ",
    "answer": "\nQuestion: {text}\nAnswer: ",
    "memory": "\nMemory note: ",
}


class LanguageDecoder:
    """Stateless driver: all state lives in the requests and the pool."""

    def __init__(self, policy: Pi05Policy, pool: KVPool) -> None:
        self.policy = policy
        self.pool = pool

    def attach(self, requests: Sequence[LanguageRequest], frame: FramePrefix) -> List[TextDelta]:
        """Give requests a reference to ``frame``'s prefix and their own KV, prefill their kind text
        on top of the shared prefix (images are never re-encoded), and sample each first token.

        The caller has checked that the pool can hold ``kv_tokens_needed`` for each request.
        """
        if not requests:
            return []
        model, pool = self.policy.model, self.pool
        device = model.device
        lengths = [len(r.prompt) for r in requests]
        width = max(lengths)
        tokens = torch.zeros(len(requests), width, dtype=torch.long)
        valid = torch.zeros(len(requests), width, dtype=torch.bool)
        for i, r in enumerate(requests):
            r.frame_id = frame.frame_id
            r.prefix = pool.retain(frame.segment)
            r.own = pool.allocate(r.kv_tokens_needed, owner=f"request {r.request_id}")
            r.state = RequestState.ACTIVE
            tokens[i, : lengths[i]] = torch.tensor(r.prompt)
            valid[i, : lengths[i]] = True
        context = pool.gather([[(frame.segment, frame.length)]] * len(requests))
        positions = frame.length + torch.arange(width)[None].expand(len(requests), -1)
        out = model.forward_text(context, tokens.to(device), positions.to(device), valid.to(device))
        last = torch.tensor(lengths) - 1
        logits = model.logits(out.hidden[torch.arange(len(requests)), last.to(device)])
        deltas = []
        for i, r in enumerate(requests):
            pool.write(r.own, [k[i, : lengths[i]] for k in out.keys], [v[i, : lengths[i]] for v in out.values])
            r.position = frame.length + lengths[i]
            deltas.append(r.accept(r.choose(logits[i])))
        return deltas

    def step(self, requests: Sequence[LanguageRequest]) -> List[TextDelta]:
        """One batched decode step: feed each request's pending token, sample its next one."""
        model, pool = self.policy.model, self.pool
        device = model.device
        rows = [[(r.prefix, r.prefix.length), (r.own, r.own.length)] for r in requests]
        context = pool.gather(rows)
        tokens = torch.tensor([[r.pending_token] for r in requests], device=device)
        positions = torch.tensor([[r.position] for r in requests], device=device)
        out = model.forward_text(context, tokens, positions)
        logits = model.logits(out.hidden[:, 0])
        pool.append_one([r.own for r in requests], [k[:, 0] for k in out.keys], [v[:, 0] for v in out.values])
        deltas = []
        for i, r in enumerate(requests):
            r.position += 1
            deltas.append(r.accept(r.choose(logits[i])))
        return deltas

    def release(self, request: LanguageRequest) -> None:
        """Return a finished request's KV: its own segment and its reference to the frame prefix."""
        if request.own is not None:
            self.pool.release(request.own)
            request.own = None
        if request.prefix is not None:
            self.pool.release(request.prefix)
            request.prefix = None
