"""Robot sessions: one per connection, each with its own engine state over the shared policy.

A `Session` owns an `OxygenEngine` built over the server's one policy (one copy of the
weights) in the server's one KV pool (`scheduler.PoolShare`): its own frames, chunk continuity
(RTC), subtask loop, language requests and noise seed. Only the model worker thread touches a
session's engine (`batching`).
`SessionTable` admits sessions up to a limit and counts what it refuses.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Callable

import numpy as np

from ..engine.counters import Counters
from ..engine.requests import SamplingParams
from ..engine.scheduler import OxygenEngine
from ..engine.types import ActionChunk, TextDelta


@dataclasses.dataclass(frozen=True)
class LanguageSettings:
    """What language each session runs beside its actions.

    narration_every: a narration request every this many frames (0: none).
    max_tokens: a request's token limit.
    """

    narration_every: int = 0
    max_tokens: int = 24


class Session:
    """One connected robot: its engine and the language it has not been told yet."""

    def __init__(self, session_id: int, engine: OxygenEngine, language: LanguageSettings) -> None:
        self.session_id = session_id
        self.engine = engine
        self.language = language
        self.closed = False
        self.frames = 0
        self._unsent: list[TextDelta] = []  # deltas made since the last reply
        self._replied: tuple[int, np.ndarray, float] | None = None  # frame id, actions, delay

    def replied(self, chunk: ActionChunk, delay_s: float) -> None:
        """A reply was sent ``delay_s`` after its observation arrived (worker thread)."""
        self._replied = (chunk.frame_id, chunk.actions, delay_s)

    def report_published(self, published: tuple[np.ndarray, float] | None) -> None:
        """Before acting on this session's next frame (worker thread): tell its engine's chunk
        continuity what the robot published of the last reply and how late — the client's
        report when it sends one (``rtc/published_chunk``, ``rtc/delay_s``), else the reply as
        sent, when it was sent. A no-op without chunk continuity."""
        if self._replied is None:
            return
        frame_id, actions, delay_s = self._replied
        self._replied = None
        if published is not None:
            actions, delay_s = published
        self.engine.chunk_published(frame_id, actions, delay_s)

    def submit_language(self, ask: str, ask_max_tokens: int = 0) -> None:
        """Queue this frame's question (if any; its answer limited to ``ask_max_tokens`` when the
        client asks for fewer than the server's limit) and a due narration (worker thread)."""
        sampling = SamplingParams(max_tokens=self.language.max_tokens, seed=self.frames)
        if ask:
            limit = min(ask_max_tokens or sampling.max_tokens, sampling.max_tokens)
            self.engine.submit("answer", ask, dataclasses.replace(sampling, max_tokens=limit))
        every = self.language.narration_every
        due = every and (self.frames - 1) % every == 0  # frames 1, 1 + every, ...
        if due and "narration" in self.engine.config.kinds:
            self.engine.submit("narration", "", sampling)

    def heard(self, deltas: list[TextDelta]) -> None:
        """Language this session's requests made (worker thread): sent with the next reply."""
        self._unsent += deltas

    def acted(self, chunk: ActionChunk, ask: str, ask_max_tokens: int = 0) -> dict:
        """The reply's language part for a frame just acted on (worker thread): the deltas made
        since the last reply, merged per request, and the current subtask."""
        self.frames += 1
        self.submit_language(ask, ask_max_tokens)
        deltas, self._unsent = self._unsent, []
        language: dict[int, dict] = {}
        for delta in deltas:
            entry = language.setdefault(
                delta.request_id, {"request_id": delta.request_id, "kind": delta.kind, "text": ""}
            )
            entry["text"] += delta.text
            if delta.final:
                entry["final"] = True
                entry["finish_reason"] = delta.finish_reason
                if delta.detail:
                    entry["detail"] = delta.detail
        extra: dict = {"language": list(language.values())} if language else {}
        if chunk.subtask_id:  # conditioned (an untrained model's subtask may be blank text)
            extra["subtask"] = chunk.subtask
        return extra

    def close(self) -> None:
        """Finish every request, release all KV and leave the shared pool (worker thread)."""
        self.closed = True
        if self.engine.share is None:
            self.engine.close()
        else:
            self.engine.share.close_engine(self.engine)


class SessionTable:
    """The open sessions, up to ``max_sessions``; refusals are counted in ``counters``."""

    def __init__(
        self,
        make_engine: Callable[[int], OxygenEngine],
        max_sessions: int,
        language: LanguageSettings,
        counters: Counters,
    ) -> None:
        self._make_engine = make_engine
        self.max_sessions = max_sessions
        self.language = language
        self.counters = counters
        self._ids = itertools.count(1)
        self._open: dict[int, Session] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._open)

    def has_room(self) -> bool:
        return len(self._open) < self.max_sessions

    def open(self) -> Session | None:
        """A new session (its engine seeded by its id), or None when the table is full (the
        caller counts the refusal, once it gives up)."""
        with self._lock:
            if len(self._open) >= self.max_sessions:
                return None
            session_id = next(self._ids)
            session = Session(session_id, self._make_engine(session_id), self.language)
            self._open[session_id] = session
        self.counters.add("sessions_opened")
        return session

    def sessions(self) -> list[Session]:
        """The open sessions, oldest first."""
        with self._lock:
            return list(self._open.values())

    def forget(self, session: Session) -> None:
        with self._lock:
            self._open.pop(session.session_id, None)
