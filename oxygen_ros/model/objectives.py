"""pi0.5's training objectives over `Pi05Model`: flow matching on actions, cross-entropy on text.

One training example is a frame's prefix (images, then prompt tokens, then optional supervised
text after it) and an action chunk. The losses, as openpi trains pi0.5
(``PI0Pytorch.forward``, commit 15a9616) and as its language extensions add to it:

* **Flow matching.** Per example a time ``t ~ Beta(1.5, 1) * 0.999 + 0.001`` and noise
  ``eps ~ N(0, 1)`` of the actions' shape; ``x_t = t * eps + (1 - t) * actions``; the target
  velocity ``u = eps - actions``; ``v_t`` is ``action_out_proj`` of the expert's action tokens in
  one pass over prefix + suffix with openpi's masks; the loss is ``mean((v_t - u)^2)`` over every
  step and every model action dim (the robot's padding dims included, as zeros). t = 1 is noise.
* **Training-time RTC** (Black et al., arXiv 2512.05964; LeRobot's ``rtc_training_max_delay``):
  per example a delay ``d ~ U{0, ..., max_delay}``; the first ``d`` action tokens are given clean
  (``x = actions``) with time 0 in their adaRMS conditioning, and left out of the loss (the mean
  runs over the other tokens of the batch). Their conditioning is built the way inference builds a
  `rtc.TrainedPrefix`'s frozen tokens (`Pi05Model.step_conditionings` with ``clean``): the
  per-example modulations, with time 0's selected per token.
* **Text.** Cross-entropy of the backbone's tied LM head on the supervised tokens (a subtask
  generated inside the prompt, a narration after it): the logits at position i predict token i+1.
* **Knowledge insulation** (Driess et al., arXiv 2505.23705): the action expert reads the
  backbone's keys and values detached, so the flow loss trains the expert (and the action and
  time projections) but never the backbone; the backbone learns from the text loss only.

The pass is split the way the cached inference path splits it, which is exact because the prefix
never attends to the actions: the backbone runs once over images and all prompt tokens (prompt
bidirectional, the supervised text causal, openpi's ``ar`` rule), then the action expert runs over
the backbone's K/V of the tokens the action prompt holds (a context, as in `Pi05Model.denoise`),
at positions right after them.

Pure torch, no files: the batches are made by ``oxygen_ros.training``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

from .mot import (
    Conditioning,
    JointOutput,
    KVContext,
    Stream,
    joint_forward,
    override_tokens,
    split_rows,
)
from .pi05 import Pi05Model

# openpi's time distribution: Beta(1.5, 1) scaled into [0.001, 1]
TIME_BETA_ALPHA = 1.5
TIME_SCALE = 0.999
TIME_OFFSET = 0.001


@dataclasses.dataclass
class ObjectiveBatch:
    """Model-space tensors of one training batch (B examples).

    images: float32 [B, slots, 3, S, S] in [-1, 1]; image_masks: bool [B, slots].
    tokens: int64 [B, L] prompt ids, then any supervised text after them, right-padded.
    token_masks: bool [B, L] real tokens.
    token_causal: bool [B, L] tokens that attend causally (openpi's ar=1): a subtask-conditioned
        prompt's tail and any supervised text after the prompt.
    action_reads: bool [B, L] the tokens the action expert reads: the frame's prompt, not the
        narration that follows it (which only language requests read).
    text_targets: int64 [B, L] the id each position predicts (the next token), any value where
        ``text_loss_mask`` is False.
    text_loss_mask: bool [B, L] positions whose next token is supervised.
    actions: float32 [B, horizon, model action_dim], normalised, zero-padded dims.
    """

    images: Tensor
    image_masks: Tensor
    tokens: Tensor
    token_masks: Tensor
    token_causal: Tensor
    action_reads: Tensor
    text_targets: Tensor
    text_loss_mask: Tensor
    actions: Tensor

    def to(self, device: torch.device | str) -> ObjectiveBatch:
        return ObjectiveBatch(*(getattr(self, f.name).to(device) for f in dataclasses.fields(self)))


@dataclasses.dataclass
class Losses:
    """The losses of one batch (scalars; ``total`` is what the optimiser minimises)."""

    flow: Tensor
    text: Tensor  # 0 when the batch supervises no token
    total: Tensor
    text_tokens: int  # supervised text tokens in the batch


@dataclasses.dataclass
class FlowSample:
    """The random draws of flow matching for one batch (given explicitly by tests)."""

    noise: Tensor  # [B, horizon, action_dim]
    time: Tensor  # [B], in [0.001, 1]
    clean: Tensor  # bool [B, horizon]: the training-time RTC prefix (all False without RTC)
    # [B, horizon, action_dim]: what the clean prefix shows instead of the actions themselves
    # (a slowed prefix, `slowed_prefix`); None: the actions
    prefix: Tensor | None = None


def sample_flow_time(batch: int, generator: torch.Generator, device=None) -> Tensor:
    """``Beta(1.5, 1) * 0.999 + 0.001`` per example, float32 [batch].

    Beta(a, 1) has CDF x^a, so ``U^(1/a)`` with U uniform is an exact draw (and takes a generator,
    which torch's Beta does not)."""
    uniform = torch.rand(batch, generator=generator, dtype=torch.float32)
    return (uniform.pow(1.0 / TIME_BETA_ALPHA) * TIME_SCALE + TIME_OFFSET).to(device)


def sample_clean_prefix(
    batch: int, horizon: int, max_delay: int, generator: torch.Generator, device=None
) -> Tensor:
    """Training-time RTC's clean prefix as LeRobot samples it: per example a delay uniform in
    {0, ..., max_delay}; bool [batch, horizon], True on the first ``delay`` steps.

    Raises:
        ValueError: ``max_delay`` outside [0, horizon).
    """
    if not 0 <= max_delay < horizon:
        raise ValueError(
            f"rtc_training_max_delay must be in [0, {horizon}) (the action horizon), got "
            f"{max_delay}"
        )
    if max_delay == 0:
        return torch.zeros(batch, horizon, dtype=torch.bool, device=device)
    delays = torch.randint(0, max_delay + 1, (batch,), generator=generator)
    return (torch.arange(horizon)[None, :] < delays[:, None]).to(device)


def slowed_prefix(actions: Tensor, share: float, generator: torch.Generator) -> Tensor:
    """``actions`` [B, horizon, dim] where a ``share`` of the examples (drawn per example) show a
    slowed start instead: ``a_0 + u * (a_i - a_0)`` with ``u`` uniform in [0, 1) (0: an arm held
    still). Used as the clean prefix with the demonstration's own continuation as the target, it
    teaches a checkpoint with training-time RTC that a slow or stalled prefix is not the end of
    the motion: what follows is what the scene calls for. (The demonstrations' still prefixes are
    nearly all in a touch's settle tail, followed by stillness, so a checkpoint trained on them
    alone continues a slowing approach into a stall.)

    Raises:
        ValueError: ``share`` outside [0, 1].
    """
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the slowed-prefix share must be in [0, 1], got {share}")
    b = actions.shape[0]
    slowed = (torch.rand(b, generator=generator) < share).to(actions.device)[:, None, None]
    speed = torch.rand(b, generator=generator).to(actions.device)[:, None, None]
    start = actions[:, :1]
    return torch.where(slowed, start + speed * (actions - start), actions)


def sample_flow(
    actions: Tensor, max_delay: int, generator: torch.Generator, slowed_share: float = 0.0
) -> FlowSample:
    """Noise, times and clean prefix for ``actions`` [B, horizon, dim], drawn from ``generator``
    (a CPU generator: the draws do not depend on the device); with ``slowed_share`` > 0, that
    share of the examples shows a slowed prefix (`slowed_prefix`)."""
    b, horizon = actions.shape[:2]
    noise = torch.randn(actions.shape, generator=generator, dtype=torch.float32)
    time = sample_flow_time(b, generator)
    clean = sample_clean_prefix(b, horizon, max_delay, generator)
    device = actions.device
    prefix = slowed_prefix(actions.float(), slowed_share, generator) if slowed_share > 0 else None
    return FlowSample(noise.to(device), time.to(device), clean.to(device), prefix)


def noisy_actions(actions: Tensor, sample: FlowSample) -> tuple[Tensor, Tensor]:
    """``x_t`` [B, H, D] and the per-token time [B, H]: ``t * noise + (1 - t) * actions`` with
    time 0 on the clean prefix, which shows the actions themselves (or ``sample.prefix``)."""
    token_time = sample.time[:, None].expand(-1, actions.shape[1])
    token_time = torch.where(sample.clean, torch.zeros_like(token_time), token_time)
    t = token_time[..., None]
    x_t = t * sample.noise + (1 - t) * actions.float()
    if sample.prefix is not None:
        x_t = torch.where(sample.clean[..., None], sample.prefix.float(), x_t)
    return x_t, token_time


def flow_matching_loss(velocity: Tensor, target: Tensor, clean: Tensor) -> Tensor:
    """``mean((velocity - target)^2)`` over every action dim of the tokens outside the clean
    prefix (all tokens without one), as LeRobot reduces training-time RTC's loss."""
    squared = (velocity.float() - target.float()).pow(2)
    kept = (~clean)[..., None].expand_as(squared)
    return (squared * kept).sum() / kept.sum().clamp(min=1)


def attention_layout(pad: Tensor, causal: Tensor) -> tuple[Tensor, Tensor]:
    """openpi's ``make_att_2d_masks``: token i sees valid token j iff cumsum(ar)[j] <=
    cumsum(ar)[i]; positions count valid tokens only. -> allowed [B, T, T], positions [B, T]."""
    cum = causal.long().cumsum(dim=1)
    allowed = (cum[:, None, :] <= cum[:, :, None]) & pad[:, None, :] & pad[:, :, None]
    return allowed, pad.long().cumsum(dim=1) - 1


def backbone_pass(model: Pi05Model, batch: ObjectiveBatch) -> tuple[JointOutput, Tensor]:
    """The backbone over images and every token (images and prompt bidirectional, causal tokens
    causal) -> its output (final-normed hidden states, per-layer K/V) and the prefix validity
    [B, slots * patches + L]."""
    embs, valid = model.embed_prefix(
        batch.images, batch.image_masks, batch.tokens, batch.token_masks
    )
    images = embs.shape[1] - batch.tokens.shape[1]
    causal = torch.cat(
        [batch.token_causal.new_zeros(valid.shape[0], images), batch.token_causal], 1
    )
    allowed, positions = attention_layout(valid, causal & valid)
    out = joint_forward(
        [Stream(model.backbone, embs)], positions, allowed, None, model.config.rope_base
    )
    return out, valid


def action_conditioning(model: Pi05Model, time: Tensor, clean: Tensor) -> Conditioning:
    """The action expert's adaRMS modulations: example b's time on its tokens, time 0 on its clean
    prefix (built as `Pi05Model.step_conditionings` builds a trained prefix's: one dense call per
    norm over the B times and time 0, then selected per token)."""
    if not bool(clean.any()):
        return model.action_conditioning(time)
    with_zero = model.action_conditioning(torch.cat([time, time.new_zeros(1)]))
    per_example, at_zero = split_rows(with_zero, time.shape[0])
    return override_tokens(per_example, clean, at_zero)


def action_velocity(
    model: Pi05Model,
    prefix: JointOutput,
    prefix_valid: Tensor,
    action_reads: Tensor,
    x_t: Tensor,
    time: Tensor,
    clean: Tensor,
    insulate: bool = True,
) -> Tensor:
    """The expert's velocity [B, H, D] at ``x_t``, reading the backbone's K/V of the tokens in
    ``action_reads`` (images + the action prompt) as a context, at positions after them.

    insulate: knowledge insulation, the context detached (no gradient into the backbone)."""
    b, horizon = x_t.shape[:2]
    images = prefix_valid.shape[1] - action_reads.shape[1]
    reads = prefix_valid.clone()
    reads[:, images:] &= action_reads
    keys = [k.detach() if insulate else k for k in prefix.keys]
    values = [v.detach() if insulate else v for v in prefix.values]
    context = KVContext(keys, values, reads)
    positions = reads.long().sum(dim=1, keepdim=True) + torch.arange(horizon, device=x_t.device)
    allowed = torch.cat(
        [
            reads[:, None, :].expand(b, horizon, -1),
            torch.ones(b, horizon, horizon, dtype=torch.bool, device=x_t.device),
        ],
        dim=2,
    )
    stream = Stream(model.expert, model.embed_actions(x_t), action_conditioning(model, time, clean))
    out = joint_forward([stream], positions, allowed, context, model.config.rope_base)
    return model.velocity(out.hidden[0])


def text_loss(model: Pi05Model, hidden: Tensor, batch: ObjectiveBatch) -> tuple[Tensor, int]:
    """Mean cross-entropy of the supervised next tokens, from the backbone's hidden states over
    the prompt part [B, L, width] -> (loss, number of supervised tokens); 0 when there are none."""
    mask = batch.text_loss_mask & batch.token_masks
    count = int(mask.sum())
    if count == 0:
        return hidden.new_zeros((), dtype=torch.float32), 0
    logits = model.logits(hidden[mask])
    return F.cross_entropy(logits, batch.text_targets[mask]), count


def training_losses(
    model: Pi05Model,
    batch: ObjectiveBatch,
    sample: FlowSample,
    text_weight: float = 1.0,
    insulate: bool = True,
) -> Losses:
    """The flow-matching and text losses of ``batch`` with the draws ``sample``; ``total`` =
    flow + ``text_weight`` * text."""
    prefix, prefix_valid = backbone_pass(model, batch)
    x_t, _ = noisy_actions(batch.actions, sample)
    target = sample.noise - batch.actions.float()
    velocity = action_velocity(
        model, prefix, prefix_valid, batch.action_reads, x_t, sample.time, sample.clean, insulate
    )
    flow = flow_matching_loss(velocity, target, sample.clean)
    prompt_hidden = prefix.hidden[0][:, -batch.tokens.shape[1] :]
    text, count = text_loss(model, prompt_hidden, batch)
    return Losses(flow, text, flow + text_weight * text, count)


def text_only_loss(model: Pi05Model, batch: ObjectiveBatch) -> tuple[Tensor, int]:
    """The text loss of a batch without actions (vision-language data): the backbone pass and
    `text_loss` only."""
    prefix, _ = backbone_pass(model, batch)
    return text_loss(model, prefix.hidden[0][:, -batch.tokens.shape[1] :], batch)
