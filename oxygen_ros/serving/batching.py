"""The model worker: frames from every session batched onto one thread that owns the model.

The event loop queues each session's checked frame (`ModelWorker.infer`) and awaits its reply;
`ModelWorker.run` collects the frames that arrive within ``window_s`` of the first (or until
every open session has one waiting), and hands them to the worker thread as one batch:

1. one batched prefill + denoise for all of them (`scheduler.act_together`), each session's
   frame in its own engine (frames, KV, RTC, subtasks, noise seed);
2. each reply is handed back to the loop the moment the batch's actions exist, so every session
   is answered before any language work runs;
3. then language: each session's new requests (an ``ask``, a due narration) are admitted onto
   its newest frame, and the requests of every open session advance together in batched decode
   steps (`scheduler.decode_together`: one KV pool) until ``language_budget_s`` after the
   actions (a quarter of it when frames already wait).

The loop never runs model code, so it keeps serving ``/healthz``, reads and refusals while a
batch runs. A session's failed frame is answered with its own error; the others' frames in
that batch are not touched (`act_together` isolates it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..engine.counters import Counters
from ..engine.scheduler import act_together, decode_together
from .observations import ClientFrame
from .sessions import Session

T = TypeVar("T")
logger = logging.getLogger(__name__)


class QueueFull(Exception):
    """The server already holds ``max_queued_frames`` frames waiting for the model."""


class InferenceFailed(Exception):
    """The model could not act on this session's frame; the message says why (no traceback)."""


@dataclasses.dataclass
class _Waiting:
    session: Session
    frame: ClientFrame
    future: asyncio.Future
    received: float


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    """window_s: how long the first frame of a batch waits for others; max_batch: frames per
    batch at most; max_queued_frames: frames waiting at most (beyond: refused);
    language_budget_s: language work after each batch's actions; deadline_s: a reply later than
    this after its frame arrived is counted as late (0: no deadline)."""

    window_s: float = 0.005
    max_batch: int = 8
    max_queued_frames: int = 16
    language_budget_s: float = 0.02
    deadline_s: float = 0.0


class ModelWorker:
    """Batches frames across sessions onto one model thread (see the module docstring)."""

    def __init__(
        self,
        settings: BatchSettings,
        counters: Counters,
        open_sessions: Callable[[], list[Session]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.counters = counters
        self._open_sessions = open_sessions
        self.clock = clock
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="oxygen-model")
        self._waiting: list[_Waiting] = []
        self._arrived = asyncio.Event()

    @property
    def frames_waiting(self) -> int:
        """Frames queued for the next batch."""
        return len(self._waiting)

    def session_left(self) -> None:
        """A session closed: a batch that waits for every open session's frame may be ready."""
        if self._waiting:
            self._arrived.set()

    async def call(self, work: Callable[[], T]) -> T:
        """Run ``work`` on the model thread (between batches) and return its result."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, work)

    async def infer(self, session: Session, frame: ClientFrame) -> dict[str, Any]:
        """Queue one frame of ``session`` and wait for its reply (actions, language, timing).

        Raises:
            QueueFull: ``max_queued_frames`` frames already wait (counted).
            InferenceFailed: the model raised on this frame (counted).
        """
        if len(self._waiting) >= self.settings.max_queued_frames:
            self.counters.add("refused_queue_full")
            raise QueueFull(
                f"server busy: {self.settings.max_queued_frames} frames already wait for the model"
            )
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(_Waiting(session, frame, future, self.clock()))
        self._arrived.set()
        return await future

    async def run(self) -> None:
        """Form batches and run them on the model thread, until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            await self._arrived.wait()
            await self._gather_window()
            batch = self._waiting[: self.settings.max_batch]
            del self._waiting[: len(batch)]
            if not self._waiting:
                self._arrived.clear()
            batch = [w for w in batch if not w.future.done() and not w.session.closed]
            if not batch:
                continue
            try:
                await loop.run_in_executor(self._executor, self._run_batch, batch, loop)
            except Exception as error:  # outside the engine's own fault boundaries: answer, go on
                logger.exception("a batch of %d frames failed", len(batch))
                self.counters.add("batch_failures")
                failed = InferenceFailed(f"inference failed: {type(error).__name__}: {error}")
                for waiting in batch:
                    _resolve(waiting.future, failed)

    async def _gather_window(self) -> None:
        """Wait up to ``window_s`` for more frames, less when every open session has one."""
        end = self.clock() + self.settings.window_s
        while len(self._waiting) < min(len(self._open_sessions()), self.settings.max_batch):
            left = end - self.clock()
            if left <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), left)
            except asyncio.TimeoutError:
                pass
            self._arrived.set()  # frames are waiting either way

    def _run_batch(self, batch: list[_Waiting], loop: asyncio.AbstractEventLoop) -> None:
        """Model thread: act on every frame at once, answer each, then language."""
        started = self.clock()
        for waiting in batch:
            waiting.session.report_published(waiting.frame.published)
        results = act_together(
            [w.session.engine for w in batch], [w.frame.observation for w in batch]
        )
        acted = self.clock()
        self.counters.add("batches")
        self.counters.add(f"batch_size_{len(batch)}")
        for waiting, result in zip(batch, results, strict=True):
            session = waiting.session
            if isinstance(result, Exception):
                self.counters.add("refused_inference_failed")
                reply: Any = InferenceFailed(
                    f"inference failed for this frame: {type(result).__name__}: {result}"
                )
            else:
                reply = {
                    "actions": result.actions,
                    **session.acted(result, waiting.frame.ask, waiting.frame.ask_max_tokens),
                    "server_timing": {
                        "infer_ms": (acted - started) * 1e3,
                        "queue_ms": (started - waiting.received) * 1e3,
                        "batch_size": len(batch),
                    },
                }
                self.counters.add("frames_served")
                deadline = self.settings.deadline_s
                if deadline and acted - waiting.received > deadline:
                    self.counters.add("late_replies")
            loop.call_soon_threadsafe(_resolve, waiting.future, reply)
            if not isinstance(result, Exception):
                session.replied(result, self.clock() - waiting.received)
        # language yields most of its budget when frames already wait for the next batch
        budget = self.settings.language_budget_s / (4 if self._waiting else 1)
        sessions = [session for session in self._open_sessions() if not session.closed]
        if sessions:
            outs = decode_together([session.engine for session in sessions], self.clock() + budget)
            for session, deltas in zip(sessions, outs, strict=True):
                session.heard(deltas)

    def shutdown(self) -> None:
        """Stop the model thread after the batch it runs (if any)."""
        self._executor.shutdown(wait=True)


def _resolve(future: asyncio.Future, reply: Any) -> None:
    if future.done():  # the session went away while its frame ran
        return
    if isinstance(reply, Exception):
        future.set_exception(reply)
    else:
        future.set_result(reply)
