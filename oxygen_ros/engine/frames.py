"""Per-frame work shared by every engine: encode an observation into the KV pool, act on it.

A frame's prompt (`prompts.FramePrompt`) may end in a causal tail (a subtask-conditioned action
prompt such as openpi PR #942's ``{subtask}<eos>\\nAction: ``). The frame's one prefill computes it
with openpi's mask: the images and the shared prompt bidirectional, the tail causal on top of them
(the subtask's tokens appended to the shared prefix, positions continuing). Requests that read the
shared part (the subtask request) decode from the same prefill.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from ..model.mot import KVContext
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


@dataclasses.dataclass
class FrameJob:
    """One frame of a batched prefill: its observation, prompt and id, the pool its prefix KV goes
    to (frames of one batch may live in different pools), and for the action its noise seed and
    real-time-chunking guidance (see `act_on_frame`)."""

    pool: KVPool
    observation: Observation
    frame_id: int
    prompt: FramePrompt
    seed: int = 0
    guidance: RTCGuidance | TrainedPrefix | None = None


def prefill_frames(
    policy: Pi05Policy, jobs: Sequence[FrameJob], faults: FaultInjector = NO_FAULTS
) -> tuple[list[FramePrefix], Prefix]:
    """Encode the jobs' observations as one batch (`Pi05Policy.encode_batch`), prefill them in
    one model call and write each row's valid columns into its job's pool: the same KV as a
    batch of one would write. Returns the frames (the caller holds one reference to each) and
    the batched prefix, which `act_on_prefix` can read without going through the pools.

    On any exception every segment taken is released before the exception propagates.
    """
    segments: list[KVSegment] = []
    try:
        inputs = policy.encode_batch([(job.observation.images, job.prompt) for job in jobs])
        prefix = policy.model.prefill(
            inputs.images,
            inputs.image_masks,
            inputs.tokens,
            inputs.token_masks,
            inputs.token_causal,
        )
        context = prefix.context
        for row, job in enumerate(jobs):
            keep = context.valid[row]
            whole = bool(keep.all())  # a batch of one keeps only valid columns (Pi05Model.prefill)
            segment = job.pool.allocate(
                int(prefix.num_valid[row]), owner=f"frame {job.frame_id} prefix"
            )
            segments.append(segment)
            job.pool.write(
                segment,
                [k[row] if whole else k[row, keep] for k in context.keys],
                [v[row] if whole else v[row, keep] for v in context.values],
            )
        faults.check("prefill")
    except BaseException as error:
        tag_stage(error, "prefill")
        for job, segment in zip(jobs, segments, strict=False):
            job.pool.release(segment)
        raise
    frames = [
        FramePrefix(
            job.frame_id,
            job.observation.stamp,
            segment,
            columns,
            tuple(job.prompt.ids),
            job.prompt.shared,
            job.prompt.subtask_id,
        )
        for job, segment, columns in zip(jobs, segments, inputs.image_columns, strict=True)
    ]
    return frames, prefix


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
    the runner has no captured bucket for this observation and prompt length (then the eager path,
    `prefill_frames`, does). On any exception the frame's KV is released before the exception
    propagates.
    """
    if prompt is None:
        prompt = policy.frame_prompt(observation.state, observation.prompt)
    if runner is not None:
        segment = None
        try:
            segment = runner.prefill(
                observation, f"frame {frame_id} prefix", prompt.ids, prompt.causal_from
            )
            if segment is not None:
                faults.check("prefill")
        except BaseException as error:
            tag_stage(error, "prefill")
            if segment is not None:
                pool.release(segment)
            raise
        if segment is not None:
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
    frames, _ = prefill_frames(policy, [FrameJob(pool, observation, frame_id, prompt)], faults)
    return frames[0]


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
        actions = policy.decode_batch(model_actions[None], [observation.state])[0]
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


def prefix_rows(prefix: Prefix, rows: Sequence[int]) -> Prefix:
    """The batch rows ``rows`` of a batched prefix (padding columns stay masked)."""
    index = torch.tensor(list(rows), device=prefix.num_valid.device)
    context = prefix.context
    return Prefix(
        KVContext(
            [k.index_select(0, index) for k in context.keys],
            [v.index_select(0, index) for v in context.values],
            context.valid.index_select(0, index),
        ),
        prefix.num_valid.index_select(0, index),
    )


def act_on_prefix(
    policy: Pi05Policy,
    prefix: Prefix,
    noise: Tensor,
    num_steps: int,
    guidance: Sequence[RTCGuidance | TrainedPrefix | None],
) -> Tensor:
    """Denoise every row of a batched prefix [B] from ``noise`` [B, horizon, dim]: the unguided
    rows in one batched call, each guided row (``guidance[row]``: a batch-of-one guidance) on
    its own."""
    unguided = [row for row, rule in enumerate(guidance) if rule is None]
    if len(unguided) == len(guidance):
        return policy.model.sample_actions(prefix, noise, num_steps)
    actions = torch.empty_like(noise, dtype=torch.float32)
    if unguided:
        index = torch.tensor(unguided, device=noise.device)
        actions[index] = policy.model.sample_actions(
            prefix_rows(prefix, unguided), noise[index], num_steps
        )
    for row, rule in enumerate(guidance):
        if rule is not None:
            actions[row : row + 1] = policy.model.sample_actions(
                prefix_rows(prefix, [row]), noise[row : row + 1], num_steps, rule
            )
    return actions


def timed_actions(
    policy: Pi05Policy,
    jobs: Sequence[FrameJob],
    num_steps: int,
    clock: Clock,
    faults: FaultInjector = NO_FAULTS,
) -> list[tuple[FramePrefix, ActionChunk]]:
    """`timed_action` for a batch of frames (eager paths): one prefill (`prefill_frames`), one
    denoising loop over the batched prefix (`act_on_prefix`), one decode into each robot's
    actions (`Pi05Policy.decode_batch`). Each frame's noise is `frame_noise` of its job's seed
    and id, so a frame's actions do not depend on the batch it ran in (up to float rounding).
    The times are the batch's. The caller owns each returned frame's reference.

    Transactional: on any exception every block the batch took is back in its pool and the
    exception propagates, tagged with its stage.
    """
    start = clock()
    frames, prefix = prefill_frames(policy, jobs, faults)
    try:
        prefilled = clock()
        device = policy.device
        noise = torch.cat(
            [frame_noise(policy.config, job.seed, job.frame_id, device) for job in jobs]
        )
        faults.check("action")
        model_actions = act_on_prefix(
            policy, prefix, noise, num_steps, [job.guidance for job in jobs]
        )
        actions = policy.decode_batch(model_actions, [job.observation.state for job in jobs])
    except BaseException as error:
        tag_stage(error, "action")
        for job, frame in zip(jobs, frames, strict=True):
            job.pool.release(frame.segment)
        raise
    done = clock()
    return [
        (
            frame,
            ActionChunk(
                job.frame_id,
                job.observation.stamp,
                robot_actions,
                (prefilled - start) * 1e3,
                (done - prefilled) * 1e3,
                subtask_id=frame.subtask_id,
            ),
        )
        for job, frame, robot_actions in zip(jobs, frames, actions, strict=True)
    ]
