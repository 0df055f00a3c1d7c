"""Building blocks shared by the Gemma stacks: norms, rotary embedding, MLP, attention.

Numerics follow openpi's patched Hugging Face Gemma: norms compute in float32 and cast back,
attention softmax runs in float32, masked logits are filled with openpi's additive constant.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# openpi fills disallowed attention logits with this additive constant (not -inf), so that fully
# masked rows (padding queries) still produce finite, ignorable outputs.
MASK_VALUE = -2.3819763e38


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """x / rms(x), computed in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    """Gemma RMSNorm: the learned weight is applied as ``1 + w`` (zero init = identity)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(width))

    def forward(
        self, x: Tensor, modulation: Modulation | None = None
    ) -> tuple[Tensor, Tensor | None]:
        out = rms_normalize(x, self.eps) * (1.0 + self.weight.float())
        return out.type_as(x), None


@dataclasses.dataclass
class Modulation:
    """What an `AdaRMSNorm` predicts from a condition: ``normed * scale + shift``, and the gate
    that multiplies the sublayer's residual branch. Rows [N, 1, W] broadcast over tokens; rows
    [N, T, W] modulate each of T tokens on its own (a time per action token)."""

    scale: Tensor  # 1 + predicted scale, float32
    shift: Tensor  # float32
    gate: Tensor  # hidden dtype

    def rows(self) -> list[Modulation]:
        """One [1, T, W] modulation per row (e.g. per step of a fixed denoising schedule)."""
        parts = zip(self.scale.split(1), self.shift.split(1), self.gate.split(1), strict=False)
        return [Modulation(scale, shift, gate) for scale, shift, gate in parts]

    def split(self, rows: int) -> tuple[Modulation, Modulation]:
        """The first ``rows`` rows and the rest."""
        first, rest = zip(*(m.split([rows, m.shape[0] - rows]) for m in self._parts), strict=True)
        return Modulation(*first), Modulation(*rest)

    @property
    def _parts(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.scale, self.shift, self.gate

    def clone(self) -> Modulation:
        """A copy in tensors of its own."""
        return Modulation(*(m.clone() for m in self._parts))

    def copy_(self, other: Modulation) -> None:
        """Overwrite these tensors with ``other``'s values, in place (same shapes)."""
        for mine, theirs in zip(self._parts, other._parts, strict=True):
            mine.copy_(theirs)

    def tokens(self, rows: int, tokens: int) -> Modulation:
        """Rows [rows * tokens, 1, W], token-major within a row -> [rows, tokens, W]."""
        return Modulation(*(m.reshape(rows, tokens, -1) for m in self._parts))

    def override(self, use: Tensor, other: Modulation) -> Modulation:
        """Per token: ``other`` where ``use`` [N or 1, T] is True, this modulation elsewhere, as
        [N, T, W] rows. A token that takes this modulation gets its values bit for bit (a select,
        no arithmetic), which keeps a uniform per-token time identical to the per-step one."""
        mask = use[..., None]
        return Modulation(
            torch.where(mask, other.scale, self.scale),
            torch.where(mask, other.shift, self.shift),
            torch.where(mask, other.gate, self.gate),
        )


class AdaRMSNorm(nn.Module):
    """pi0.5's adaptive RMSNorm: scale, shift and a residual gate are predicted from a condition.

    ``dense(cond)`` is split into (scale, shift, gate) in that order. `modulate` runs the dense
    layer; `forward` applies its result, so a loop over a fixed set of conditions (the denoising
    steps) predicts them all in one call before the loop.
    """

    def __init__(self, width: int, cond_width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.dense = nn.Linear(cond_width, 3 * width)

    def modulate(self, cond: Tensor, dtype: torch.dtype) -> Modulation:
        """Conditions [N, cond_width] -> modulation rows [N, 1, W]; ``dtype`` is the hidden
        dtype."""
        modulation = self.dense(cond.to(self.dense.weight.dtype))[:, None, :]
        scale, shift, gate = modulation.chunk(3, dim=-1)
        return Modulation(1.0 + scale.float(), shift.float(), gate.to(dtype))

    def forward(
        self, x: Tensor, modulation: Modulation | None = None
    ) -> tuple[Tensor, Tensor | None]:
        if modulation is None:
            raise ValueError("AdaRMSNorm needs the modulation of the flow-matching time condition")
        out = rms_normalize(x, self.eps) * modulation.scale + modulation.shift
        return out.type_as(x), modulation.gate


def gated_residual(x: Tensor, y: Tensor, gate: Tensor | None) -> Tensor:
    """Residual add; adaRMS layers scale the branch by their gate."""
    return x + y if gate is None else x + y * gate


class GeGLU(nn.Module):
    """Gemma MLP: down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(width, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def rope_tables(
    positions: Tensor, head_dim: int, base: float, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """Rotary tables for integer positions [B, T] -> cos, signed sin [B, 1, T, head_dim].

    Half-split layout (Hugging Face ``rotate_half``). The sign that ``rotate_half`` puts on the
    second half of x is folded into the first half of sin, so `apply_rope` needs one roll.
    """
    inv_freq = 1.0 / (
        base
        ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos], dim=-1)[:, None].to(dtype), torch.cat([-sin, sin], dim=-1)[
        :, None
    ].to(dtype)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotate x [B, heads, T, D] by `rope_tables`: ``x·cos + rotate_half(x)·sin`` with
    ``rotate_half(x) = [-x2, x1]``, computed as ``x·cos + [x2, x1]·[-sin, sin]`` (exactly equal)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def attention_bias(
    allowed: Tensor, groups: int, dtype: torch.dtype, dense: bool | None = None
) -> Tensor | None:
    """Additive mask for `attention` from bool allowed [B, T, S] -> [B, 1, groups * T, S].

    Query heads that share a KV head are folded into the query axis (see `attention`), so the
    mask is repeated once per head in the group. Built once per forward pass, shared by all layers.
    None when every token may see every token (a batch of one prefix or action chunk): the fused
    kernel is much faster without a mask.

    dense: None inspects ``allowed`` (a device-to-host sync); False always builds the mask and
    True never does. Static-shape / CUDA-graph paths pass False: no sync, one kernel choice.
    """
    if dense is None:
        dense = bool(allowed.all())
    if dense:
        return None
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
        ~allowed, MASK_VALUE
    )
    return bias.repeat(1, groups, 1)[:, None]


@functools.lru_cache(maxsize=32)
def causal_tail_bias(
    head: int, length: int, groups: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """The additive mask of a causal tail's queries (see `attention`'s ``head``): in a prefix of
    ``length`` tokens, tail token i (at ``head + i``) sees the head and the tail up to itself ->
    [1, 1, groups * (length - head), length], as `attention_bias` lays out those rows.

    Cached (never written to): a frame's subtask-conditioned prompt keeps its layout for as long
    as its subtask stays, so most frames build nothing.
    """
    blocked = torch.ones(length - head, length, dtype=torch.bool, device=device).triu(head + 1)
    bias = torch.zeros(blocked.shape, dtype=dtype, device=device).masked_fill_(blocked, MASK_VALUE)
    return bias.repeat(groups, 1)[None, None]


def causal_tail_start(valid: Tensor, causal: Tensor) -> int | None:
    """Where a single row's prefix splits into a bidirectional head and a causal tail, or None.

    valid, causal: bool [1, S] (causal: openpi's ar, see `Pi05Model.prefix_forward`). The split
    exists when every column is valid and the causal columns are a suffix: head tokens then see
    the head only and each tail token sees the head and the tail up to itself. Reads the
    tensors on the host (eager paths only).
    """
    if valid.shape[0] != 1 or not bool(valid.all()):
        return None
    flags = causal[0].tolist()
    start = flags.index(True) if True in flags else len(flags)
    if start in (0, len(flags)) or not all(flags[start:]):
        return None
    return start


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Tensor | None,
    scale: float,
    head: int | None = None,
) -> Tensor:
    """Grouped-query attention (multi-query at pi0.5 sizes) with a float32-accumulated softmax.

    q: [B, H, T, D]; k, v: [B, KVH, S, D]; bias: from `attention_bias`. Returns [B, T, H*D].
    The H/KVH query heads of a group attend to the same keys, so they are folded into the query
    axis and one fused kernel handles the group without copying keys per head.

    head: a bidirectional head followed by a causal tail (`causal_tail_start`): the first ``head``
    queries see exactly the first ``head`` keys and run without a mask; ``bias`` then holds the
    tail queries' rows only. Same result as the full mask, with the fused kernel for the head.
    """
    if head is not None:
        front = attention(q[:, :, :head], k[:, :, :head], v[:, :, :head], None, scale)
        return torch.cat([front, attention(q[:, :, head:], k, v, bias, scale)], dim=1)
    b, h, t, d = q.shape
    kvh = k.shape[1]
    q = q.reshape(b, kvh, (h // kvh) * t, d)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    return out.reshape(b, h, t, d).transpose(1, 2).reshape(b, t, h * d)


def sincos_time_embedding(
    t: Tensor, dim: int, min_period: float = 4e-3, max_period: float = 4.0
) -> Tensor:
    """pi0.5 flow-matching time embedding [sin(2πt/p), cos(2πt/p)], computed in float64."""
    fraction = torch.linspace(0.0, 1.0, dim // 2, dtype=torch.float64, device=t.device)
    period = min_period * (max_period / min_period) ** fraction
    angle = (2 * math.pi / period)[None, :] * t.to(torch.float64)[:, None]
    return torch.cat([angle.sin(), angle.cos()], dim=-1).to(torch.float32)
