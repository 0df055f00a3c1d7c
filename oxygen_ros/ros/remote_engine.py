"""The engine the node's tick drives when the model runs in ``oxygen-serve`` (``engine: remote``).

Topics, safety limits, trajectories, /diagnostics and the Ask action stay in the node; each tick's
observation goes to the server as its robot's openpi client sends it (`client_observation`),
and the reply's actions come back as the frame's chunk. `RemoteEngine` offers the tick what the
local `OxygenEngine` does (act, chunk_published, submit, cancel, decode, close, warm_up and the
counters the tick records), with these differences:

* **Deadline**: a reply must come within ``deadline_s()`` (the node: ``server_timeout_ms``, or one
  tick period). Past it the tick has no action (`ServerUnavailable`, reason ``late``: counted as
  ``no_action_server_late``, not an engine fault) and the reply is dropped when it comes
  (its language is still read). Likewise ``disconnected`` (the client reconnects by itself in
  its own thread) and ``behind`` (earlier replies still outstanding).
* **RTC**: when the server lists `PUBLISHED_CHUNK_KEY` and `PUBLISHED_DELAY_KEY` among its
  observation keys, each request carries the chunk the node last published (after its limits)
  and the delay it saw, so the server's real-time chunking guides from what the robot executes.
* **Language**: a question (``submit("answer", text, sampling)``) rides along in the next
  request's ``ask`` field, one per request, with its token limit as ``ask/max_tokens`` when the
  server lists that key (oxygen-serve caps it with its ``--max-tokens``); the server's answer and
  narration deltas come back in the replies' ``language`` entries and are matched to the node's
  requests in order (the server numbers them in the order it was asked). Narration is the
  server's (``oxygen-serve --narration-every``): the node's narration request is answered by the
  server's next narration; narrations the node did not ask for are published too. A lost
  connection ends the session on the server, so every request open there ends ``failed``
  (saying the server changed, when the client moves on to another).
* **Sessions and failover**: each connection is a new session on its server (the same server
  after a reconnection, the next one after a switch: `server_ring`). A new session starts clean:
  no RTC feedback about chunks it never sent, its own subtask loop from its first frame, the
  served model re-read from its metadata (the client has checked it fits the node). A request is
  sent only on the connection its message was built for, so nothing built for the old session
  reaches the new one, and a reply to the old one can never be acted on.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..engine.requests import SamplingParams
from ..engine.types import ActionChunk, Observation, TextDelta, WarmUpReport
from ..serving.client import (
    ASK_MAX_TOKENS_KEY,
    PUBLISHED_CHUNK_KEY,
    PUBLISHED_DELAY_KEY,
    DeadlineMissed,
    NotConnected,
    PolicyClient,
    ServerBehind,
    ServerError,
)
from ..serving.client_observation import client_message
from ..serving.wire import WireError

WARM_UP_FRAMES = 5
WARM_UP_TIMEOUT_S = 60.0  # a server's first frames pay its own first-call costs


class ServerUnavailable(Exception):
    """No reply to act on this tick; ``reason``: disconnected | late | behind. Not a fault of the
    engine: the tick counts ``no_action_server_<reason>`` and the next one tries again."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class ServerRefused(ValueError):
    """The server answered this frame with an error (or with a reply the node cannot use)."""


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What the server's metadata frame says about the model it serves."""

    server: str
    robot: str
    action_horizon: int
    action_dim: int
    state_dim: int  # 0: any
    cameras: tuple[str, ...]
    observation_keys: frozenset[str]
    session_id: int

    @property
    def published_horizon(self) -> int:
        """Actions per chunk (the node publishes ``action_horizon`` or all of them)."""
        return self.action_horizon

    @property
    def tokenizer(self) -> None:
        """None: the server tokenizes the prompt (and shortens a task too long for it)."""
        return None

    @property
    def takes_rtc_feedback(self) -> bool:
        return {PUBLISHED_CHUNK_KEY, PUBLISHED_DELAY_KEY} <= self.observation_keys

    @property
    def takes_ask_max_tokens(self) -> bool:
        return ASK_MAX_TOKENS_KEY in self.observation_keys

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> ServedModel:
        """Raises ValueError naming a field the metadata lacks (not an oxygen-serve server?)."""
        try:
            observation = metadata["observation"]
            return cls(
                server=str(metadata.get("server", "?")),
                robot=str(metadata["robot"]),
                action_horizon=int(metadata["action_horizon"]),
                action_dim=int(metadata["action_dim"]),
                state_dim=int(observation.get("state_dim", 0)),
                cameras=tuple(str(c) for c in observation.get("cameras", ())),
                observation_keys=frozenset(str(k) for k in observation.get("keys", ())),
                session_id=int(metadata.get("session_id", 0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(
                f"the server's metadata does not describe an oxygen-serve model "
                f"({type(error).__name__}: {error}); metadata keys: {sorted(metadata)}"
            ) from None


class _NoLocalDecoding:
    """The node decodes no language in remote mode: a decode step costs its tick nothing."""

    def estimate(self, batch: int) -> float:
        return 0.0


@dataclasses.dataclass
class _Open:
    kind: str
    cancelled: bool = False


class RemoteEngine:
    """The tick's engine over a connected `PolicyClient` (see the module docstring).

    deadline_s: the longest a tick waits for its reply, read at every frame.
    action_dims: the node's action joints: a chunk keeps the model's first ``action_dims`` dims
    (as the local engine does).
    """

    name = "remote"
    continuity = None  # RTC runs on the server
    subtasks = None  # the subtask loop too (its text comes back with each chunk)
    captures_during_frames = static_fallbacks = fixed_steps_skipped = 0
    tokens_generated = decode_steps = 0  # the server's to count

    def __init__(
        self,
        client: PolicyClient,
        model: ServedModel,
        deadline_s: Callable[[], float],
        action_dims: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.action_dims = action_dims
        self.policy = model
        self.clock = clock
        self.timer = _NoLocalDecoding()
        self.faults_by_stage: dict[str, int] = {}
        self._deadline_s = deadline_s
        self._frame_id = 0
        self._published: tuple[np.ndarray, float] | None = None
        self._reply: tuple[int, np.ndarray] | None = None  # the last chunk's frame, all its dims
        self._lock = threading.Lock()  # language state: the tick and late replies meet here
        self._next_id = 1
        # questions not sent yet: (local id, text, token limit)
        self._questions: collections.deque[tuple[int, str, int]] = collections.deque()
        self._asked: collections.deque[int] = collections.deque()  # sent, no server id yet
        self._narrations: collections.deque[int] = collections.deque()  # asked of the server
        self._open: dict[int, _Open] = {}  # local id -> a request sent (or to be answered)
        self._local_of: dict[int, int] = {}  # server request id -> local id
        self._inbox: list[TextDelta] = []
        self._disconnects_seen = client.stats.disconnects
        self._connection = client.connection  # the session ``model`` describes
        self.sessions = 1  # server sessions used: the first, and one per reconnection or switch
        client.on_late_reply = self._read_language

    # -- the action path -------------------------------------------------------------------------
    def act(self, observation: Observation) -> ActionChunk:
        """The server's chunk for ``observation`` (with a waiting question and RTC feedback).

        Raises:
            ServerUnavailable: no reply in time, or no connection (the tick has no action).
            ServerRefused: the server's error for this frame, or a reply without usable actions.
        """
        return self._act(observation, self._deadline_s())

    def _act(self, observation: Observation, timeout_s: float) -> ActionChunk:
        connection = self._follow_session()
        message = client_message(observation, self.policy.robot)
        with self._lock:
            question = self._questions[0] if self._questions else None
        if question is not None:
            message["ask"] = question[1]
            if self.policy.takes_ask_max_tokens:
                message[ASK_MAX_TOKENS_KEY] = question[2]
        if self._published is not None and self.policy.takes_rtc_feedback:
            message[PUBLISHED_CHUNK_KEY], message[PUBLISHED_DELAY_KEY] = self._published
        started = self.clock()
        try:
            reply = self.client.infer(message, timeout_s=timeout_s, connection=connection)
        except DeadlineMissed as error:
            self._asked_question(question)  # the server has it: its answer comes later
            raise ServerUnavailable("late", str(error)) from None
        except NotConnected as error:
            raise ServerUnavailable("disconnected", str(error)) from None
        except ServerBehind as error:
            raise ServerUnavailable("behind", str(error)) from None
        except ServerError as error:
            self._refused_question(question, str(error))
            raise ServerRefused(f"the server refused the frame: {error}") from None
        except WireError as error:
            raise ServerRefused(f"the server's reply is not a valid message: {error}") from None
        self._asked_question(question)
        self._read_language(reply)
        actions = reply.get("actions")
        if (
            not isinstance(actions, np.ndarray)
            or actions.ndim != 2
            or actions.dtype.kind not in "iuf"
            or actions.shape[1] < self.action_dims
        ):
            raise ServerRefused(
                f"the server's reply has no [horizon, >= {self.action_dims}] actions array: "
                f"{_kind(actions)}"
            )
        self._frame_id += 1
        self._reply = (self._frame_id, actions.astype(np.float32))
        subtask = reply.get("subtask", "")
        return ActionChunk(
            frame_id=self._frame_id,
            stamp=observation.stamp,
            actions=actions[:, : self.action_dims].astype(np.float32),
            prefill_ms=0.0,
            action_ms=(self.clock() - started) * 1e3,
            subtask=subtask if isinstance(subtask, str) else "",
        )

    def chunk_published(self, frame_id: int, actions: np.ndarray | None, delay_s: float) -> None:
        """Remember what the robot now executes (None: the chunk was not published, the previous
        one still runs) for the next request's RTC feedback: the published rows, in all the
        model's dims (those the node does not drive as the server sent them)."""
        if actions is None or self._reply is None or self._reply[0] != frame_id:
            return
        published = np.asarray(actions, dtype=np.float32)
        full = self._reply[1][: len(published)].copy()
        full[:, : published.shape[1]] = published
        self._published = (full, float(delay_s))

    def set_action_dt(self, action_dt: float) -> None:
        """Nothing to set here: the server's RTC steps at its own ``--action-dt``."""

    def restart_subtask(self) -> None:
        """Nothing to restart here: the server's subtask loop follows the prompt it is sent."""

    # -- language --------------------------------------------------------------------------------
    def submit(
        self, kind: str, text: str = "", sampling: SamplingParams | None = None, **fields: str
    ) -> int:
        """A local id for a request the server will answer: a question rides along with the next
        frame; a narration is answered by the server's next one. Other kinds end ``refused``."""
        limit = (sampling or SamplingParams()).max_tokens
        with self._lock:
            request_id = self._new_id()
            if kind == "answer":
                self._questions.append((request_id, text, limit))
                self._open[request_id] = _Open(kind)
            elif kind == "narration":
                self._narrations.append(request_id)
                self._open[request_id] = _Open(kind)
            else:
                self._inbox.append(
                    TextDelta(
                        request_id,
                        kind,
                        "",
                        final=True,
                        finish_reason="refused",
                        detail=f"a {kind} request cannot be sent to oxygen-serve",
                    )
                )
        return request_id

    def cancel(self, request_id: int) -> TextDelta | None:
        """End a request here (its ``cancelled`` final); what the server still sends for it is
        dropped. None for a request that is not open."""
        with self._lock:
            request = self._open.get(request_id)
            if request is None or request.cancelled:
                return None
            self._questions = collections.deque(q for q in self._questions if q[0] != request_id)
            request.cancelled = True
            return TextDelta(request_id, request.kind, "", final=True, finish_reason="cancelled")

    def decode(self, until: float | None = None) -> list[TextDelta]:
        """The deltas the replies brought since the last call (never waits)."""
        self._follow_session()
        with self._lock:
            deltas, self._inbox = self._inbox, []
        return deltas

    @property
    def active_requests(self) -> int:
        """The node's requests sent to the server and not finished."""
        with self._lock:
            sent = [r for i, r in self._open.items() if not r.cancelled]
            return len(sent) - len(self._questions)

    @property
    def queued_requests(self) -> int:
        """Questions waiting for a frame to ride along with."""
        return len(self._questions)

    def _read_language(self, reply: dict[str, Any]) -> None:
        """The reply's language entries as deltas of the node's requests (any thread)."""
        entries = reply.get("language")
        if not isinstance(entries, list):
            return
        with self._lock:
            for entry in entries:
                delta = self._delta(entry)
                if delta is not None:
                    self._inbox.append(delta)

    def _delta(self, entry: Any) -> TextDelta | None:
        """One language entry of a reply -> a delta of the local request it answers (None: a
        malformed entry, or one of a cancelled request). Called with the lock held."""
        if not isinstance(entry, dict) or not isinstance(entry.get("request_id"), int):
            return None
        server_id, kind = entry["request_id"], str(entry.get("kind", ""))
        local = self._local_of.get(server_id)
        if local is None:
            waiting = {"answer": self._asked, "narration": self._narrations}.get(kind)
            local = waiting.popleft() if waiting else self._new_id()
            self._local_of[server_id] = local
            self._open.setdefault(local, _Open(kind))
        final = bool(entry.get("final", False))
        request = self._open[local]
        if final:
            del self._local_of[server_id]
            del self._open[local]
        if request.cancelled:
            return None
        return TextDelta(
            local,
            kind,
            str(entry.get("text", "")),
            final=final,
            finish_reason=str(entry.get("finish_reason", "")) if final else "",
            detail=str(entry.get("detail", "")),
        )

    def _asked_question(self, question: tuple[int, str, int] | None) -> None:
        if question is None:
            return
        with self._lock:
            if self._questions and self._questions[0] == question:
                self._questions.popleft()
                self._asked.append(question[0])

    def _refused_question(self, question: tuple[int, str, int] | None, why: str) -> None:
        """A frame refused for its question (the error names ``ask``): end that question, so
        the frames after it go without it."""
        if question is None or not why.startswith("ask:"):
            return
        with self._lock:
            if self._questions and self._questions[0] == question:
                self._questions.popleft()
                self._open.pop(question[0], None)
                self._inbox.append(
                    TextDelta(question[0], "answer", "", True, finish_reason="refused", detail=why)
                )

    def _follow_session(self) -> int:
        """Catch up with the client's connection; returns the number of the one in use (or last
        used). A lost connection ends the requests sent there; a new one starts a clean session."""
        self._end_lost_session()
        connection, metadata = self.client.current_connection()
        if connection != self._connection and metadata is not None:
            self._connection = connection
            self.sessions += 1
            self._published = self._reply = None  # chunks of the old session: not this one's
            self.policy = ServedModel.from_metadata(metadata)  # checked by the client to fit
        return connection

    def _end_lost_session(self) -> None:
        """After a lost connection the server's session is gone: every request sent there ends
        ``failed`` (questions not sent yet wait for the next session)."""
        disconnects = self.client.stats.disconnects
        if disconnects == self._disconnects_seen:
            return
        self._disconnects_seen = disconnects
        if len(self.client.uris) > 1:
            detail = (
                f"the server changed: {self.client.last_error}; the node moved on to "
                f"{self.client.uri} and the request ended with the old server's session "
                "(ask again)"
            )
        else:
            detail = f"the connection to the server was lost: {self.client.last_error}"
        with self._lock:
            waiting = {request_id for request_id, *_ in self._questions}
            for request_id, request in list(self._open.items()):
                if request_id in waiting:
                    continue
                del self._open[request_id]
                if not request.cancelled:
                    self._inbox.append(
                        TextDelta(
                            request_id,
                            request.kind,
                            "",
                            final=True,
                            finish_reason="failed",
                            detail=detail,
                        )
                    )
            self._asked.clear()
            self._narrations.clear()
            self._local_of.clear()

    def _new_id(self) -> int:
        request_id, self._next_id = self._next_id, self._next_id + 1
        return request_id

    # -- the rest of the engine interface ----------------------------------------------------------
    def warm_up(self, observation: Observation, frames: int = WARM_UP_FRAMES) -> WarmUpReport:
        """Round trips with ``observation`` (each may take `WARM_UP_TIMEOUT_S`): the median of
        those after the first is the action path's cost the node plans its rate with.

        Raises ServerUnavailable or ServerRefused when a round trip fails.
        """
        frames = max(frames, 2)
        round_trips = [self._act(observation, WARM_UP_TIMEOUT_S).action_ms for _ in range(frames)]
        self._frame_id = 0
        with self._lock:  # what the server narrated meanwhile is not the node's to publish
            for request in self._open.values():
                request.cancelled = True
            self._inbox = []
        return WarmUpReport(0, float(np.median(round_trips[1:])), 0.0, frames)

    def memory(self) -> dict[str, int]:
        """The node holds no KV in remote mode (the server's is at its ``/stats``)."""
        return dict.fromkeys(
            ("bytes_in_use", "peak_bytes", "free_bytes", "capacity_bytes", "live_segments"), 0
        )

    def server_stats(self) -> dict[str, object]:
        """The connection for /diagnostics (keys ``server_*``): where, whether connected, what it
        went through."""
        stats = self.client.stats
        return {
            "server_uri": self.client.uri,
            "server_uris": ", ".join(self.client.uris),
            "server_connected": self.client.connected,
            "server_name": self.policy.server,
            "server_robot": self.policy.robot,
            "server_connects": stats.connects,
            "server_reconnects": max(stats.connects - 1, 0),
            "server_switches": stats.switches,
            "server_failbacks": stats.failbacks,
            "server_last_switch": self.client.last_switch,
            "server_sessions": self.sessions,
            "server_disconnects": stats.disconnects,
            "server_failed_attempts": stats.failed_attempts,
            "server_requests": stats.requests,
            "server_replies": stats.replies,
            "server_deadline_misses": stats.deadline_misses,
            "server_late_replies_dropped": stats.late_replies_dropped,
            "server_errors": stats.server_errors,
            "server_bad_replies": stats.bad_replies,
            "server_behind": stats.behind,
            "server_rtc_feedback": self.policy.takes_rtc_feedback,
            "server_last_error": "" if self.client.connected else self.client.last_error,
        }

    def close(self) -> list[TextDelta]:
        """Close the connection; every open request ends ``cancelled`` (idempotent)."""
        self.client.close()
        with self._lock:
            deltas = [
                TextDelta(request_id, request.kind, "", final=True, finish_reason="cancelled")
                for request_id, request in self._open.items()
                if not request.cancelled
            ]
            self._open.clear()
            self._questions.clear()
            self._inbox = []
        return deltas


def _kind(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"array {value.dtype} {value.shape}"
    return type(value).__name__
