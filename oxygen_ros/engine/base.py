"""What every engine shares (`EngineBase`): request intake and refusal, ids, warm-up (buckets,
timings, first frames), memory accounting and the language boundary (`EngineBase._serve`), and the
pieces an engine is built of, made from its settings: the KV pool (`make_pool`), the static-shape
runner (`make_runner`) and language requests in the prompt format (`new_request`).

OxyGen (``scheduler.py``) and the paper's baselines (``baselines.py``) derive from it, so all of
them are driven through the same ``submit`` / ``step`` interface.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from ..policy_io.policy import Pi05Policy
from ..policy_io.prompts import subtask_max_tokens
from .faults import NO_FAULTS, FaultInjector, describe, stage_of
from .frames import max_prefix_tokens
from .kv_cache import KVPool
from .language import LanguageDecoder
from .requests import LanguageRequest, SamplingParams
from .settings import EngineConfig
from .static_paths import PLAIN, ChunkKind, StaticRunner
from .types import ActionChunk, Clock, FrameResult, FrameStats, Observation, TextDelta, WarmUpReport

WARM_UP_FRAMES = 5  # first-call frames `EngineBase.warm_up` runs after the buckets and timings


def subtask_token_limit(policy: Pi05Policy, config: EngineConfig, prompt_tokens: int) -> int:
    """A subtask's token limit: ``subtask_max_tokens`` (0: the format's, else 64), and no more than
    the conditioned prompt (``prompt_tokens`` without a subtask, measured with the longest state
    text: `Pi05Policy.longest_prompt`) leaves of ``max_token_len``, so that every next frame's
    prompt carries all of it, whatever its state. Configure refuses a task that leaves less than
    a useful subtask (`prompts.MIN_SUBTASK_TOKENS`); the floor of 1 guards a task set without that
    check."""
    limit = subtask_max_tokens(config.format, config.subtask_max_tokens)
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


def make_pool(policy: Pi05Policy, config: EngineConfig, engines: int = 1) -> KVPool:
    """The KV pool of ``engines`` engines with ``config`` (several robots may share one pool):
    ``kv_capacity_tokens``, or room for each engine's frame prefixes and active requests."""
    cfg = policy.config.backbone
    capacity = config.kv_capacity_tokens or engines * (
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
        kind = warm_up_kind(cfg)
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
            self.policy, self.config, self._new_request_id(), kind, text, sampling, **fields
        )
        if len(self._queue) >= self.config.max_queued_requests:
            self._outbox.append(
                self._refuse(request, f"queue full ({self.config.max_queued_requests} waiting)")
            )
        elif front:
            self._queue.appendleft(request)
        else:
            self._queue.append(request)
        return request

    def _new_request_id(self) -> int:
        request_id = self._next_request_id
        self._next_request_id += 1
        return request_id

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


def warm_up_kind(config: EngineConfig) -> str:
    """The kind warm-up requests use: narration when there is one (the usual load)."""
    kinds = config.kinds
    return "narration" if "narration" in kinds else next(iter(kinds))
