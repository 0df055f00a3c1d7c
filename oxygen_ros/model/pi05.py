"""pi0.5 as openpi defines it, split into the three operations the OxyGen engine schedules.

* ``prefill``: SigLIP + PaliGemma backbone over images and prompt, once per frame -> prefix KV.
* ``sample_actions``: the action expert denoises a chunk by flow matching, reading the prefix KV
  (never writing it): Euler from t=1 (noise) to t=0, optionally with a time per action token;
  optionally continuing the previous chunk (real-time chunking, guided or trained, ``rtc.py``).
* ``forward_text``: language tokens continue causally from any cached context (a frame's prefix
  plus a request's own tokens) -> hidden states for the tied LM head, and their new K/V.

``sample_actions_uncached`` and ``text_logits_uncached`` recompute everything in one joint pass with
openpi's mask construction; tests use them as the reference for the cached paths.

Each step is defined once, here: the engine's fixed-shape paths (``engine.static_paths``) call the
same methods (`embed_present_images`, `prefix_forward`, `denoise`, `forward_text`) on their
preallocated, padded tensors with explicit positions and masks, and ``dense_mask=False`` to keep
the pass free of host syncs.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import Pi05Config
from .layers import causal_tail_start, sincos_time_embedding
from .mot import (
    AttentionTables,
    Conditioning,
    GemmaStack,
    JointOutput,
    KVContext,
    Stream,
    attention_tables,
    condition_rows,
    condition_tokens,
    joint_forward,
    override_tokens,
)
from .rtc import RTCGuidance, TrainedPrefix, guidance_weights
from .siglip import MultiModalProjector, SiglipVisionTower


class PaliGemmaModel(nn.Module):
    def __init__(self, cfg: Pi05Config) -> None:
        super().__init__()
        self.vision_tower = SiglipVisionTower(cfg.vision)
        self.multi_modal_projector = MultiModalProjector(cfg.vision.width, cfg.backbone.width)
        self.language_model = GemmaStack(
            cfg.backbone, adaptive=False, eps=cfg.norm_eps, vocab_size=cfg.vocab_size
        )


class PaliGemma(nn.Module):
    def __init__(self, cfg: Pi05Config) -> None:
        super().__init__()
        self.model = PaliGemmaModel(cfg)


class GemmaExpert(nn.Module):
    def __init__(self, cfg: Pi05Config) -> None:
        super().__init__()
        self.model = GemmaStack(cfg.expert, adaptive=True, eps=cfg.norm_eps)


class PaliGemmaWithExpert(nn.Module):
    def __init__(self, cfg: Pi05Config) -> None:
        super().__init__()
        self.paligemma = PaliGemma(cfg)
        self.gemma_expert = GemmaExpert(cfg)


@dataclasses.dataclass
class Prefix:
    """A frame's encoded observation: the KV every task of that frame reads."""

    # per-layer prefix K/V, [B, S, KVH, D]; S holds only columns valid in some row
    context: KVContext
    num_valid: Tensor  # [B] number of valid prefix tokens = first position after the prefix


@dataclasses.dataclass
class TextOutput:
    hidden: Tensor  # [B, T, width], final-normed
    keys: list[Tensor]  # per layer [B, T, KVH, D] (after RoPE)
    values: list[Tensor]


@dataclasses.dataclass
class StepSchedule:
    """A denoising loop's flow times and the adaRMS conditioning of each of its steps: what every
    chunk of that loop shares (`Pi05Model.step_schedule`, `Pi05Model.schedule_of`).

    times: float32 [steps], or [steps, horizon] (a time per action token).
    rows: every step's modulations as rows [steps, 1, W] ([steps, horizon, W]: a time per token).
    at_zero: time 0's modulations [1, 1, W], which training-time RTC's frozen tokens take
        (`rtc.TrainedPrefix`); None with a time per token.
    """

    times: Tensor
    rows: Conditioning
    at_zero: Conditioning | None
    steps: list[Conditioning] = dataclasses.field(init=False)  # rows, one per step (views)
    _weights: dict[float, Tensor] = dataclasses.field(init=False, default_factory=dict)
    # the conditionings of each frozen mask met so far (a prefix of d tokens: horizon + 1 at most)
    _frozen: dict[bytes, list[Conditioning]] = dataclasses.field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.steps = condition_rows(self.rows)

    def conditionings(self, frozen: Tensor | None = None) -> list[Conditioning]:
        """Every step's conditioning: `steps`, or with the ``frozen`` tokens (bool [horizon]) on
        time 0 instead. Each token selects one of two precomputed rows (no dense call, no
        arithmetic), so a token not frozen gets its step's modulation bit for bit; the selection
        is made once per frozen mask (the delay takes a few values) and reused."""
        if frozen is None:
            return self.steps
        if self.at_zero is None:
            raise ValueError("a frozen prefix takes one time per step (times [steps])")
        key = frozen.detach().cpu().numpy().tobytes()
        selected = self._frozen.get(key)
        if selected is None:
            overridden = override_tokens(self.rows, frozen[None, :], self.at_zero)
            selected = self._frozen[key] = condition_rows(overridden)
        return selected

    def guidance_weights(self, max_weight: float) -> Tensor:
        """`rtc.guidance_weights` of the times, [steps]: made once per ``max_weight``."""
        weights = self._weights.get(max_weight)
        if weights is None:
            weights = self._weights[max_weight] = guidance_weights(self.times, max_weight)
        return weights

    def clone(self) -> StepSchedule:
        """A copy in tensors of its own (a fixed-shape path's buffers)."""
        return StepSchedule(
            self.times.clone(),
            {norm: m.clone() for norm, m in self.rows.items()},
            None if self.at_zero is None else {n: m.clone() for n, m in self.at_zero.items()},
        )

    def copy_(self, other: StepSchedule) -> None:
        """Overwrite the conditionings with ``other``'s values, in place (same times and shapes):
        `steps` are views, so they follow."""
        for norm, modulation in self.rows.items():
            modulation.copy_(other.rows[norm])
        for norm, modulation in (self.at_zero or {}).items():
            modulation.copy_(other.at_zero[norm])
        self._frozen.clear()  # selected from the values just overwritten


def flow_schedule(num_steps: int) -> list[Tensor]:
    """The float32 times openpi's Euler loop visits (1.0, 0.9, 0.79999995, ...), and dt."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    dt = torch.tensor(-1.0 / num_steps, dtype=torch.float32)
    t = torch.tensor(1.0, dtype=torch.float32)
    times = []
    while t >= -dt / 2:
        times.append(t.clone())
        t = t + dt
    return times


def lerobot_flow_schedule(num_steps: int) -> list[Tensor]:
    """The times LeRobot's Euler loop visits: ``float32(1 + step * dt)`` with ``dt = -1/num_steps``
    in Python floats, step 0 .. num_steps-1 (openpi accumulates instead: up to ~1.2e-7 apart)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    dt = -1.0 / num_steps
    return [torch.tensor(1.0 + step * dt, dtype=torch.float32) for step in range(num_steps)]


# The time schedule of each framework (`InputConventions.flow_times`).
FLOW_SCHEDULES = {"openpi": flow_schedule, "lerobot": lerobot_flow_schedule}


def _causal(t: int, device: torch.device) -> Tensor:
    return torch.ones(t, t, dtype=torch.bool, device=device).tril()


class Pi05Model(nn.Module):
    def __init__(self, config: Pi05Config) -> None:
        super().__init__()
        self.config = config
        self.paligemma_with_expert = PaliGemmaWithExpert(config)
        width = config.expert.width
        self.action_in_proj = nn.Linear(config.action_dim, width)
        self.action_out_proj = nn.Linear(width, config.action_dim)
        self.time_mlp_in = nn.Linear(width, width)
        self.time_mlp_out = nn.Linear(width, width)
        # which framework's flow-matching times `sample_actions` visits (a key of FLOW_SCHEDULES);
        # set by the policy from the checkpoint's input conventions
        self.flow_times = "openpi"
        # `step_schedule`'s results by (steps, framework), with the device and weights they used
        self._step_schedules: dict[tuple, tuple[tuple, StepSchedule]] = {}

    def time_schedule(self, num_steps: int) -> list[Tensor]:
        """The float32 flow times of ``num_steps`` Euler steps in this model's framework."""
        return FLOW_SCHEDULES[self.flow_times](num_steps)

    def step_schedule(self, num_steps: int, device: torch.device) -> StepSchedule:
        """The times of ``num_steps`` Euler steps on ``device`` (`time_schedule`) and every step's
        adaRMS conditioning, with time 0's for a trained prefix's frozen tokens (`schedule_of`).

        They depend on the schedule and the weights only, so every chunk reuses the first chunk's;
        they are made again when a weight they read changed in place, moved or was cast.
        """
        key = (num_steps, self.flow_times)
        made_of = (device, self._conditioning_weights())
        cached = self._step_schedules.get(key)
        if cached is None or cached[0] != made_of:
            times = torch.stack(self.time_schedule(num_steps)).to(device)
            schedule = self.schedule_of(times, self.config.action_horizon)
            cached = self._step_schedules[key] = (made_of, schedule)
        return cached[1]

    def _conditioning_weights(self) -> tuple[tuple[int, int], ...]:
        """Where each weight of the time MLP and the adaRMS dense layers lives, and its in-place
        version: what `step_schedule`'s results were made of."""
        modules = [self.time_mlp_in, self.time_mlp_out]
        modules += [norm.dense for norm in self.expert.adaptive_norms()]
        return tuple(
            (p.data_ptr(), p._version) for m in modules for p in (m.weight, m.bias) if p is not None
        )

    # -- parts ---------------------------------------------------------------------------------
    @property
    def backbone(self) -> GemmaStack:
        return self.paligemma_with_expert.paligemma.model.language_model

    @property
    def expert(self) -> GemmaStack:
        return self.paligemma_with_expert.gemma_expert.model

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.backbone.layers[0].self_attn.q_proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.action_in_proj.weight.device

    # -- prefix ----------------------------------------------------------------------------------
    def embed_images(self, images: Tensor, image_masks: Tensor) -> Tensor:
        """images [B, N, 3, H, W] in [-1, 1] -> [B, N * patches, width].

        Masked slots are not encoded (they are invisible to every token, so skipping them is exact);
        their rows are left zero.
        """
        b, n = images.shape[:2]
        patches = self.config.image_tokens
        out = torch.zeros(
            b,
            n,
            patches,
            self.config.backbone.width,
            dtype=self.compute_dtype,
            device=images.device,
        )
        present = image_masks.nonzero(as_tuple=True)
        if present[0].numel():
            out[present] = self.embed_present_images(images[present])
        return out.reshape(b, n * patches, -1)

    def embed_present_images(self, images: Tensor) -> Tensor:
        """SigLIP + projector over images that are all present: [N, 3, H, W] -> [N, patches,
        width]."""
        pg = self.paligemma_with_expert.paligemma.model
        return pg.multi_modal_projector(pg.vision_tower(images)).to(self.compute_dtype)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """Prompt/text token embeddings, scaled by sqrt(width) as openpi does (images are not)."""
        emb = self.backbone.embed_tokens(tokens)
        return (emb * math.sqrt(emb.shape[-1])).to(self.compute_dtype)

    def embed_prefix(
        self, images: Tensor, image_masks: Tensor, tokens: Tensor, token_masks: Tensor
    ) -> tuple[Tensor, Tensor]:
        """-> prefix embeddings [B, S, width] and validity [B, S] (images first, then prompt)."""
        image_emb = self.embed_images(images, image_masks)
        image_valid = image_masks.bool().repeat_interleave(self.config.image_tokens, dim=1)
        embs = torch.cat([image_emb, self.embed_tokens(tokens)], dim=1)
        return embs, torch.cat([image_valid, token_masks.bool()], dim=1)

    @torch.no_grad()
    def prefill(
        self,
        images: Tensor,
        image_masks: Tensor,
        tokens: Tensor,
        token_masks: Tensor,
        token_causal: Tensor | None = None,
    ) -> Prefix:
        """Encode one observation per batch row; the only pass that writes prefix KV.

        token_causal: [B, T] bool, prompt tokens that attend causally (openpi's ar=1: a prompt
        format's causal tail, or a whole causal prompt); None: the prompt is bidirectional.
        """
        if images.shape[0] == 1:
            embs, valid, causal = self._embed_kept_prefix(
                images[0], image_masks[0], tokens, token_masks, token_causal
            )
        else:
            embs, valid = self.embed_prefix(images, image_masks, tokens, token_masks)
            causal = None
            if token_causal is not None:
                causal = torch.cat(
                    [torch.zeros_like(valid[:, : -tokens.shape[1]]), token_causal], 1
                )
            # columns invalid in every row are never attended: drop them (exact)
            keep = valid.any(dim=0)
            embs, valid = embs[:, keep], valid[:, keep]
            causal = causal[:, keep] if causal is not None else None
        out = self.prefix_forward(embs, valid, causal=causal)
        return Prefix(KVContext(out.keys, out.values, valid), valid.sum(dim=1))

    def _embed_kept_prefix(
        self,
        images: Tensor,
        image_masks: Tensor,
        tokens: Tensor,
        token_masks: Tensor,
        token_causal: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """A batch of one's prefix embeddings of the columns `prefill` keeps, and nothing else:
        the present images (a slice when their slots are adjacent, as usual) and the valid
        prompt tokens -> embeddings [1, S, width], validity (all True) and causal flags [1, S].
        The same values as embedding every slot and dropping the invalid columns."""
        slots = [i for i, present in enumerate(image_masks.tolist()) if present]
        parts = []
        if slots:
            adjacent = slots == list(range(slots[0], slots[-1] + 1))
            present = images[slots[0] : slots[-1] + 1] if adjacent else images[slots]
            parts.append(
                self.embed_present_images(present).reshape(1, -1, self.config.backbone.width)
            )
        kept_tokens = token_masks[0]
        all_tokens = bool(kept_tokens.all())
        parts.append(self.embed_tokens(tokens if all_tokens else tokens[:, kept_tokens]))
        embs = torch.cat(parts, dim=1)
        valid = torch.ones(embs.shape[:2], dtype=torch.bool, device=embs.device)
        causal = None
        if token_causal is not None:
            tail = token_causal if all_tokens else token_causal[:, kept_tokens]
            image_columns = embs.shape[1] - tail.shape[1]
            causal = torch.cat([tail.new_zeros(1, image_columns), tail], dim=1)
        return embs, valid, causal

    def prefix_forward(
        self,
        embs: Tensor,
        valid: Tensor,
        dense_mask: bool | None = None,
        causal: Tensor | None = None,
    ) -> JointOutput:
        """The backbone's K/V over prefix embeddings [B, S, width] with validity [B, S] (no hidden
        states: a prefill needs none): bidirectional among valid tokens, positions counting valid
        tokens only (padding and masked cameras are skipped). causal: [B, S] bool, tokens that
        start a causal block (openpi's ar): token i sees token j iff cumsum(causal)[j] <=
        cumsum(causal)[i]. dense_mask: see `attention_bias`."""
        positions = valid.long().cumsum(dim=1) - 1
        head = None
        if causal is not None and dense_mask is None:
            head = causal_tail_start(valid, causal)
        allowed, tables = None, None
        if head is not None:
            # a bidirectional head + causal tail (a subtask-conditioned prompt): only the tail rows
            # are masked, by `layers.causal_tail_bias`
            cfg = self.config.backbone
            tables = attention_tables(
                cfg, positions, None, self.config.rope_base, embs.dtype, head=head
            )
        else:
            allowed = valid[:, None, :].expand(-1, valid.shape[1], -1)
            if causal is not None:
                cum = causal.long().cumsum(dim=1)
                allowed = allowed & (cum[:, None, :] <= cum[:, :, None])
        return joint_forward(
            [Stream(self.backbone, embs)],
            positions,
            allowed,
            None,
            self.config.rope_base,
            dense_mask,
            tables,
            kv_only=True,
        )

    # -- actions ---------------------------------------------------------------------------------
    def time_condition(self, t: Tensor) -> Tensor:
        """Flow time [B] -> adaRMS condition [B, expert width]."""
        emb = sincos_time_embedding(t, self.config.expert.width).to(self.time_mlp_in.weight.dtype)
        return F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(emb))))

    def embed_actions(self, x_t: Tensor) -> Tensor:
        return self.action_in_proj(x_t.to(self.action_in_proj.weight.dtype)).to(self.compute_dtype)

    def velocity(self, expert_hidden: Tensor) -> Tensor:
        horizon = self.config.action_horizon
        out = expert_hidden[:, -horizon:]
        return self.action_out_proj(out.to(self.action_out_proj.weight.dtype)).float()

    @staticmethod
    def _action_layout(
        context: KVContext, num_valid: Tensor, batch: int, horizon: int
    ) -> tuple[Tensor, Tensor]:
        """Positions and visibility of the action tokens: after the prefix, seeing it and each
        other."""
        device = num_valid.device
        positions = num_valid[:, None] + torch.arange(horizon, device=device)
        allowed = torch.cat(
            [
                context.valid[:, None, :].expand(batch, horizon, -1),
                torch.ones(batch, horizon, horizon, dtype=torch.bool, device=device),
            ],
            dim=2,
        )
        return positions, allowed

    def action_conditioning(self, t: Tensor) -> Conditioning:
        """Flow times [N] -> the action expert's adaRMS modulations, N rows."""
        return self.expert.condition(self.time_condition(t), self.compute_dtype)

    def schedule_of(self, times: Tensor, horizon: int) -> StepSchedule:
        """The adaRMS conditioning of every Euler step of ``times``.

        ``times`` [steps]: one time per step, each step's modulations broadcast over the action
        tokens (one dense call per norm for all steps, as openpi's per-step condition), and time
        0's (one more call of one row), which training-time RTC's frozen tokens select instead.
        ``times`` [steps, horizon]: a time per action token. Each step's last token is the step's
        reference time, conditioned exactly as a [steps] schedule is (same rows, same matmul
        shapes); every token whose time equals its step's reference takes those modulations by
        selection, the others their own. A uniform per-token schedule is thus bit-identical to the
        per-step one (row-wise BLAS results depend on the number of rows, so conditioning every
        token in one call would not be).
        """
        if times.dim() == 1:
            at_zero = self.action_conditioning(times.new_zeros(1))
            return StepSchedule(times, self.action_conditioning(times), at_zero)
        if times.dim() != 2 or times.shape[1] != horizon:
            raise ValueError(
                f"times must be [steps] or [steps, {horizon}] (a time per action token), got "
                f"{tuple(times.shape)}"
            )
        steps = times.shape[0]
        reference = times[:, -1]
        per_step = self.action_conditioning(reference)
        per_token = condition_tokens(self.action_conditioning(times.reshape(-1)), steps, horizon)
        own = times != reference[:, None]
        return StepSchedule(times, override_tokens(per_step, own, per_token), None)

    def step_conditionings(
        self, times: Tensor, horizon: int, clean: Tensor | None = None
    ) -> list[Conditioning]:
        """The adaRMS conditioning of every Euler step of ``times`` (see `schedule_of`); ``clean``
        (bool [horizon], with [steps] times): those tokens on time 0 instead, as training-time RTC
        conditions its frozen prefix (see `StepSchedule.conditionings`)."""
        return self.schedule_of(times, horizon).conditionings(clean)

    def _velocity(
        self,
        context: KVContext,
        x_t: Tensor,
        conditioning: Conditioning,
        positions: Tensor,
        allowed: Tensor,
        tables: AttentionTables | None,
    ) -> Tensor:
        stream = Stream(self.expert, self.embed_actions(x_t), conditioning)
        out = joint_forward(
            [stream], positions, allowed, context, self.config.rope_base, tables=tables
        )
        return self.velocity(out.hidden[0])

    def denoise_step(self, prefix: Prefix, x_t: Tensor, t: Tensor) -> Tensor:
        """Velocity v(x_t, t) of the action chunk; attends to the prefix KV, never writes it."""
        b, horizon = x_t.shape[:2]
        positions, allowed = self._action_layout(prefix.context, prefix.num_valid, b, horizon)
        return self._velocity(
            prefix.context, x_t, self.action_conditioning(t.expand(b)), positions, allowed, None
        )

    @torch.no_grad()
    def sample_actions(
        self,
        prefix: Prefix,
        noise: Tensor,
        num_steps: int = 10,
        guidance: RTCGuidance | TrainedPrefix | None = None,
    ) -> Tensor:
        """Euler-integrate the flow from noise (t=1) to actions (t=0): [B, horizon, action_dim].

        What every step shares (positions, RoPE tables, mask) is built once, and every step's adaRMS
        modulation is predicted up front (the schedule is fixed): one dense call per norm.

        guidance: real-time chunking (``model.rtc``), see `denoise`. None, or a guidance with
        nothing to guide, runs the plain sampler unchanged.
        """
        schedule = self.step_schedule(num_steps, noise.device)
        dt = torch.tensor(-1.0 / num_steps, dtype=torch.float32)
        return self.denoise(
            prefix.context, prefix.num_valid, noise, schedule.times, dt, guidance, None, schedule
        )

    @torch.no_grad()
    def denoise(
        self,
        context: KVContext,
        num_valid: Tensor,
        noise: Tensor,
        times: Tensor,
        dt: Tensor,
        guidance: RTCGuidance | TrainedPrefix | None = None,
        dense_mask: bool | None = None,
        schedule: StepSchedule | None = None,
    ) -> Tensor:
        """The Euler loop of `sample_actions` over prefix K/V ``context`` with ``num_valid`` [B]
        valid tokens: one step per row of ``times``, each adding ``dt`` times the velocity.

        times: float32 [steps] (see `flow_schedule`), or [steps, horizon], a time per action token
            (see `step_conditionings`; a uniform one gives bit-identical actions).
        guidance: real-time chunking (``model.rtc``), with [steps] times:
            * `RTCGuidance` ``identity``: each velocity corrected by the weighted error towards
              ``guidance.target``, with the schedule's guidance weights; no host sync, so the
              fixed-shape path runs it (with zero weights it is the plain loop, bit for bit);
            * `RTCGuidance` ``vjp``: corrected through one vector-Jacobian product of the action
              expert w.r.t. x_t (the prefix KV is read, never differentiated); eager only;
            * `TrainedPrefix`: the frozen steps are the target before and after every step and
              their tokens take the schedule's time-0 conditioning (no host sync either).
        dense_mask: see `attention_bias`.
        schedule: the `StepSchedule` of ``times`` when the caller has it (`step_schedule`); None:
            made here.
        """
        b, horizon = noise.shape[:2]
        if guidance is not None and times.dim() != 1:
            raise ValueError("RTC guidance needs one time per step (times [steps])")
        if schedule is None:
            schedule = self.schedule_of(times, horizon)
        trained = guidance if isinstance(guidance, TrainedPrefix) else None
        # one per step, batch-broadcast; a trained prefix's frozen tokens select time 0's
        conditionings = schedule.conditionings(trained.frozen if trained is not None else None)
        positions, allowed = self._action_layout(context, num_valid, b, horizon)
        tables = attention_tables(
            self.expert.cfg,
            positions,
            allowed,
            self.config.rope_base,
            self.compute_dtype,
            dense_mask,
        )
        x_t = noise.float()

        def velocity(x: Tensor, conditioning: Conditioning) -> Tensor:
            return self._velocity(context, x, conditioning, positions, allowed, tables)

        if trained is not None:
            x_t = trained.clamp(x_t)
            for conditioning in conditionings:  # clamped after each step: so before the next
                x_t = trained.clamp(x_t + dt * velocity(x_t, conditioning))
            return x_t
        if guidance is not None and guidance.static:  # identity: tensors only, no host sync
            weights = schedule.guidance_weights(guidance.max_guidance_weight)
            for t, weight, conditioning in zip(times, weights, conditionings, strict=True):
                step = functools.partial(velocity, conditioning=conditioning)
                x_t = x_t + dt * guidance.velocity(step, x_t, t, weight)
            return guidance.settle(x_t)
        if guidance is not None and guidance.active:  # vjp
            for t, conditioning in zip(times.tolist(), conditionings, strict=True):
                step = functools.partial(velocity, conditioning=conditioning)
                x_t = x_t + dt * guidance.velocity(step, x_t, t)
            return guidance.settle(x_t)
        for conditioning in conditionings:  # openpi's float32 loop condition decided the count
            x_t = x_t + dt * velocity(x_t, conditioning)
        return x_t

    # -- language --------------------------------------------------------------------------------
    @torch.no_grad()
    def forward_text(
        self,
        context: KVContext,
        tokens: Tensor,
        positions: Tensor,
        valid: Tensor | None = None,
        dense_mask: bool | None = None,
    ) -> TextOutput:
        """Run text tokens [B, T] that attend to ``context`` and causally to each other.

        positions: [B, T] RoPE positions; valid: [B, T] which new tokens are real (ragged batches).
        dense_mask: see `attention_bias`.
        """
        b, t = tokens.shape
        if valid is None:
            valid = torch.ones(b, t, dtype=torch.bool, device=tokens.device)
        own = _causal(t, tokens.device)[None] & valid[:, None, :]
        allowed = torch.cat([context.valid[:, None, :].expand(b, t, -1), own], dim=2)
        out = joint_forward(
            [Stream(self.backbone, self.embed_tokens(tokens))],
            positions,
            allowed,
            context,
            self.config.rope_base,
            dense_mask,
        )
        return TextOutput(out.hidden[0], out.keys, out.values)

    def logits(self, hidden: Tensor) -> Tensor:
        """Tied LM head: final-normed hidden [..., width] -> float32 logits [..., vocab]."""
        return (
            hidden.to(self.backbone.embed_tokens.weight.dtype) @ self.backbone.embed_tokens.weight.T
        ).float()

    # -- uncached references (openpi's one-pass formulation) ---------------------------------------
    @staticmethod
    def _openpi_masks(pad: Tensor, ar: Tensor) -> tuple[Tensor, Tensor]:
        """openpi's make_att_2d_masks: token i sees valid token j iff cumsum(ar)[j] <=
        cumsum(ar)[i]."""
        cum = ar.long().cumsum(dim=1)
        allowed = (cum[:, None, :] <= cum[:, :, None]) & pad[:, None, :] & pad[:, :, None]
        return allowed, pad.long().cumsum(dim=1) - 1

    @torch.no_grad()
    def sample_actions_uncached(
        self,
        images,
        image_masks,
        tokens,
        token_masks,
        noise: Tensor,
        num_steps: int = 10,
        token_causal: Tensor | None = None,
    ) -> Tensor:
        """Reference: every denoising step re-runs prefix and suffix jointly, nothing cached.
        token_causal: see `prefill` (openpi's ar of the prompt tokens)."""
        prefix_embs, prefix_valid = self.embed_prefix(images, image_masks, tokens, token_masks)
        b, s = prefix_valid.shape
        horizon = noise.shape[1]
        pad = torch.cat(
            [prefix_valid, torch.ones(b, horizon, dtype=torch.bool, device=noise.device)], dim=1
        )
        ar = torch.zeros_like(pad)
        if token_causal is not None:
            ar[:, s - tokens.shape[1] : s] = token_causal
        ar[:, s] = True  # actions start a new block: the prefix cannot see them
        allowed, positions = self._openpi_masks(pad, ar)
        dt = torch.tensor(-1.0 / num_steps, dtype=torch.float32)
        x_t = noise.float()
        for t in self.time_schedule(num_steps):
            streams = [
                Stream(self.backbone, prefix_embs),
                Stream(
                    self.expert,
                    self.embed_actions(x_t),
                    self.action_conditioning(t.to(noise.device).expand(b)),
                ),
            ]
            out: JointOutput = joint_forward(
                streams, positions, allowed, None, self.config.rope_base
            )
            x_t = x_t + dt * self.velocity(out.hidden[1])
        return x_t

    @torch.no_grad()
    def text_logits_uncached(
        self, images, image_masks, tokens, token_masks, text: Tensor
    ) -> Tensor:
        """Reference: logits predicting each of ``text`` [B, T] plus the token after it, in one
        pass.

        Returns [B, T + 1, vocab]: row 0 comes from the last valid prefix token.
        """
        prefix_embs, prefix_valid = self.embed_prefix(images, image_masks, tokens, token_masks)
        b, s = prefix_valid.shape
        t = text.shape[1]
        pad = torch.cat(
            [prefix_valid, torch.ones(b, t, dtype=torch.bool, device=text.device)], dim=1
        )
        ar = torch.zeros_like(pad)
        ar[:, s:] = True  # generated text is causal
        allowed, positions = self._openpi_masks(pad, ar)
        embs = torch.cat([prefix_embs, self.embed_tokens(text)], dim=1)
        hidden = joint_forward(
            [Stream(self.backbone, embs)], positions, allowed, None, self.config.rope_base
        ).hidden[0]
        last = s - 1 - prefix_valid.flip(1).float().argmax(dim=1)
        rows = torch.cat([hidden[torch.arange(b), last][:, None], hidden[:, s:]], dim=1)
        return self.logits(rows)
