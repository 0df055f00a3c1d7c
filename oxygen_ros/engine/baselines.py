"""The paper's comparison points, behind the same ``submit`` / ``step`` interface as OxyGen.

* isolated-sequential: every task prefills the frame itself (the action, then each language request
  again, into separate KV) and language is decoded to completion before the next frame.
* shared-KV: one prefill feeds the action and the language requests (cross-task sharing only);
  each request is still decoded to completion, one at a time, inside the frame.
* naive-parallel: an action worker and a language worker, each with its own prefill and its own KV
  memory, running concurrently (two threads here, as two processes would on a robot).

All three reuse OxyGen's model calls, KV pool and request state, so the comparison isolates the
scheduling and sharing policy, not implementation quality.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence

import torch

from ..policy_io.policy import Pi05Policy
from .base import EngineBase, make_pool
from .frames import FramePrefix, prefill_frame, timed_action
from .kv_cache import KVPool
from .language import LanguageDecoder
from .requests import LanguageRequest
from .settings import EngineConfig
from .types import ActionChunk, Clock, Observation, TextDelta


class _SequentialEngine(EngineBase):
    """Common loop of the two sequential baselines: act, then finish every queued request."""

    share_prefix = False

    def __init__(
        self,
        policy: Pi05Policy,
        config: EngineConfig | None = None,
        clock: Clock = time.perf_counter,
    ) -> None:
        super().__init__(policy, config, clock)
        self.pool = make_pool(policy, self.config)
        self.runner = self._make_runner(self.pool, acts=True, text_batch=1)
        self.decoder = LanguageDecoder(
            policy, self.pool, self.runner, self.faults, self.faults_by_stage
        )

    def pools(self) -> list[KVPool]:
        return [self.pool]

    @property
    def active_requests(self) -> int:
        return 0  # nothing outlives its frame

    def check_memory(self) -> None:
        """Between frames these engines hold no KV at all: the pool must be empty."""
        self.pool.check({})

    def _run_frame(
        self, observation: Observation, next_deadline: float | None
    ) -> tuple[ActionChunk, list[TextDelta]]:
        frame_id = self._new_frame_id()
        cfg = self.config
        frame, chunk = timed_action(
            self.policy,
            self.pool,
            observation,
            frame_id,
            cfg.seed,
            cfg.num_steps,
            self.clock,
            self.runner,
        )
        deltas, self._outbox = self._outbox, []
        try:
            while self._queue:
                request = self._queue.popleft()
                self._serve(
                    "decode_step",
                    lambda r=request: [r],
                    deltas,
                    lambda r=request: self._complete(r, frame, observation, deltas),
                )
        finally:
            self.pool.release(frame.segment)
        return chunk, deltas

    def _complete(
        self,
        request: LanguageRequest,
        frame: FramePrefix,
        observation: Observation,
        out: list[TextDelta],
    ) -> None:
        """Decode ``request`` to completion over ``frame``'s prefix (isolated: over a prefill of
        its own, let go afterwards whatever happens); deltas go to ``out``."""
        if self.share_prefix:
            source = frame
        else:  # isolated: the language task encodes the same observation again, into its own KV
            source = prefill_frame(self.policy, self.pool, observation, frame.frame_id, self.runner)
        try:
            steps = self.decoder.run_to_completion(request, source, out)
        finally:
            if source is not frame:
                # the isolated copy: the request released its reference
                self.pool.release(source.segment)
        self.decode_steps += steps
        self.tokens_generated += steps


class IsolatedSequentialEngine(_SequentialEngine):
    name = "isolated-sequential"
    share_prefix = False


class SharedKVEngine(_SequentialEngine):
    name = "shared-kv"
    share_prefix = True


class NaiveParallelEngine(EngineBase):
    """Action and language in two workers with separate prefills and separate KV memory.

    ``step`` runs the action in the calling thread while a language worker thread, fed one job per
    frame (the observation plus the requests queued so far), prefills its own copy of that frame and
    decodes the requests to completion, one at a time. Deltas the worker produced are returned by
    the next ``step``. The two compete for the same cores, as two processes would for one GPU.
    """

    name = "naive-parallel"

    def __init__(
        self,
        policy: Pi05Policy,
        config: EngineConfig | None = None,
        clock: Clock = time.perf_counter,
    ) -> None:
        super().__init__(policy, config, clock)
        self.action_pool = make_pool(policy, self.config)
        self.language_pool = make_pool(policy, self.config)
        # one runner per worker and pool: their graphs never share memory, whatever the interleaving
        self.action_runner = self._make_runner(self.action_pool, acts=True, text_batch=0)
        self.language_runner = self._make_runner(self.language_pool, acts=False, text_batch=1)
        self.decoder = LanguageDecoder(
            policy, self.language_pool, self.language_runner, self.faults, self.faults_by_stage
        )
        self._jobs: queue.Queue[tuple[Observation, int, list[LanguageRequest]] | None] = (
            queue.Queue()
        )
        self._done: list[TextDelta] = []
        self._lock = threading.Lock()
        self._busy = 0
        self._threads = torch.get_num_threads()
        self._worker = threading.Thread(
            target=self._language_worker, name="language-worker", daemon=True
        )
        self._worker.start()

    def pools(self) -> list[KVPool]:
        return [self.action_pool, self.language_pool]

    @property
    def active_requests(self) -> int:
        with self._lock:
            return self._busy

    def _run_frame(
        self, observation: Observation, next_deadline: float | None
    ) -> tuple[ActionChunk, list[TextDelta]]:
        frame_id = self._new_frame_id()
        requests = list(self._queue)
        self._queue.clear()
        if requests:
            with self._lock:
                self._busy += len(requests)
            self._jobs.put((observation, frame_id, requests))
        cfg = self.config
        frame, chunk = timed_action(
            self.policy,
            self.action_pool,
            observation,
            frame_id,
            cfg.seed,
            cfg.num_steps,
            self.clock,
            self.action_runner,
        )
        self.action_pool.release(frame.segment)
        with self._lock:
            deltas, self._done = self._done, []
        outbox, self._outbox = self._outbox, []
        return chunk, outbox + deltas

    def _language_worker(self) -> None:
        torch.set_num_threads(self._threads)  # per-thread setting in torch
        while True:
            job = self._jobs.get()
            if job is None:
                return
            self._language_job(*job)

    def _language_job(
        self, observation: Observation, frame_id: int, requests: list[LanguageRequest]
    ) -> None:
        """The worker's prefill of one frame, then its requests decoded to completion one by one
        (each one's deltas delivered when it is done)."""
        frames: list[FramePrefix] = []
        out: list[TextDelta] = []

        def prefill() -> None:
            frames.append(
                prefill_frame(
                    self.policy, self.language_pool, observation, frame_id, self.language_runner
                )
            )

        # the worker's own prefill is a language stage: when it fails, so do the job's requests
        if not self._serve("prefill", lambda: requests, out, prefill):
            self._deliver(out, len(requests))
            return
        for request in requests:
            out = []
            self._serve(
                "decode_step",
                lambda r=request: [r],
                out,
                lambda r=request, o=out: self._complete(r, frames[0], o),
            )
            self._deliver(out, 1)
        self.language_pool.release(frames[0].segment)

    def _forget(self, requests: Sequence[LanguageRequest]) -> None:
        """Nothing to drop: the worker's requests left the queue when the job was handed over (and
        the queue belongs to the calling thread, which may be changing it right now)."""

    def _deliver(self, deltas: list[TextDelta], finished: int) -> None:
        """Hand the worker's deltas to the next `step`; ``finished`` requests are done."""
        with self._lock:
            self._done += deltas
            self._busy -= finished

    def _complete(self, request: LanguageRequest, frame: FramePrefix, out: list[TextDelta]) -> None:
        """Decode ``request`` to completion over the worker's prefill; deltas go to ``out``."""
        steps = self.decoder.run_to_completion(request, frame, out)
        with self._lock:
            self.decode_steps += steps
            self.tokens_generated += steps

    def drain(self, timeout: float = 60.0) -> list[TextDelta]:
        """Wait until the language worker has finished every job handed to it; return its deltas."""
        deadline = time.monotonic() + timeout
        while self.active_requests and time.monotonic() < deadline:
            time.sleep(0.005)
        with self._lock:
            deltas, self._done = self._done, []
        return deltas

    def _end_warm_up_requests(self) -> None:
        self.drain()

    def close(self) -> list[TextDelta]:
        if self._worker.is_alive():
            self._jobs.put(None)
            self._worker.join(timeout=30)
        with self._lock:
            done, self._done = self._done, []
        return done + super().close()
