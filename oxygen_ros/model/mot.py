"""Mixture-of-Transformers: per-expert Gemma weights, ONE joint attention per layer.

Every token belongs to one expert (the PaliGemma backbone for images and text, the action expert for
noisy actions). In each layer each expert normalises and projects its own tokens, then all queries
attend together over the keys and values of every expert plus any cached context, and each expert
applies its own output projection and MLP. Cached context (the prefix KV of a frame, or a language
request's own tokens) is simply more keys and values to attend to.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .config import GemmaConfig
from .layers import (
    AdaRMSNorm,
    GeGLU,
    Modulation,
    RMSNorm,
    apply_rope,
    attention,
    attention_bias,
    causal_tail_bias,
    gated_residual,
    rope_tables,
)


class GemmaAttentionProjections(nn.Module):
    """q/k/v/o projections of one expert (no biases). The attention itself is joint, see below."""

    def __init__(self, cfg: GemmaConfig) -> None:
        super().__init__()
        self.q_proj = nn.Linear(cfg.width, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.width, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.width, bias=False)


class GemmaLayer(nn.Module):
    def __init__(self, cfg: GemmaConfig, adaptive: bool, eps: float) -> None:
        super().__init__()
        norm = (
            (lambda: AdaRMSNorm(cfg.width, cfg.width, eps))
            if adaptive
            else (lambda: RMSNorm(cfg.width, eps))
        )
        self.input_layernorm = norm()
        self.self_attn = GemmaAttentionProjections(cfg)
        self.post_attention_layernorm = norm()
        self.mlp = GeGLU(cfg.width, cfg.mlp_dim)


class GemmaStack(nn.Module):
    """One expert: its layers and final norm (and token embedding for the backbone)."""

    def __init__(
        self, cfg: GemmaConfig, adaptive: bool, eps: float, vocab_size: int | None = None
    ) -> None:
        super().__init__()
        self.cfg = cfg
        if vocab_size is not None:
            self.embed_tokens = nn.Embedding(vocab_size, cfg.width)
        self.layers = nn.ModuleList(GemmaLayer(cfg, adaptive, eps) for _ in range(cfg.depth))
        self.norm = AdaRMSNorm(cfg.width, cfg.width, eps) if adaptive else RMSNorm(cfg.width, eps)

    def adaptive_norms(self) -> list[AdaRMSNorm]:
        """Every adaRMS norm of the stack, in layer order, the final norm last (none in the
        backbone)."""
        norms = [
            norm
            for layer in self.layers
            for norm in (layer.input_layernorm, layer.post_attention_layernorm)
        ]
        return [norm for norm in norms + [self.norm] if isinstance(norm, AdaRMSNorm)]

    def condition(self, cond: Tensor, dtype: torch.dtype) -> Conditioning:
        """The modulation of every adaptive norm for conditions [N, width]: one dense call each."""
        return {norm: norm.modulate(cond, dtype) for norm in self.adaptive_norms()}


Conditioning = dict[nn.Module, Modulation]
"""adaRMS modulations of one expert, keyed by norm module (see `GemmaStack.condition`)."""


def condition_rows(conditioning: Conditioning) -> list[Conditioning]:
    """Split a conditioning of N rows into N conditionings of one row each (one per step)."""
    per_norm = {norm: modulation.rows() for norm, modulation in conditioning.items()}
    count = len(next(iter(per_norm.values())))
    return [{norm: rows[i] for norm, rows in per_norm.items()} for i in range(count)]


def split_rows(conditioning: Conditioning, rows: int) -> tuple[Conditioning, Conditioning]:
    """A conditioning's first ``rows`` rows and the rest (see `Modulation.split`)."""
    parts = {norm: modulation.split(rows) for norm, modulation in conditioning.items()}
    return (
        {norm: first for norm, (first, _) in parts.items()},
        {norm: rest for norm, (_, rest) in parts.items()},
    )


def condition_tokens(conditioning: Conditioning, rows: int, tokens: int) -> Conditioning:
    """A conditioning of ``rows * tokens`` rows (token-major) as ``rows`` rows of ``tokens`` tokens
    each (see `Modulation.tokens`)."""
    return {norm: modulation.tokens(rows, tokens) for norm, modulation in conditioning.items()}


def override_tokens(conditioning: Conditioning, use: Tensor, other: Conditioning) -> Conditioning:
    """Per token, ``other``'s modulations where ``use`` [N or 1, T] is True (see
    `Modulation.override`)."""
    return {norm: m.override(use, other[norm]) for norm, m in conditioning.items()}


@dataclasses.dataclass
class Stream:
    """The tokens one expert contributes to a joint forward pass."""

    expert: GemmaStack
    hidden: Tensor  # [B, T, width]
    conditioning: Conditioning | None = None  # the action expert's adaRMS modulations

    def normalize(self, norm: nn.Module, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """Apply one of this expert's norms -> (normed, residual gate or None)."""
        return norm(x, None if self.conditioning is None else self.conditioning[norm])


@dataclasses.dataclass
class KVContext:
    """Cached keys/values that new tokens may attend to: one [B, C, KVH, D] pair per layer.

    Keys are stored after RoPE. ``valid`` [B, C] marks which cached slots are real tokens.
    ``keys``/``values`` only need indexing by layer, so a sequence that gathers each layer on
    access (see ``engine.static_paths``) works as well as a list.
    """

    keys: Sequence[Tensor]
    values: Sequence[Tensor]
    valid: Tensor

    @property
    def length(self) -> int:
        return self.valid.shape[1]


@dataclasses.dataclass
class JointOutput:
    hidden: list[Tensor]  # per stream, final-normed [B, T_i, width_i]
    keys: list[Tensor]  # per layer, new tokens only [B, T, KVH, D] (all streams, concatenated)
    values: list[Tensor]


def _join(parts: list[Tensor]) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


@dataclasses.dataclass
class AttentionTables:
    """What every layer of one pass shares: RoPE tables of the new tokens and the additive mask."""

    cos: Tensor  # [B, 1, T, head_dim]
    signed_sin: Tensor  # see layers.rope_tables
    bias: Tensor | None
    head: int | None = None  # a bidirectional head before a causal tail (see layers.attention)


def attention_tables(
    cfg: GemmaConfig,
    positions: Tensor,
    allowed: Tensor | None,
    rope_base: float,
    dtype: torch.dtype,
    dense_mask: bool | None = None,
    head: int | None = None,
) -> AttentionTables:
    """Build the tables once; a loop that repeats a pass with the same layout (the denoising steps)
    reuses them. head: the pass is one row of prefix whose first ``head`` tokens are bidirectional
    and the rest a causal tail (`layers.causal_tail_start`): the mask then covers the tail rows
    only and follows from the layout alone (``allowed`` is not read, and may be None)."""
    cos, signed_sin = rope_tables(positions, cfg.head_dim, rope_base, dtype)
    groups = cfg.num_heads // cfg.num_kv_heads
    if head is not None:
        length = positions.shape[1]
        return AttentionTables(
            cos, signed_sin, causal_tail_bias(head, length, groups, dtype, positions.device), head
        )
    if allowed is None:
        raise ValueError("attention tables need the allowed mask unless the pass has a causal tail")
    return AttentionTables(cos, signed_sin, attention_bias(allowed, groups, dtype, dense_mask))


def joint_forward(
    streams: Sequence[Stream],
    positions: Tensor,
    allowed: Tensor | None,
    context: KVContext | None,
    rope_base: float,
    dense_mask: bool | None = None,
    tables: AttentionTables | None = None,
    kv_only: bool = False,
) -> JointOutput:
    """Run all layers over the concatenated streams.

    positions: [B, T] RoPE positions of the new tokens (T = sum of stream lengths, streams in
        order).
    allowed: bool [B, T, C + T] which cached (first C) and new (last T) tokens each new token sees
        (read only to build the tables: None when ``tables`` are given).
    dense_mask: see `attention_bias`; False keeps the pass free of host syncs (CUDA-graph capture).
    tables: `attention_tables` of (positions, allowed), when the caller already built them.
    kv_only: return the K/V only (``hidden`` empty): the last layer's queries, attention and MLP
        feed nothing but the hidden states, so a prefill skips them (exact).
    """
    first = streams[0].expert.cfg
    heads, kv_heads, head_dim = first.num_heads, first.num_kv_heads, first.head_dim
    batch = positions.shape[0]
    lengths = [s.hidden.shape[1] for s in streams]
    hidden = [s.hidden for s in streams]
    new_keys: list[Tensor] = []
    new_values: list[Tensor] = []

    for layer_idx in range(first.depth):
        layers = [s.expert.layers[layer_idx] for s in streams]
        last_kv = kv_only and layer_idx == first.depth - 1
        qs, ks, vs, gates = [], [], [], []
        for layer, x, stream in zip(layers, hidden, streams, strict=False):
            normed, gate = stream.normalize(layer.input_layernorm, x)
            gates.append(gate)
            t = x.shape[1]
            if not last_kv:
                qs.append(layer.self_attn.q_proj(normed).view(batch, t, heads, head_dim))
            ks.append(layer.self_attn.k_proj(normed).view(batch, t, kv_heads, head_dim))
            vs.append(layer.self_attn.v_proj(normed).view(batch, t, kv_heads, head_dim))
        k = _join(ks).transpose(1, 2)  # [B, KVH, T, D]
        v = _join(vs)  # [B, T, KVH, D]
        if tables is None:
            tables = attention_tables(first, positions, allowed, rope_base, k.dtype, dense_mask)
        k = apply_rope(k, tables.cos, tables.signed_sin)
        new_keys.append(k.transpose(1, 2))
        new_values.append(v)
        if last_kv:
            return JointOutput(hidden=[], keys=new_keys, values=new_values)
        q = apply_rope(_join(qs).transpose(1, 2), tables.cos, tables.signed_sin)  # [B, H, T, D]

        if context is not None:
            k_all = torch.cat([context.keys[layer_idx].to(k.dtype).transpose(1, 2), k], dim=2)
            v_all = torch.cat([context.values[layer_idx].to(v.dtype), v], dim=1)
        else:
            k_all, v_all = k, v
        out = attention(q, k_all, v_all.transpose(1, 2), tables.bias, head_dim**-0.5, tables.head)

        start = 0
        for i, (layer, stream) in enumerate(zip(layers, streams, strict=False)):
            end = start + lengths[i]
            x = hidden[i]
            o = layer.self_attn.o_proj(out[:, start:end].to(layer.self_attn.o_proj.weight.dtype))
            x = gated_residual(x, o, gates[i])
            normed, gate = stream.normalize(layer.post_attention_layernorm, x)
            x = gated_residual(x, layer.mlp(normed.to(layer.mlp.up_proj.weight.dtype)), gate)
            hidden[i] = x
            start = end

    final = [s.normalize(s.expert.norm, x)[0] for s, x in zip(streams, hidden, strict=False)]
    return JointOutput(hidden=final, keys=new_keys, values=new_values)
