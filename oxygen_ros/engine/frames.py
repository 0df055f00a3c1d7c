"""Per-frame work shared by every engine: encode an observation into the KV pool, act on it.

A frame's prompt (`prompts.FramePrompt`) may end in a causal tail (a subtask-conditioned action
prompt such as openpi PR #942's ``{subtask}<eos>\\nAction: ``). The frame's one prefill computes it
with openpi's mask: the images and the shared prompt bidirectional, the tail causal on top of them
(the subtask's tokens appended to the shared prefix, positions continuing). Requests that read the
shared part (the subtask request) decode from the same prefill.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ..model.pi05 import Prefix
from ..model.rtc import RTCGuidance, TrainedPrefix
from ..policy_io.policy import Pi05Policy
from ..policy_io.prompts import FramePrompt
from .faults import NO_FAULTS, FaultInjector, tag_stage
from .kv_cache import KVPool, KVSegment
from .static_paths import StaticRunner, chunk_kind
from .types import ActionChunk, Clock, Observation


@dataclasses.dataclass
class FramePrefix:
    """A frame's prefix KV living in a pool (the caller holds one reference to ``segment``)."""

    frame_id: int
    stamp: float
    segment: KVSegment
    image_columns: int = 0  # valid image tokens at the start of the prefix
    prompt_ids: tuple[int, ...] = ()  # the prompt's token ids (bos first)
    shared: int = 0  # prompt ids in the shared bidirectional part (see `prompts.FramePrompt`)
    subtask_id: int = 0  # the subtask the frame's prompt carries (0: none)

    @property
    def length(self) -> int:
        return self.segment.length

    @property
    def shared_length(self) -> int:
        """Prefix tokens of the shared part: the images and the shared prompt ids."""
        return self.image_columns + self.shared

    @property
    def last_shared_token(self) -> int:
        """The id of the shared part's last token (a request reading the shared part re-feeds it
        over the tokens before it: its hidden state and K/V come out as the prefill's)."""
        return self.prompt_ids[self.shared - 1]


def frame_noise(config, seed: int, frame_id: int, device: torch.device) -> Tensor:
    """The flow-matching start noise of a frame: the same in every engine for the same seed."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + frame_id)
    noise = torch.randn(1, config.action_horizon, config.action_dim, generator=generator)
    return noise.to(device)


def max_prefix_tokens(policy: Pi05Policy) -> int:
    """Largest prefix a frame can need: every image slot plus a full-length prompt."""
    cfg = policy.config
    return cfg.num_image_slots * cfg.image_tokens + cfg.max_token_len


def prefill_frame(
    policy: Pi05Policy,
    pool: KVPool,
    observation: Observation,
    frame_id: int,
    runner: StaticRunner | None = None,
    faults: FaultInjector = NO_FAULTS,
    prompt: FramePrompt | None = None,
) -> FramePrefix:
    """Encode one observation and write its prefix KV into ``pool`` — the frame's only prefill.

    prompt: the frame's prompt ids (default: openpi's action prompt of the observation); its
    causal tail, if any, attends causally (openpi's ar mask).

    With a ``runner`` (static shapes / CUDA graphs) the fixed-shape path writes the same KV, unless
    the runner has no captured bucket for this observation and prompt length (then the eager path
    does). On any exception the frame's KV is released before the exception propagates.
    """
    owner = f"frame {frame_id} prefix"
    if prompt is None:
        prompt = policy.frame_prompt(observation.state, observation.prompt)
    segment = None
    try:
        if runner is not None:
            segment = runner.prefill(observation, owner, prompt.ids, prompt.causal_from)
        if segment is None:
            inputs = policy.encode(
                observation.images, observation.state, observation.prompt, prompt
            )
            prefix = policy.model.prefill(
                inputs.images,
                inputs.image_masks,
                inputs.tokens,
                inputs.token_masks,
                inputs.token_causal,
            )
            # A batch of one keeps only valid tokens (see Pi05Model.prefill), so every column is
            # real.
            segment = pool.allocate(int(prefix.num_valid[0]), owner=owner)
            pool.write(
                segment, [k[0] for k in prefix.context.keys], [v[0] for v in prefix.context.values]
            )
        faults.check("prefill")
    except BaseException as error:
        tag_stage(error, "prefill")
        if segment is not None:
            pool.release(segment)
        raise
    columns = len(policy.present_slots(observation.images)) * policy.config.image_tokens
    return FramePrefix(
        frame_id,
        observation.stamp,
        segment,
        columns,
        tuple(prompt.ids),
        prompt.shared,
        prompt.subtask_id,
    )


def act_on_frame(
    policy: Pi05Policy,
    pool: KVPool,
    frame: FramePrefix,
    noise: Tensor,
    num_steps: int,
    runner: StaticRunner | None = None,
    guidance: RTCGuidance | TrainedPrefix | None = None,
) -> Tensor:
    """Denoise an action chunk reading the frame's prefix KV from the pool (never writing it).

    ``guidance`` (real-time chunking): identity guidance and training-time RTC run on the static
    path like the plain chunk; vjp guidance always runs the eager guided sampler. A frozen static
    runner without a bucket for this prefix (and kind) also falls back to the eager path.
    """
    if runner is not None and chunk_kind(guidance) is not None:
        actions = runner.act(frame.segment, noise, num_steps, guidance)
        if actions is not None:
            return actions
    context = pool.view(frame.segment)
    prefix = Prefix(context, torch.tensor([frame.length], device=noise.device))
    return policy.model.sample_actions(prefix, noise, num_steps, guidance)[0]


def timed_action(
    policy: Pi05Policy,
    pool: KVPool,
    observation: Observation,
    frame_id: int,
    seed: int,
    num_steps: int,
    clock: Clock,
    runner: StaticRunner | None = None,
    faults: FaultInjector = NO_FAULTS,
    guidance: RTCGuidance | TrainedPrefix | None = None,
    prompt: FramePrompt | None = None,
) -> tuple[FramePrefix, ActionChunk]:
    """Prefill + action for one frame, timed; the caller owns the returned frame's reference.
    ``guidance``: see `act_on_frame`; ``prompt``: see `prefill_frame`.

    Transactional: on any exception (prefill or action) every block the frame took is back in the
    pool and the original exception propagates, tagged with its stage (`faults.stage_of`).
    """
    start = clock()
    frame = prefill_frame(policy, pool, observation, frame_id, runner, faults, prompt)
    try:
        if runner is not None:
            # the static prefill never syncs by itself: charge its GPU time here
            runner.synchronize()
        prefilled = clock()
        noise = frame_noise(policy.config, seed, frame_id, policy.device)
        faults.check("action")
        model_actions = act_on_frame(policy, pool, frame, noise, num_steps, runner, guidance)
        actions = policy.robot_actions(model_actions, observation.state)
    except BaseException as error:
        tag_stage(error, "action")
        pool.release(frame.segment)
        raise
    done = clock()
    chunk = ActionChunk(
        frame_id,
        observation.stamp,
        actions,
        (prefilled - start) * 1e3,
        (done - prefilled) * 1e3,
        subtask_id=frame.subtask_id,
    )
    return frame, chunk
