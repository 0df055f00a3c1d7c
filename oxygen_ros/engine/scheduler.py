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

Several robots on one model (``oxygen-serve``): one engine per robot over the same policy, their
frames prefilled and denoised as one batch (`act_together`), and, with their frames and requests
in one pool (`PoolShare`), their language requests decoded in the same batched steps
(`decode_together`; `OxygenEngine.decode` is its one-engine case).

``base.EngineBase`` holds what every engine shares (request intake, memory accounting, the frame
counter); the paper's baselines in ``baselines.py`` derive from it too, so all of them are driven
through the same ``submit`` / ``step`` interface. The settings are ``settings.EngineConfig``.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Sequence

import numpy as np

from ..policy_io.policy import Pi05Policy
from .base import (
    EngineBase,
    make_pool,
    new_request,
    subtask_token_limit,
    warm_up_kind,
)
from .continuity import build_continuity
from .faults import NO_FAULTS, FaultInjector, stage_of, tag_stage
from .frames import FrameJob, FramePrefix, max_prefix_tokens, timed_action, timed_actions
from .kv_cache import KVInvariantError, KVPool
from .language import LanguageDecoder
from .metrics import StepTimer
from .requests import LanguageRequest, RequestState, SamplingParams
from .settings import EngineConfig
from .subtasks import SubtaskLoop
from .types import ActionChunk, Clock, Observation, TextDelta


class PoolShare:
    """One KV pool for several engines over one policy (several robots): their frames and
    language requests live in it, their request ids are unique across them, and
    `decode_together` advances all their requests in one batched step. Sized for ``engines``
    engines with ``config`` (`base.make_pool`); the engines join it when they are made with
    ``share=`` and leave it when closed."""

    def __init__(self, policy: Pi05Policy, config: EngineConfig, engines: int) -> None:
        self.pool = make_pool(policy, config, engines)
        self.engines: list[OxygenEngine] = []
        self._request_ids = itertools.count(1)

    def new_request_id(self) -> int:
        return next(self._request_ids)

    def close_engine(self, engine: OxygenEngine) -> list[TextDelta]:
        """Close ``engine`` (`OxygenEngine.close`) and let it leave the pool's engines."""
        deltas = engine.close()
        if engine in self.engines:
            self.engines.remove(engine)
        return deltas


class OxygenEngine(EngineBase):
    """Unified KV cache: shared prefill per frame + cross-frame continuous batching.

    share: a `PoolShare` whose pool this engine's frames and requests live in, beside other
    robots' engines (None: a pool of its own).
    """

    name = "oxygen"

    def __init__(
        self,
        policy: Pi05Policy,
        config: EngineConfig | None = None,
        clock: Clock = time.perf_counter,
        faults: FaultInjector = NO_FAULTS,
        share: PoolShare | None = None,
    ) -> None:
        super().__init__(policy, config, clock, faults)
        self.share = share
        self.pool = make_pool(policy, self.config) if share is None else share.pool
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
        self.continuity = build_continuity(policy, self.config)
        fmt = self.config.format
        if not policy.robot.discrete_state_input:
            fmt.template(self.config.hierarchy, has_state=False)  # raises when it needs state bins
        self.subtasks = (
            SubtaskLoop(
                fmt,
                self.config.subtask_period_s,
                self.config.subtask_confirmations,
                self.config.subtask_held_gate,
                self.config.subtask_phase_order,
            )
            if self.config.hierarchy
            else None
        )
        self._last_prompt: tuple[np.ndarray, str] = (np.zeros(0), "")  # the newest frame's
        if self.pool.num_blocks < 2 * self._prefix_blocks:
            raise ValueError(
                f"KV capacity {self.pool.num_blocks * self.pool.block_size} tokens cannot hold two "
                "frame prefixes "
                f"of up to {max_prefix_tokens(policy)} tokens; raise kv_capacity_tokens"
            )
        if share is not None:
            share.engines.append(self)

    def _new_request_id(self) -> int:
        return super()._new_request_id() if self.share is None else self.share.new_request_id()

    def _sharers(self) -> int:
        """Engines whose frames live in this engine's pool (each keeps room for its next one)."""
        return 1 if self.share is None else len(self.share.engines)

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
        kind = warm_up_kind(cfg)
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
        self._let_go_of_frame()
        started = self.clock()
        try:
            job = self._frame_job(observation)
            frame, chunk = timed_action(
                self.policy,
                self.pool,
                observation,
                job.frame_id,
                job.seed,
                self.config.num_steps,
                self.clock,
                self.runner,
                self.faults,
                job.guidance,
                job.prompt,
            )
        except Exception as error:
            self._count_fault(stage_of(error, "action"))
            raise
        self._frame_made(observation, frame, chunk, started)
        return chunk

    def _let_go_of_frame(self) -> None:
        """Release the engine's reference to the newest frame (requests reading it keep it)."""
        if self._frame is not None:
            self.pool.release(self._frame.segment)
            self._frame = None

    def _frame_job(self, observation: Observation) -> FrameJob:
        """A new frame's id, prompt (the subtask loop's, see `_frame_prompt`) and continuity
        guidance. Raises what the prompt raises (a bad state), tagged as the prefill's."""
        guidance = self.continuity.guidance(observation) if self.continuity else None
        try:
            prompt = self._frame_prompt(observation)
        except Exception as error:
            tag_stage(error, "prefill")  # the prompt is the prefill's input (a bad state)
            raise
        return FrameJob(
            self.pool, observation, self._new_frame_id(), prompt, self.config.seed, guidance
        )

    def _frame_made(
        self, observation: Observation, frame: FramePrefix, chunk: ActionChunk, started: float
    ) -> None:
        """Keep the new frame (one reference) and tell continuity and the subtask loop."""
        self._frame = frame
        if self.continuity:
            self.continuity.record(observation, chunk)
        if self.subtasks:
            self.subtasks.chunk_made(chunk, started)

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
        self.subtasks.observe_state(observation.state)
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
        return decode_together([self], until, max_steps)[0]

    def _admit_queued(self, until: float | None) -> list[TextDelta]:
        """`decode`'s first part: queue a due subtask request, admit queued requests onto the
        newest frame and refuse those that waited too long; returns the deltas made so far."""
        # in the subtask loop a due subtask request goes first in line (queued like any other)
        self._serve("scheduler", list, self._outbox, self._submit_subtask)
        out, self._outbox = self._outbox, []
        queued = list(self._queue)

        def taken() -> list[LanguageRequest]:  # the requests the admission took off the queue
            return [r for r in queued if r not in self._queue]

        self._serve("admission", taken, out, lambda: self._admit(until, out))
        self._serve("admission", taken, out, lambda: self._refuse_waited(out))
        return out

    def _subtask_finished(self, out: list[TextDelta]) -> None:
        """A subtask that finished in ``out`` becomes the current one (and may ask for a memory
        note: PI052 writes one when the subtask changes)."""
        memory = self.subtasks.finished(out, self.clock())
        if memory is not None:
            self.subtasks.memory_submitted(self._enqueue("memory", **memory))

    def _submit_subtask(self) -> None:
        """In the subtask loop, queue a subtask request (first in line) when one is due: greedy,
        to eos or the format's limit, reading the newest frame."""
        loop = self.subtasks
        if loop is None or self._frame is None or not loop.due(self.clock()):
            return
        cfg = self.config
        state, task = self._last_prompt
        # the room any frame's conditioned prompt leaves it, whatever that frame's state
        longest = self.policy.longest_prompt(task, len(state), cfg.format, True)
        limit = subtask_token_limit(self.policy, cfg, longest)
        sampling = SamplingParams(max_tokens=limit, temperature=0.0, seed=cfg.seed)
        request = self._enqueue("subtask", sampling=sampling, front=True, task=loop.task or "")
        loop.submitted(request, self.clock())

    @staticmethod
    def _context(requests: list[LanguageRequest]) -> int:
        """Tokens the longest row of a decode step over ``requests`` reads (prefix + its own)."""
        return max(r.read_len + r.own.length for r in requests)

    def _batch_that_fits(self, active: list[LanguageRequest], until: float, now: float) -> int:
        """How many of ``active`` (oldest first) one step can take before ``until``."""
        contexts = list(itertools.accumulate((r.read_len + r.own.length for r in active), max))
        size = len(active)
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
        # kept free: the next frame's prefix of every engine in the pool; never language's: also
        # their current prefixes
        kept = self._sharers() * self._prefix_blocks
        language_blocks = self.pool.num_blocks - 2 * kept
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
            if len(self._active) + len(admitted) >= self.config.max_active_requests or room < kept:
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
        wrong: list[int] = []
        for engine in [self] if self.share is None else self.share.engines:
            engine._count_refs(refs, wrong)
        if wrong:
            raise KVInvariantError(
                f"requests {wrong}: queued ones holding KV or active ones without their KV"
            )
        self.pool.check(refs)

    def _count_refs(self, refs: dict[int, int], wrong: list[int]) -> None:
        """Add this engine's references to ``refs`` and its requests that break the rules to
        ``wrong`` (see `check_memory`)."""
        if self._frame is not None:
            refs[self._frame.segment.segment_id] += 1
        wrong += [r.request_id for r in self._queue if r.prefix is not None or r.own is not None]
        for r in self._active:
            if r.prefix is None or r.own is None:
                wrong.append(r.request_id)
                continue
            refs[r.prefix.segment_id] += 1
            refs[r.own.segment_id] += 1

    def close(self) -> list[TextDelta]:
        deltas, self._outbox = self._outbox, []
        deltas += [request.finish("cancelled") for request in list(self._queue) + self._active]
        self._queue.clear()
        self._retire_finished()
        if self._frame is not None:
            self.pool.release(self._frame.segment)
            self._frame = None
        return deltas


def act_together(
    engines: Sequence[OxygenEngine], observations: Sequence[Observation]
) -> list[ActionChunk | Exception]:
    """`OxygenEngine.act` for several engines over one policy (several robots, each with its own
    frames, continuity, subtasks and KV pool), their frames prefilled and denoised as one batch
    (`frames.timed_actions`, eager paths). Returns each engine's chunk, or the exception its
    frame raised: one engine's bad observation never fails the others' frames (a batch that
    raises is rerun frame by frame to find it), and each fault is counted by its own engine.

    Raises:
        ValueError: engines that do not share one policy and one number of denoising steps.
    """
    if len(engines) != len(observations):
        raise ValueError(f"{len(engines)} engines for {len(observations)} observations")
    if not engines:
        return []
    lead = engines[0]
    if any(
        e.policy is not lead.policy or e.config.num_steps != lead.config.num_steps for e in engines
    ):
        raise ValueError("engines acting together must share one policy and num_steps")
    results: list[ActionChunk | Exception | None] = [None] * len(engines)
    ready: list[tuple[int, FrameJob]] = []
    started = lead.clock()
    for index, (engine, observation) in enumerate(zip(engines, observations, strict=True)):
        engine._let_go_of_frame()
        try:
            ready.append((index, engine._frame_job(observation)))
        except Exception as error:
            engine._count_fault(stage_of(error, "action"))
            results[index] = error
    groups = [ready]
    while groups:
        group = groups.pop()
        if not group:
            continue
        try:
            made = timed_actions(
                lead.policy,
                [job for _, job in group],
                lead.config.num_steps,
                lead.clock,
                lead.faults,
            )
        except Exception as error:
            if len(group) > 1:
                groups += [[item] for item in group]  # find the frame at fault
                continue
            index, _ = group[0]
            engines[index]._count_fault(stage_of(error, "action"))
            results[index] = error
            continue
        for (index, job), (frame, chunk) in zip(group, made, strict=True):
            engines[index]._frame_made(job.observation, frame, chunk, started)
            results[index] = chunk
    return results


def decode_together(
    engines: Sequence[OxygenEngine], until: float | None = None, max_steps: int | None = None
) -> list[list[TextDelta]]:
    """`OxygenEngine.decode` for one engine or several engines of one `PoolShare` (several
    robots): each admits its own queue onto its own newest frame, then every active request of
    all of them advances in the same batched decode steps (the oldest of each engine first, taken
    in turn, when not all fit before ``until``); the deadline mode, step timer and decoder are the
    first engine's. Returns each engine's deltas. Never raises for a fault in language work: the
    requests a fault hits fail with their own engine, which counts it.

    Raises:
        ValueError: several engines that do not share one pool.
    """
    if len(engines) > 1:
        share = engines[0].share
        if share is None or any(engine.share is not share for engine in engines):
            raise ValueError("engines decoding together must share one PoolShare")
    outs = [engine._admit_queued(until) for engine in engines]
    _serve_group(
        engines,
        outs,
        "scheduler",
        lambda: _active_of(engines),
        lambda: _steps(engines, outs, until, max_steps),
    )
    for engine, out in zip(engines, outs, strict=True):
        if engine.subtasks:
            engine._serve("scheduler", list, out, lambda e=engine, o=out: e._subtask_finished(o))
    return outs


def _active_of(engines: Sequence[OxygenEngine]) -> list[LanguageRequest]:
    """The active requests of ``engines``: each engine's oldest first, taken in turn."""
    if len(engines) == 1:
        return list(engines[0]._active)
    turns = itertools.zip_longest(*(engine._active for engine in engines))
    return [request for turn in turns for request in turn if request is not None]


def _owners(engines: Sequence[OxygenEngine], requests: Sequence[LanguageRequest]) -> dict[int, int]:
    """Request id -> index of the engine (of ``engines``) whose active request it is."""
    mine = {id(r): i for i, engine in enumerate(engines) for r in engine._active}
    return {r.request_id: mine[id(r)] for r in requests if id(r) in mine}


def _serve_group(
    engines: Sequence[OxygenEngine],
    outs: list[list[TextDelta]],
    stage: str,
    served: Callable[[], Sequence[LanguageRequest]],
    work: Callable[[], object],
    owners: dict[int, int] | None = None,
) -> None:
    """`EngineBase._serve` over several engines: a fault in ``work`` fails each served request
    with its own engine (``owners``: request id -> engine index; default: by the engines' active
    lists at the fault), which counts it once; a fault that hit no request is counted by the
    first engine."""
    if len(engines) == 1:
        engines[0]._serve(stage, served, outs[0], work)
        return
    try:
        work()
    except Exception as error:
        hit = list(served())
        owners = owners if owners is not None else _owners(engines, hit)
        counted = False
        for index, (engine, out) in enumerate(zip(engines, outs, strict=True)):
            mine = [r for r in hit if owners.get(r.request_id) == index]
            if mine:
                engine._fail_served(mine, error, stage, out)
                counted = True
        if not counted:
            engines[0]._count_fault(stage_of(error, stage))


def _steps(
    engines: Sequence[OxygenEngine],
    outs: list[list[TextDelta]],
    until: float | None,
    max_steps: int | None,
) -> None:
    """`decode_together`'s batched steps over every engine's active requests, then each engine's
    stall check; deltas go to their engine's list in ``outs``."""
    lead = engines[0]
    deadline = until is not None and lead.config.decode_mode == "deadline"
    if max_steps is None:
        max_steps = lead.config.decode_steps_per_frame if not deadline else 1 << 30
    progressed: set[int] = set()
    steps = 0
    last = lead.clock()
    while (active := _active_of(engines)) and steps < max_steps:
        if deadline:
            batch = active[: lead._batch_that_fits(active, until, last)]
        else:
            batch = active
            if until is not None and not lead._fits(
                until, lead.timer.estimate(len(batch), lead._context(batch)), last
            ):
                for engine in engines:
                    engine.fixed_steps_skipped += max_steps - steps
                break
        if not batch:
            break
        context = lead._context(batch)
        faults_before = _faults(engines)
        owners = _owners(engines, batch)
        _serve_group(
            engines,
            outs,
            "decode_step",
            lambda b=batch: b,
            lambda b=batch, o=owners: _step(engines, outs, b, o, progressed),
            owners,
        )
        steps += 1
        now = lead.clock()  # an iteration, bookkeeping included, is what must fit next time
        if _faults(engines) == faults_before:  # a failed step's time says nothing
            lead.timer.record(len(batch), now - last, context)
        last = now
    for engine, out in zip(engines, outs, strict=True):
        engine._finish_stalled(progressed, out)


def _faults(engines: Sequence[OxygenEngine]) -> int:
    return sum(sum(engine.faults_by_stage.values()) for engine in engines)


def _step(
    engines: Sequence[OxygenEngine],
    outs: list[list[TextDelta]],
    batch: list[LanguageRequest],
    owners: dict[int, int],
    progressed: set[int],
) -> None:
    """One batched decode step over ``batch`` (the first engine's decoder: one pool) and each
    engine's bookkeeping; each delta goes to its request's engine."""
    step_deltas = engines[0].decoder.step(batch)
    made = collections.Counter()
    for delta in step_deltas:
        index = owners.get(delta.request_id, 0)
        outs[index].append(delta)
        made[index] += delta.finish_reason != "failed"
    progressed.update(request.request_id for request in batch)
    for index in sorted(set(owners.values()) | set(made)):
        engines[index].decode_steps += 1
        engines[index].tokens_generated += made[index]
    for engine in engines:
        engine._retire_finished()
