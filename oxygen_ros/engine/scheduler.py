"""The OxyGen loop: one shared prefill per frame, a deadline-bound action, and cross-frame
continuous batching of every active language request in the slack before the next deadline.

    step(observation, next_deadline):
        prefill once -> prefix KV (unified pool)           } act(): the hard-deadline path,
        action expert over that KV -> action chunk         } never waits for language
        admit queued requests onto this frame's prefix
        batched decode steps over the active requests (whatever their frame), while a step still
        fits before the deadline: all of them, or the oldest ones when all do not fit
        (or k steps over all of them in fixed mode, the paper's setting; with a deadline given,
        a step that does not fit before it is skipped and counted)

In the subtask loop (``subtask_conditioning`` prompt | same_frame, `subtasks.SubtaskLoop`) the
frame's prompt carries the newest subtask that finished before it, and a due subtask request is
queued first in line, decoded like any other request: the action path never waits for it.

Step latency is estimated per batch size and context length (``metrics.StepTimer``), admission
prefills by their own token count. KV ownership is transactional: a fault in the action path
returns the frame's blocks and propagates; a fault in a language stage ends the requests it hit
with a ``failed`` final delta (see ``language``), and ``EngineBase._serve`` holds that promise for
an exception that leaves a stage as a whole (the engine's language boundary: ``decode`` never
raises for a language fault). Faults are counted per stage in ``faults_by_stage`` (the injector's
stages, plus ``scheduler`` for the batch choice and stall checks around the steps); ``check_memory``
verifies that every live KV segment belongs to a live frame or request.

``EngineBase`` holds what every engine shares (request intake, memory accounting, the frame
counter); the paper's baselines in ``baselines.py`` derive from it too, so all of them are driven
through the same ``submit`` / ``step`` interface.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..model.policy import Pi05Policy
from ..model.prompts import KindFormat, PromptFormat, check_conditioning, preset
from ..model.rtc import CONTINUITY_MODES, GUIDANCE, SCHEDULES
from .continuity import ChunkContinuity
from .faults import NO_FAULTS, FaultInjector, describe, stage_of, tag_stage
from .frames import FramePrefix, max_prefix_tokens, timed_action
from .kv_cache import KVInvariantError, KVPool
from .language import LanguageDecoder
from .metrics import StepTimer
from .requests import LanguageRequest, RequestState, SamplingParams
from .static_paths import PLAIN, ChunkKind, StaticRunner
from .subtasks import SubtaskLoop
from .types import ActionChunk, Clock, FrameResult, FrameStats, Observation, TextDelta, WarmUpReport

WARM_UP_FRAMES = 5  # first-call frames `EngineBase.warm_up` runs after the buckets and timings


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    num_steps: int = 10  # flow-matching denoising steps per action chunk
    # "deadline": measured step latency decides; "fixed": k steps per frame
    decode_mode: str = "deadline"
    decode_steps_per_frame: int = 5  # k, used in fixed mode
    max_active_requests: int = 16
    max_queued_requests: int = 64
    max_wait_frames: int = 300  # a queued request waiting longer than this is refused
    max_stall_frames: int = 100  # an active request that gets no decode step for this many frames
    # in a row (every tick overran its deadline) is finished as "stalled", freeing its KV
    kv_capacity_tokens: int = 0  # 0 = room for max_active_requests frames of prefix plus their text
    kv_block_size: int = 16
    # slack left unused before the deadline (the node: decode_margin_ms)
    deadline_margin_ms: float = 3.0
    seed: int = 0
    default_max_tokens: int = 30
    # The checkpoint's prompt format (model/prompts.py): a preset name or a PromptFormat.
    prompt_format: str | PromptFormat = "openpi"
    # Kind texts overriding the format's ("{text}" is the request's text); None: the format's.
    kind_prompts: Mapping[str, str] | None = None
    # pi0.5's hierarchy (engine/subtasks.py): "none" | "prompt" | "same_frame"
    subtask_conditioning: str = "none"
    subtask_period_s: float = 1.0  # a new subtask is decoded this often (and when the task changes)
    subtask_max_tokens: int = 0  # 0: the format's limit for its subtask kind
    # GPU fast path (engine/static_paths.py). Off: the eager, data-sized paths (CPU default).
    static_shapes: bool = False  # fixed-shape prefill / action / text steps (eager on CPU)
    # capture those steps in CUDA graphs; implies static_shapes, CUDA only
    cuda_graphs: bool = False
    gpu_preprocess: bool = False  # resize/scale images on the model device (static paths only)
    context_bucket: int = 128  # static action/text contexts are padded to a multiple of this
    # Continuous chunks (engine/continuity.py, model/rtc.py). "rtc": each chunk continues the
    # previous one: training-time RTC when the checkpoint declares rtc_training_max_delay, else
    # guided RTC with rtc_guidance (see `continuity_mode`).
    chunk_continuity: str = "none"  # "none" | "rtc"
    action_dt: float = 0.02  # seconds between consecutive actions of a chunk (the controller step)
    rtc_execution_horizon: int = 0  # guided steps of a new chunk at most; 0: the whole overlap
    rtc_max_guidance_weight: float = 5.0  # beta: clip of the guidance weight
    rtc_schedule: str = "exp"  # soft-mask decay over the overlap: "exp" | "linear"
    rtc_guidance: str = "identity"  # guided RTC's correction: "identity" | "vjp"
    # the checkpoint's declaration (the loader sets it); > 0: training-time RTC, refused (guided
    # fallback) for a delay above it
    rtc_training_max_delay: int = 0

    def __post_init__(self) -> None:
        if self.decode_mode not in ("deadline", "fixed"):
            raise ValueError(f"decode_mode must be 'deadline' or 'fixed', got {self.decode_mode!r}")
        if self.gpu_preprocess and not self.uses_static_paths:
            raise ValueError(
                "gpu_preprocess=True works on the static paths: set static_shapes=True (or "
                "cuda_graphs=True)"
            )
        for name in (
            "num_steps",
            "max_active_requests",
            "kv_block_size",
            "default_max_tokens",
            "context_bucket",
            "max_stall_frames",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if (
            self.decode_steps_per_frame < 0
            or self.max_queued_requests < 0
            or self.kv_capacity_tokens < 0
        ):
            raise ValueError(
                "decode_steps_per_frame, max_queued_requests and kv_capacity_tokens must be >= 0"
            )
        if self.chunk_continuity not in CONTINUITY_MODES:
            raise ValueError(
                f"chunk_continuity must be one of {', '.join(CONTINUITY_MODES)}, got "
                f"{self.chunk_continuity!r}"
            )
        if self.rtc_guidance not in GUIDANCE:
            raise ValueError(
                f"rtc_guidance must be one of {', '.join(GUIDANCE)}, got {self.rtc_guidance!r}"
            )
        if self.rtc_training_max_delay < 0:
            raise ValueError(
                f"rtc_training_max_delay must be >= 0, got {self.rtc_training_max_delay}"
            )
        if self.rtc_schedule not in SCHEDULES:
            raise ValueError(
                f"rtc_schedule must be one of {', '.join(SCHEDULES)}, got {self.rtc_schedule!r}"
            )
        if not (
            self.action_dt > 0
            and self.rtc_execution_horizon >= 0
            and 0 <= self.rtc_max_guidance_weight < float("inf")
        ):
            raise ValueError(
                f"action_dt must be > 0 (got {self.action_dt}), rtc_execution_horizon >= 0 (got "
                f"{self.rtc_execution_horizon}) "
                f"and rtc_max_guidance_weight finite and >= 0 (got {self.rtc_max_guidance_weight})"
            )
        if self.kind_prompts is not None:
            if not self.kind_prompts:
                raise ValueError("kind_prompts must name at least one language kind")
            empty = [k for k, v in self.kind_prompts.items() if not v.format(text="x").strip()]
            if empty:
                raise ValueError(f"kind prompts must not be empty: {empty}")
        # an unknown preset or a mode the format cannot serve: PromptFormatError (a ValueError)
        check_conditioning(self.format, self.subtask_conditioning)
        if not (self.subtask_period_s >= 0 and self.subtask_max_tokens >= 0):
            raise ValueError(
                f"subtask_period_s (got {self.subtask_period_s}) and subtask_max_tokens (got "
                f"{self.subtask_max_tokens}) must be >= 0"
            )

    @property
    def uses_static_paths(self) -> bool:
        return self.static_shapes or self.cuda_graphs

    @property
    def continuity_mode(self) -> str:
        """What continues a chunk: ``none``, ``trained`` (rtc with a checkpoint trained for it) or
        the guidance, ``identity`` | ``vjp``."""
        if self.chunk_continuity == "none":
            return "none"
        return "trained" if self.rtc_training_max_delay > 0 else self.rtc_guidance

    @property
    def format(self) -> PromptFormat:
        """The prompt format (`prompt_format` resolved)."""
        fmt = self.prompt_format
        return fmt if isinstance(fmt, PromptFormat) else preset(fmt)

    @property
    def hierarchy(self) -> bool:
        """Whether the subtask loop runs (subtask_conditioning prompt or same_frame)."""
        return self.subtask_conditioning != "none"

    @property
    def kinds(self) -> dict[str, KindFormat]:
        """Every language kind a request may have, with its prompt: the format's, with
        ``kind_prompts`` in their place when given (the subtask kind only in the subtask loop)."""
        kinds = dict(self.format.kinds)
        if self.kind_prompts is not None:
            kinds = {k: KindFormat((v,), ours=True) for k, v in self.kind_prompts.items()} | {
                k: v for k, v in kinds.items() if k == "subtask"
            }
        if not self.hierarchy:
            kinds.pop("subtask", None)
        return kinds


def subtask_token_limit(policy: Pi05Policy, config: EngineConfig, prompt_tokens: int) -> int:
    """A subtask's token limit: ``subtask_max_tokens`` (0: the format's, else 64), and no more than
    the conditioned prompt (``prompt_tokens`` without a subtask) leaves of ``max_token_len``, so
    that the next frames' prompt carries all of it."""
    limit = config.subtask_max_tokens or config.kinds["subtask"].max_tokens or 64
    return max(1, min(limit, policy.config.max_token_len - prompt_tokens))


def new_request(
    policy: Pi05Policy,
    config: EngineConfig,
    request_id: int,
    kind: str,
    text: str = "",
    sampling: SamplingParams | None = None,
    **fields: str,
) -> LanguageRequest:
    """A language request of ``kind`` in the engine's prompt format: its own text with ``text``
    (a question) and ``fields`` (task, memory, previous), the format's token limit and suppressed
    ids.

    Raises:
        ValueError: a kind the configuration does not have.
    """
    kinds = config.kinds
    if kind not in kinds:
        raise ValueError(f"unknown language kind {kind!r}; configured kinds: {sorted(kinds)}")
    spec = kinds[kind]
    sampling = sampling or SamplingParams(max_tokens=config.default_max_tokens)
    if spec.max_tokens and sampling.max_tokens > spec.max_tokens:
        sampling = dataclasses.replace(sampling, max_tokens=spec.max_tokens)
    if config.kind_prompts is not None and kind in config.kind_prompts:
        prompt = policy.tokenizer.encode_text(config.kind_prompts[kind].format(text=text))
    else:
        prompt = config.format.kind_ids(policy.tokenizer, kind, text=text, **fields)
    return LanguageRequest(
        request_id,
        kind,
        prompt,
        sampling,
        policy.tokenizer,
        reads_shared=spec.reads == "shared",
        suppress=spec.suppress,
    )


def make_pool(policy: Pi05Policy, config: EngineConfig) -> KVPool:
    cfg = policy.config.backbone
    capacity = config.kv_capacity_tokens or (
        (config.max_active_requests + 2) * max_prefix_tokens(policy)
        + config.max_active_requests * (64 + config.default_max_tokens)
    )
    return KVPool(
        num_layers=cfg.depth,
        kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        capacity_tokens=capacity,
        block_size=config.kv_block_size,
        dtype=policy.model.compute_dtype,
        device=policy.device,
        # static steps send padding K/V here (outside the accounted capacity)
        scratch_tokens=max(policy.config.max_token_len, 64) if config.uses_static_paths else 0,
    )


def static_chunk_kinds(config: EngineConfig) -> list[ChunkKind]:
    """The static action chunks an engine with ``config`` runs: the plain one (first frames, no
    overlap), and the continuing one of its continuity mode (trained also warms identity, its
    fallback; vjp runs eagerly)."""
    kinds = [PLAIN]
    mode = config.continuity_mode
    if mode == "trained":
        kinds.append(("trained", 0.0))
    if mode in ("trained", "identity") and config.rtc_guidance == "identity":
        if config.rtc_max_guidance_weight > 0:
            kinds.append(("identity", float(config.rtc_max_guidance_weight)))
    return kinds


def make_runner(
    policy: Pi05Policy, pool: KVPool, config: EngineConfig, faults: FaultInjector = NO_FAULTS
) -> StaticRunner | None:
    """The static-shape runner of ``pool`` when the config asks for it, else None (eager paths).

    Raises ValueError for cuda_graphs=True with the model off CUDA.
    """
    if not config.uses_static_paths:
        return None
    return StaticRunner(
        policy,
        pool,
        cuda_graphs=config.cuda_graphs,
        gpu_preprocess=config.gpu_preprocess,
        context_bucket=config.context_bucket,
        faults=faults,
    )


class EngineBase:
    """Request intake, ids and memory accounting shared by OxyGen and the baselines.

    faults: where the engine's stages check for injected faults (default: never).
    """

    name = "base"
    decoder: LanguageDecoder  # every engine's language stages (set by the subclass)

    def __init__(
        self,
        policy: Pi05Policy,
        config: EngineConfig | None = None,
        clock: Clock = time.perf_counter,
        faults: FaultInjector = NO_FAULTS,
    ) -> None:
        self.policy = policy
        self.config = config or EngineConfig()
        self.clock = clock
        self.faults = faults
        self.faults_by_stage: dict[str, int] = {}  # stage -> faults caught or propagated there
        self.frame_count = 0
        self._next_request_id = 1
        self._queue: collections.deque[LanguageRequest] = collections.deque()
        self._outbox: list[TextDelta] = []  # deltas produced outside a frame (refusals at submit)
        self.tokens_generated = 0  # cumulative language tokens sampled
        self.decode_steps = 0  # cumulative batched decode steps (admission prefills included)
        self._runners: list[tuple[StaticRunner, bool, int]] = []  # (runner, acts, max text batch)

    def _make_runner(self, pool: KVPool, acts: bool, text_batch: int) -> StaticRunner | None:
        """A static runner for one of this engine's pools (None on the eager paths); ``acts`` and
        ``text_batch`` say what `warm_up` should prepare for it."""
        runner = make_runner(self.policy, pool, self.config, self.faults)
        if runner is not None:
            self._runners.append((runner, acts, text_batch))
        return runner

    def warm_up(self, observation: Observation, frames: int = WARM_UP_FRAMES) -> WarmUpReport:
        """Prepare the engine before its first real deadline, with frames like ``observation``:

        1. create (on CUDA capture) the static buckets those frames will use (camera set, prompt
           length, batch and context buckets up to this engine's limits), then freeze the runners:
           from here on no bucket is created inside a frame (a shape not captured runs on the
           nearest larger bucket or the eager path; `captures_during_frames` counts any capture);
        2. engine-specific timings (`OxygenEngine`: decode steps at every batch size it may use);
        3. ``frames`` (at least 2) frames with small greedy language requests, which pay the
           first-call costs of the whole frame and time the action path.

        Afterwards the engine is as if nothing ran: no frame kept, no request queued or active, the
        pools empty with their peaks reset, frame and request ids and counters back at zero (the
        step timers keep what they learned). Returns what was prepared and measured.

        Raises RuntimeError when a frame or a request came first.
        """
        if self.frame_count or self._queue or self.active_requests:
            raise RuntimeError("warm_up must run before the first frame and the first request")
        created = self._prepare_buckets(observation)
        self._calibrate(observation)
        action_ms = self._first_frames(observation, max(frames, 2))
        self._forget_warm_up()
        return WarmUpReport(created, action_ms, self._language_step_ms(), max(frames, 2))

    def _prepare_buckets(self, observation: Observation) -> int:
        """Step 1 of `warm_up`: create the buckets and freeze; returns how many were created."""
        cfg = self.config
        kind_tokens = [
            len(request.prompt) + int(request.reads_shared)
            for request in (new_request(self.policy, cfg, 0, kind) for kind in cfg.kinds)
        ]
        # a subtask-conditioned prompt grows up to the model's prompt length
        shortest = len(
            self.policy.frame_prompt(observation.state, observation.prompt, cfg.format).ids
        )
        longest = self.policy.config.max_token_len if cfg.hierarchy else shortest
        created = 0
        for runner, acts, batch in self._runners:
            created += runner.warm_up(
                observation,
                num_steps=cfg.num_steps if acts else None,
                max_batch=batch,
                text_tokens=max(kind_tokens) + cfg.default_max_tokens,
                attach_tokens=kind_tokens if batch else (),
                chunk_kinds=static_chunk_kinds(cfg),
                prompt_lengths=(shortest, longest),
            )
            runner.freeze()
        return created

    def _calibrate(self, observation: Observation) -> None:
        """Step 2 of `warm_up` (nothing here; engines with step timers fill them)."""

    def _first_frames(self, observation: Observation, frames: int) -> float:
        """Step 3 of `warm_up`: frames with one or two short greedy requests each; returns the
        median prefill + action ms of the frames after the first (which pays the first calls)."""
        cfg = self.config
        kind = _warm_up_kind(cfg)
        sampling = SamplingParams(max_tokens=4, temperature=0.0, seed=cfg.seed)
        action_ms = []
        for frame in range(frames):
            for _ in range(min(frame % 2 + 1, cfg.max_active_requests)):
                self.submit(kind, sampling=sampling)
            stats = self.step(observation).stats
            action_ms.append(stats.prefill_ms + stats.action_ms)
        return float(np.median(action_ms[1:]))

    def _end_warm_up_requests(self) -> None:
        """Finish whatever the warm-up frames left running (here: nothing outlives its frame)."""

    def _forget_warm_up(self) -> None:
        """Leave the engine as if the warm-up frames never ran (timers and buckets stay)."""
        self._end_warm_up_requests()
        self._queue.clear()
        self._outbox = []
        self.frame_count = 0
        self._next_request_id = 1
        self.tokens_generated = self.decode_steps = 0
        self.faults_by_stage.clear()
        for runner, _, _ in self._runners:
            runner.fallbacks = runner.captures_during_frames = 0
        for pool in self.pools():
            pool.reset_peak()

    def _language_step_ms(self) -> float:
        """Estimated batch-1 decode step for the warm-up report (0.0: no step timer here)."""
        return 0.0

    @property
    def captures_during_frames(self) -> int:
        """Static buckets (CUDA graphs) created after warm-up froze the runners: must stay 0."""
        return sum(runner.captures_during_frames for runner, _, _ in self._runners)

    @property
    def static_fallbacks(self) -> int:
        """Frame steps a frozen runner had no captured bucket for (they ran on the eager path)."""
        return sum(runner.fallbacks for runner, _, _ in self._runners)

    def _count_fault(self, stage_name: str) -> None:
        self.faults_by_stage[stage_name] = self.faults_by_stage.get(stage_name, 0) + 1

    # -- the language boundary -------------------------------------------------------------------
    def _serve(
        self,
        stage: str,
        served: Callable[[], Sequence[LanguageRequest]],
        out: list[TextDelta],
        work: Callable[[], object],
    ) -> bool:
        """Run ``work``: one language stage (an admission, a decode step with its bookkeeping, a
        request decoded to completion) that appends its deltas to ``out`` as it makes them.

        The engine's boundary for language faults: whatever ``work`` raises (from any depth: a
        stage's own guards cover only the injector's hooks) is caught here. Then each request of
        ``served()`` (called after the fault: the requests the stage had taken on) whose final delta
        is not in ``out`` gets a ``failed`` one, also a request the stage had already finished (that
        final went down with the stage), so every request ends with exactly one final; their KV
        goes back, they leave the engine, and the fault is counted once under its stage. Deltas
        already in ``out`` stay there. Returns whether ``work`` completed.
        """
        try:
            work()
            return True
        except Exception as error:
            self._fail_served(served(), error, stage, out)
            return False

    def _fail_served(
        self,
        requests: Sequence[LanguageRequest],
        error: BaseException,
        stage: str,
        out: list[TextDelta],
    ) -> None:
        """`_serve`'s recovery: count, finals into ``out`` first (nothing after can lose them),
        then forget the requests and release their KV (a release that fails too is counted under
        ``kv_release`` and the others still go back; `check_memory` then reports the leak)."""
        self._count_fault(stage_of(error, stage))
        sent = {d.request_id for d in out if d.final}
        detail = describe(error)
        out += [r.fail(detail) for r in requests if r.request_id not in sent]
        self._forget(requests)
        for request in requests:
            try:
                self.decoder.release(request)
            except Exception as release_error:
                self._count_fault(stage_of(release_error, "kv_release"))

    def _forget(self, requests: Sequence[LanguageRequest]) -> None:
        """Drop finished ``requests`` from the engine's lists (here: the queue)."""
        for request in requests:
            if request in self._queue:
                self._queue.remove(request)

    def check_memory(self) -> None:
        """Verify the KV pools' invariants (`KVPool.check`). Raises KVInvariantError."""
        for pool in self.pools():
            pool.check()

    # -- intake --------------------------------------------------------------------------------
    def submit(
        self,
        kind: str,
        text: str = "",
        sampling: SamplingParams | None = None,
        **fields: str,
    ) -> int:
        """Queue a language request in the engine's prompt format; it reads the prefix of the
        frame at which it is admitted. ``text``: a question; ``fields``: task, memory, previous.

        Returns the request id. A full queue refuses at once (a final delta with the reason).
        """
        return self._enqueue(kind, text, sampling, **fields).request_id

    def _enqueue(
        self,
        kind: str,
        text: str = "",
        sampling: SamplingParams | None = None,
        front: bool = False,
        **fields: str,
    ) -> LanguageRequest:
        request = new_request(
            self.policy, self.config, self._next_request_id, kind, text, sampling, **fields
        )
        self._next_request_id += 1
        if len(self._queue) >= self.config.max_queued_requests:
            self._outbox.append(
                self._refuse(request, f"queue full ({self.config.max_queued_requests} waiting)")
            )
        elif front:
            self._queue.appendleft(request)
        else:
            self._queue.append(request)
        return request

    def _refuse(self, request: LanguageRequest, why: str) -> TextDelta:
        delta = request.finish("refused")
        delta.detail = why
        return delta

    def _new_frame_id(self) -> int:
        self.frame_count += 1
        return self.frame_count

    # -- interface -----------------------------------------------------------------------------
    def step(
        self,
        observation: Observation,
        now: float | None = None,
        next_deadline: float | None = None,
    ) -> FrameResult:
        """Run one frame: its action chunk (always) and whatever language this engine does in it.

        now: when the frame's tick started on the engine clock (default: the clock now); frame time
        is measured from it. next_deadline: the next tick's start on the same clock;
        deadline-aware engines stop language work before it.
        """
        start = self.clock() if now is None else now
        tokens_before, steps_before = self.tokens_generated, self.decode_steps
        chunk, deltas = self._run_frame(observation, next_deadline)
        end = self.clock()
        frame_ms = (end - start) * 1e3
        stats = FrameStats(
            frame_id=chunk.frame_id,
            frame_ms=frame_ms,
            prefill_ms=chunk.prefill_ms,
            action_ms=chunk.action_ms,
            decode_ms=max(0.0, frame_ms - chunk.prefill_ms - chunk.action_ms),
            decode_steps=self.decode_steps - steps_before,
            tokens=self.tokens_generated - tokens_before,
            active_requests=self.active_requests,
            kv_bytes_in_use=self.memory()["bytes_in_use"],
            deadline_met=next_deadline is None or end <= next_deadline,
        )
        return FrameResult(chunk, deltas, stats)

    def _run_frame(
        self, observation: Observation, next_deadline: float | None
    ) -> tuple[ActionChunk, list[TextDelta]]:
        raise NotImplementedError

    def pools(self) -> list[KVPool]:
        raise NotImplementedError

    @property
    def queued_requests(self) -> int:
        return len(self._queue)

    @property
    def active_requests(self) -> int:
        raise NotImplementedError

    def memory(self) -> dict[str, int]:
        """KV accounting summed over this engine's pools (bytes)."""
        pools = self.pools()
        return {
            "bytes_in_use": sum(p.bytes_in_use for p in pools),
            "peak_bytes": sum(p.peak_bytes for p in pools),
            "free_bytes": sum(p.free_bytes for p in pools),
            "capacity_bytes": sum(p.capacity_bytes for p in pools),
            "live_segments": sum(p.live_segments for p in pools),
        }

    def close(self) -> list[TextDelta]:
        """Finish everything and release all KV (idempotent). Returns the final deltas not yet
        delivered: refusals from `submit` and a ``cancelled`` one for each unfinished request."""
        deltas, self._outbox = self._outbox, []
        deltas += [request.finish("cancelled") for request in self._queue]
        self._queue.clear()
        return deltas


def _warm_up_kind(config: EngineConfig) -> str:
    """The kind warm-up requests use: narration when there is one (the usual load)."""
    kinds = config.kinds
    return "narration" if "narration" in kinds else next(iter(kinds))


def _continuity(policy: Pi05Policy, config: EngineConfig) -> ChunkContinuity | None:
    if config.chunk_continuity != "rtc":
        return None
    return ChunkContinuity(
        policy,
        config.action_dt,
        config.rtc_execution_horizon,
        config.rtc_max_guidance_weight,
        config.rtc_schedule,
        config.rtc_guidance,
        config.rtc_training_max_delay,
    )


class OxygenEngine(EngineBase):
    """Unified KV cache: shared prefill per frame + cross-frame continuous batching."""

    name = "oxygen"

    def __init__(
        self,
        policy: Pi05Policy,
        config: EngineConfig | None = None,
        clock: Clock = time.perf_counter,
        faults: FaultInjector = NO_FAULTS,
    ) -> None:
        super().__init__(policy, config, clock, faults)
        self.pool = make_pool(policy, self.config)
        self.runner = self._make_runner(
            self.pool, acts=True, text_batch=self.config.max_active_requests
        )
        self.decoder = LanguageDecoder(policy, self.pool, self.runner, faults, self.faults_by_stage)
        # decode steps: (batch, longest context)
        self.timer = StepTimer(context_step=self.config.context_bucket)
        # admission prefills: (requests, their new tokens)
        self.admission_timer = StepTimer(context_step=16)
        # fixed-mode steps left out because they did not fit before ``until``
        self.fixed_steps_skipped = 0
        self._frame: FramePrefix | None = None  # newest frame; the engine holds one reference
        self._active: list[LanguageRequest] = []
        self._prefix_blocks = self.pool.blocks_for(max_prefix_tokens(policy))
        self.continuity = _continuity(policy, self.config)
        fmt = self.config.format
        if not policy.robot.discrete_state_input:
            fmt.template(self.config.hierarchy, has_state=False)  # raises when it needs state bins
        self.subtasks = (
            SubtaskLoop(fmt, self.config.subtask_period_s) if self.config.hierarchy else None
        )
        self._last_prompt: tuple[np.ndarray, str] = (np.zeros(0), "")  # the newest frame's
        if self.pool.num_blocks < 2 * self._prefix_blocks:
            raise ValueError(
                f"KV capacity {self.pool.num_blocks * self.pool.block_size} tokens cannot hold two "
                "frame prefixes "
                f"of up to {max_prefix_tokens(policy)} tokens; raise kv_capacity_tokens"
            )

    def pools(self) -> list[KVPool]:
        return [self.pool]

    def _calibrate(self, observation: Observation, repeats: int = 3) -> None:
        """Time admissions and decode steps at batch 1, 2, 4, … max_active_requests on a throwaway
        frame: deadline mode then knows from the first tick how large a batch fits in the slack
        (without this, a size not yet seen is estimated from the next larger one)."""
        cfg = self.config
        # steps a request of the usual length takes
        repeats = min(repeats, cfg.default_max_tokens - 1)
        if repeats < 1:
            return
        sizes = sorted(
            {
                min(1 << i, cfg.max_active_requests)
                for i in range(cfg.max_active_requests.bit_length() + 1)
            }
        )
        frame, _ = timed_action(
            self.policy,
            self.pool,
            observation,
            -1,
            cfg.seed,
            cfg.num_steps,
            self.clock,
            self.runner,
        )
        kind = _warm_up_kind(cfg)
        sampling = SamplingParams(max_tokens=cfg.default_max_tokens)
        try:
            for size in sizes:
                requests = [
                    new_request(self.policy, cfg, -1 - i, kind, sampling=sampling)
                    for i in range(size)
                ]
                if (
                    self.pool.blocks_for(requests[0].kv_tokens_needed) * size
                    > self.pool.free_blocks - self._prefix_blocks
                ):
                    break  # the pool cannot hold this many requests beside a frame prefix
                try:
                    for request in requests:  # one by one: admission buckets exist for small bursts
                        start = self.clock()
                        self.decoder.attach([request], frame)
                        self.admission_timer.record(1, self.clock() - start, len(request.prompt))
                    for _ in range(repeats):
                        if any(r.state is not RequestState.ACTIVE for r in requests):
                            break  # one sampled EOS: this size is measured at its next use instead
                        context = self._context(requests)
                        start = self.clock()
                        self.decoder.step(requests)
                        self.timer.record(size, self.clock() - start, context)
                finally:
                    for request in requests:
                        self.decoder.release(request)
        finally:
            self.pool.release(frame.segment)

    def _end_warm_up_requests(self) -> None:
        self.close()  # cancels what is still queued or active and lets the last frame go
        if self.subtasks:
            self.subtasks.reset()
        self.fixed_steps_skipped = 0
        if self.continuity:
            self.continuity.reset()  # the first real chunk is not guided by a warm-up chunk
            self.continuity.non_finite_chunks = self.continuity.trained_fallbacks = 0

    def _language_step_ms(self) -> float:
        return 1e3 * self.timer.estimate(1)

    @property
    def active_requests(self) -> int:
        return len(self._active)

    # -- the action path -------------------------------------------------------------------------
    def act(self, observation: Observation) -> ActionChunk:
        """Shared prefill + action chunk for a new frame. Language never runs inside this call.

        On an exception (any stage) every block this frame took is back in the pool, the fault is
        counted in ``faults_by_stage`` and the original exception propagates; the previous frame
        is let go either way (requests still reading it keep it alive), so a retry starts clean.
        """
        if self._frame is not None:
            self.pool.release(self._frame.segment)  # stays alive while requests still read it
            self._frame = None
        cfg = self.config
        guidance = self.continuity.guidance(observation) if self.continuity else None
        started = self.clock()
        try:
            try:
                prompt = self._frame_prompt(observation)
            except Exception as error:
                tag_stage(error, "prefill")  # the prompt is the prefill's input (a bad state)
                raise
            self._frame, chunk = timed_action(
                self.policy,
                self.pool,
                observation,
                self._new_frame_id(),
                cfg.seed,
                cfg.num_steps,
                self.clock,
                self.runner,
                self.faults,
                guidance,
                prompt,
            )
        except Exception as error:
            self._count_fault(stage_of(error, "action"))
            raise
        if self.continuity:
            self.continuity.record(observation, chunk)
        if self.subtasks:
            self.subtasks.chunk_made(chunk, started)
        return chunk

    def restart_subtask(self) -> None:
        """Decode a new subtask from the next frame on, dropping the current one (no-op without
        the subtask loop)."""
        if self.subtasks:
            self.subtasks.restart()

    def _frame_prompt(self, observation: Observation):
        """The frame's prompt in the engine's format; in the subtask loop, carrying the newest
        subtask that finished before this frame (a changed task first restarts the loop)."""
        cfg = self.config
        if self.subtasks is None:
            return self.policy.frame_prompt(observation.state, observation.prompt, cfg.format)
        self._last_prompt = (observation.state, observation.prompt)
        for request in self.subtasks.observe_task(observation.prompt):
            delta = self.cancel(request.request_id)
            if delta is not None:
                delta.detail = "the task changed"
                self._outbox.append(delta)
        return self.policy.frame_prompt(
            observation.state, observation.prompt, cfg.format, True, self.subtasks.conditioning()
        )

    def set_action_dt(self, action_dt: float) -> None:
        """The controller's step changed (the node's runtime ``action_dt``): RTC's delay in steps
        and the previous chunk's resampling follow it from the next frame."""
        if self.continuity:
            self.continuity.set_action_dt(action_dt)

    def chunk_published(self, frame_id: int, actions: np.ndarray | None, delay_s: float) -> None:
        """The caller's report on the newest chunk: what it published (robot units after its
        safety limits; None: not published) and the delay from the observation's stamp to the
        publication. RTC then follows the published chunk and that delay
        (`ChunkContinuity.published`); without continuity this does nothing."""
        if self.continuity:
            self.continuity.published(frame_id, actions, delay_s)

    # -- the language path -----------------------------------------------------------------------
    def decode(self, until: float | None = None, max_steps: int | None = None) -> list[TextDelta]:
        """Admit queued requests onto the newest prefix, then run batched decode steps.

        Deadline mode: each step takes the largest batch of active requests, oldest first, whose
        estimated step latency (by batch size and context) fits before ``until`` (clock seconds);
        when all of them do not fit, the oldest ones still progress. Fixed mode (or no ``until``):
        ``max_steps`` or k steps over every active request; with ``until`` a step that does not fit
        before it is skipped (counted in ``fixed_steps_skipped``). Admission also waits for slack
        when ``until`` is given.

        Never raises for a fault in language work, wherever it is raised: each admission, each
        decode step and the scheduling around them runs inside `_serve`, so the requests of a
        stage that raised end with one ``failed`` final delta each, the deltas made before it in
        this call are returned, their KV goes back and the fault is counted under the stage
        (``admission``, ``decode_step``, or ``scheduler`` for the batch choice and stall checks).
        The other requests go on in later steps, and the action path (`act`) is not touched.
        """
        # in the subtask loop a due subtask request goes first in line (queued like any other)
        self._serve("scheduler", list, self._outbox, self._submit_subtask)
        out, self._outbox = self._outbox, []
        queued = list(self._queue)

        def taken() -> list[LanguageRequest]:  # the requests the admission took off the queue
            return [r for r in queued if r not in self._queue]

        self._serve("admission", taken, out, lambda: self._admit(until, out))
        self._serve("admission", taken, out, lambda: self._refuse_waited(out))
        self._serve(
            "scheduler", lambda: list(self._active), out, lambda: self._steps(until, max_steps, out)
        )
        if self.subtasks:
            self._serve("scheduler", list, out, lambda: self._subtask_finished(out))
        return out

    def _subtask_finished(self, out: list[TextDelta]) -> None:
        """A subtask that finished in ``out`` becomes the current one (and may ask for a memory
        note: PI052 writes one when the subtask changes)."""
        memory = self.subtasks.finished(out, self.clock())
        if memory is not None:
            self.subtasks.memory_submitted(self._enqueue("memory", **memory))

    def _steps(self, until: float | None, max_steps: int | None, out: list[TextDelta]) -> None:
        """`decode`'s batched steps, then the stall check; deltas go to ``out``."""
        deadline = until is not None and self.config.decode_mode == "deadline"
        if max_steps is None:
            max_steps = self.config.decode_steps_per_frame if not deadline else 1 << 30
        progressed: set[int] = set()
        steps = 0
        last = self.clock()
        while self._active and steps < max_steps:
            if deadline:
                batch = self._active[: self._batch_that_fits(until, last)]
            else:
                batch = list(self._active)
                if until is not None and not self._fits(
                    until, self.timer.estimate(len(batch), self._context(batch)), last
                ):
                    self.fixed_steps_skipped += max_steps - steps
                    break
            if not batch:
                break
            context = self._context(batch)
            faults_before = sum(self.faults_by_stage.values())
            self._serve(
                "decode_step",
                lambda b=batch: b,
                out,
                lambda b=batch: self._step(b, out, progressed),
            )
            steps += 1
            now = self.clock()  # an iteration, bookkeeping included, is what must fit next time
            # a failed step's time says nothing
            if sum(self.faults_by_stage.values()) == faults_before:
                self.timer.record(len(batch), now - last, context)
            last = now
        self._finish_stalled(progressed, out)

    def _step(
        self, batch: list[LanguageRequest], out: list[TextDelta], progressed: set[int]
    ) -> None:
        """One batched decode step over ``batch`` and its bookkeeping; deltas go to ``out``."""
        step_deltas = self.decoder.step(batch)
        out += step_deltas
        progressed.update(request.request_id for request in batch)
        self.decode_steps += 1
        self.tokens_generated += sum(d.finish_reason != "failed" for d in step_deltas)
        self._retire_finished()

    def _submit_subtask(self) -> None:
        """In the subtask loop, queue a subtask request (first in line) when one is due: greedy,
        to eos or the format's limit, reading the newest frame."""
        loop = self.subtasks
        if loop is None or self._frame is None or not loop.due(self.clock()):
            return
        cfg = self.config
        state, task = self._last_prompt
        empty = self.policy.frame_prompt(state, task, cfg.format, True)  # its room in max_token_len
        limit = subtask_token_limit(self.policy, cfg, len(empty.ids))
        sampling = SamplingParams(max_tokens=limit, temperature=0.0, seed=cfg.seed)
        request = self._enqueue("subtask", sampling=sampling, front=True, task=loop.task or "")
        loop.submitted(request, self.clock())

    @staticmethod
    def _context(requests: list[LanguageRequest]) -> int:
        """Tokens the longest row of a decode step over ``requests`` reads (prefix + its own)."""
        return max(r.read_len + r.own.length for r in requests)

    def _batch_that_fits(self, until: float, now: float) -> int:
        """How many of the active requests (oldest first) one step can take before ``until``."""
        contexts = list(
            itertools.accumulate((r.read_len + r.own.length for r in self._active), max)
        )
        size = len(self._active)
        while size > 0 and not self._fits(
            until, self.timer.estimate(size, contexts[size - 1]), now
        ):
            size -= 1
        return size

    def _finish_stalled(self, progressed: set[int], out: list[TextDelta]) -> None:
        """Under sustained overload deadline mode never finds slack: rather than hold KV forever
        (or delay the action path), requests that made no progress for too long are finished."""
        for request in self._active:
            request.stalled_frames = (
                0 if request.request_id in progressed else request.stalled_frames + 1
            )
            if request.stalled_frames > self.config.max_stall_frames:
                delta = request.finish("stalled")
                delta.detail = (
                    f"no decode slack for {request.stalled_frames} frames (every tick overran)"
                )
                out.append(delta)
        self._retire_finished()

    def _fits(self, until: float, seconds: float, now: float | None = None) -> bool:
        """Would work estimated at ``seconds`` end before ``until`` (minus the margin)?"""
        now = self.clock() if now is None else now
        return now + seconds + self.config.deadline_margin_ms * 1e-3 <= until

    def _admit(self, until: float | None, out: list[TextDelta]) -> None:
        """Attach the queued requests that fit (memory, concurrency, slack before ``until``) to the
        newest frame, oldest first; refusals and first tokens go to ``out``."""
        if self._frame is None:
            return
        admitted: list[LanguageRequest] = []
        new_tokens = 0  # kind-prompt tokens the admission prefill feeds
        # keep: its prefix + the next frame's
        language_blocks = self.pool.num_blocks - 2 * self._prefix_blocks
        for request in list(self._queue):
            need = self.pool.blocks_for(request.kv_tokens_needed)
            if need > language_blocks:
                self._queue.remove(request)
                allows = language_blocks * self.pool.block_size
                why = f"needs {request.kv_tokens_needed} KV tokens; the pool allows {allows}"
                out.append(self._refuse(request, why))
                continue
            room = (
                self.pool.free_blocks
                - need
                - sum(self.pool.blocks_for(r.kv_tokens_needed) for r in admitted)
            )
            if (
                len(self._active) + len(admitted) >= self.config.max_active_requests
                or room < self._prefix_blocks
            ):
                # wait: concurrency or memory limit (the next frame's prefix is always kept free)
                break
            if until is not None and not self._fits(
                until,
                self.admission_timer.estimate(len(admitted) + 1, new_tokens + len(request.prompt)),
            ):
                break
            self._queue.remove(request)
            admitted.append(request)
            new_tokens += len(request.prompt)
        if not admitted:
            return
        faults_before = sum(self.faults_by_stage.values())
        start = self.clock()
        attached = self.decoder.attach(admitted, self._frame)
        if sum(self.faults_by_stage.values()) == faults_before:
            self.admission_timer.record(len(admitted), self.clock() - start, new_tokens)
        out += attached
        self.decode_steps += 1
        self.tokens_generated += sum(d.finish_reason != "failed" for d in attached)
        self._active += admitted
        self._retire_finished()

    def _refuse_waited(self, out: list[TextDelta]) -> None:
        """A frame passed for every request still queued; refuse those that waited too long (their
        finals go to ``out``). Runs even when the admission before it failed, so a queue that can
        never be admitted still drains within ``max_wait_frames``."""
        if self._frame is None:
            return
        for request in self._queue:
            request.waited_frames += 1
        for request in [r for r in self._queue if r.waited_frames > self.config.max_wait_frames]:
            self._queue.remove(request)
            out.append(
                self._refuse(
                    request, f"waited {request.waited_frames} frames for KV memory or a decode slot"
                )
            )

    def _forget(self, requests: Sequence[LanguageRequest]) -> None:
        super()._forget(requests)
        self._active = [r for r in self._active if all(r is not f for f in requests)]

    def _retire_finished(self) -> None:
        still = []
        for request in self._active:
            if request.state is RequestState.FINISHED:
                self.decoder.release(request)
            else:
                still.append(request)
        self._active = still

    def cancel(self, request_id: int) -> TextDelta | None:
        """Stop a queued or active request now; returns its final delta (None if unknown)."""
        for request in list(self._queue) + self._active:
            if request.request_id == request_id:
                if request in self._queue:
                    self._queue.remove(request)
                delta = request.finish("cancelled")
                self._retire_finished()
                return delta
        return None

    # -- one frame ---------------------------------------------------------------------------------
    def _run_frame(
        self, observation: Observation, next_deadline: float | None
    ) -> tuple[ActionChunk, list[TextDelta]]:
        chunk = self.act(observation)
        return chunk, self.decode(next_deadline)

    def check_memory(self) -> None:
        """`KVPool.check` against the references this engine knows of: one to its newest frame's
        prefix, and for each active request one to its frame's prefix and one to its own segment;
        queued requests hold none. Raises KVInvariantError naming the offending segments or
        requests.
        """
        refs: dict[int, int] = collections.Counter()
        if self._frame is not None:
            refs[self._frame.segment.segment_id] += 1
        wrong = [r.request_id for r in self._queue if r.prefix is not None or r.own is not None]
        for r in self._active:
            if r.prefix is None or r.own is None:
                wrong.append(r.request_id)
                continue
            refs[r.prefix.segment_id] += 1
            refs[r.own.segment_id] += 1
        if wrong:
            raise KVInvariantError(
                f"requests {wrong}: queued ones holding KV or active ones without their KV"
            )
        self.pool.check(refs)

    def close(self) -> list[TextDelta]:
        deltas, self._outbox = self._outbox, []
        deltas += [request.finish("cancelled") for request in list(self._queue) + self._active]
        self._queue.clear()
        self._retire_finished()
        if self._frame is not None:
            self.pool.release(self._frame.segment)
            self._frame = None
        return deltas
