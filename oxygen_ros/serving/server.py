"""`PolicyServer`: the OxyGen engine behind openpi's websocket policy-server protocol.

Wire-compatible with openpi's `WebsocketClientPolicy` (shared/SERVING.md): on connect one
binary frame with the metadata; then each binary frame from the client is a packed observation
(`wire.pack`) answered by one packed reply ``{"actions": [H, D], "server_timing": {...}, ...}``;
an error is one *text* frame (the client raises it), never a traceback, and the connection stays
open for the next observation. ``GET /livez`` answers 200 "OK\\n" once listening; ``GET /healthz``
answers 503 "warming up" until one synthetic frame has gone through every path the server serves
(actions, and the language it runs: an ask, narration), then 200 "OK\\n"; a client connecting
meanwhile gets its metadata frame once warm. ``GET /stats`` answers the counters as JSON (every
refusal kind, frames served, batch sizes, open sessions).

Safe by default: it binds 127.0.0.1 unless told otherwise; with an API key the handshake must
carry ``Authorization: Api-Key <key>`` (401 without the header, 403 with another key; ``/stats``
too, ``/healthz`` never); a frame over ``max_message_bytes`` closes that connection with 1009
(the websocket library refuses it before reading it); sessions beyond ``max_sessions`` are
refused with 503 at the handshake when none of them waits for its client (or, when several
handshakes race for the last place, closed with 1013 "try again later" before the metadata frame);
a session that sends no observation for ``idle_timeout_s`` gives its place back at once and is
closed with 1001 "going away" and a reason saying so.

Under pressure idle sessions yield sooner: a robot that finds every place taken is held before its
metadata frame until a session has waited ``idle_grace_s`` for its client (`idle.pick_idle`:
sessions that never sent an observation first, then the longest idle); that session gives its place
to the newcomer and is closed with 1013 and a reason saying so (``sessions_evicted_idle``).

Each connection is a `sessions.Session` (its own engine state over the one policy); frames of
all sessions are batched on one model thread (`batching.ModelWorker`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import http
import json
import logging
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import websockets
from websockets.asyncio.server import Request, Response, ServerConnection, serve
from websockets.frames import CloseCode

from ..engine.counters import Counters
from ..engine.runtime import build_engine
from ..engine.scheduler import PoolShare
from ..engine.settings import EngineConfig
from ..policy_io.policy import Pi05Policy
from .batching import BatchSettings, InferenceFailed, ModelWorker, QueueFull
from .idle import DEFAULT_IDLE_GRACE_S, Place, has_idle, pick_idle
from .observations import ClientFrame, ObservationError, ObservationReader
from .sessions import LanguageSettings, Session, SessionTable
from .warm_up import warm_up
from .wire import WireError, WireLimits, pack, unpack

logger = logging.getLogger(__name__)

HEALTH_PATH = "/healthz"  # ready: warmed up (503 before)
LIVE_PATH = "/livez"  # alive: listening
STATS_PATH = "/stats"
# Long enough for a robot paused between episodes (a scene reset, an operator's prompt), short
# enough that a client that connected and went silent gives its place back (docs/serving.md).
DEFAULT_IDLE_TIMEOUT_S = 600.0
IDLE_CLOSE_CODE = CloseCode.GOING_AWAY
EVICT_CLOSE_CODE = CloseCode.TRY_AGAIN_LATER


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """Where and how the server listens, and its limits (see the module docstring)."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: any free port (`PolicyServer.port` says which)
    api_key: str = ""  # empty: no key checked
    max_sessions: int = 8
    max_message_bytes: int = 8 * 1024 * 1024
    # a session without an observation for this long is closed (0: never)
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    # when every place is taken, a session idle this long yields its place to a newcomer
    idle_grace_s: float = DEFAULT_IDLE_GRACE_S
    batch: BatchSettings = BatchSettings()
    language: LanguageSettings = LanguageSettings()

    def __post_init__(self) -> None:
        if not 0 <= self.idle_timeout_s < math.inf:
            raise ValueError(
                f"idle_timeout_s must be finite seconds >= 0 (0: idle sessions are never closed), "
                f"got {self.idle_timeout_s}"
            )
        if not 0 <= self.idle_grace_s < math.inf:
            raise ValueError(
                f"idle_grace_s must be finite seconds >= 0 (0: an idle session yields at once "
                f"when every place is taken), got {self.idle_grace_s}"
            )


class PolicyServer:
    """Serves ``policy`` to openpi clients, one engine state per connection (``engine_config``,
    each session's noise seed offset by its id)."""

    def __init__(
        self, policy: Pi05Policy, engine_config: EngineConfig, settings: ServerSettings
    ) -> None:
        self.policy = policy
        self.engine_config = engine_config
        self.settings = settings
        self.counters = Counters()
        rtc = engine_config.chunk_continuity == "rtc"
        self.reader = ObservationReader(policy, rtc_feedback=rtc)
        self.limits = WireLimits(max_message_bytes=settings.max_message_bytes)
        self.sessions = SessionTable(
            self._make_engine, settings.max_sessions, settings.language, self.counters
        )
        # every session's frames and language requests live in one KV pool
        self.share = PoolShare(policy, engine_config, settings.max_sessions)
        self.port = settings.port
        self._worker: ModelWorker | None = None
        self._places: dict[int, Place] = {}  # open sessions as the event loop sees them
        self._ready: asyncio.Event | None = None  # set once warmed up (made on the loop)
        self.warm_up_s: float | None = None

    def _make_engine(self, session_id: int):
        seed = self.engine_config.seed + session_id - 1
        config = dataclasses.replace(self.engine_config, seed=seed)
        return build_engine(self.policy, config, share=self.share)

    def metadata(self, session: Session) -> dict[str, Any]:
        """The first frame a client receives."""
        policy = self.policy
        return {
            "server": "oxygen-serve",
            "session_id": session.session_id,
            "seed": session.engine.config.seed,
            "robot": policy.robot.name,
            "action_space": policy.robot.action_space,
            "action_horizon": policy.config.action_horizon,
            "action_dim": policy.action_dim,
            "observation": self.reader.describe(),
            "language_kinds": sorted(session.engine.config.kinds),
            "stats_path": STATS_PATH,
        }

    def stats(self) -> dict[str, Any]:
        waiting = self._worker.frames_waiting if self._worker is not None else 0
        now = {"sessions_open": len(self.sessions), "frames_waiting": waiting}
        return now | self.counters.snapshot()

    # -- serving ---------------------------------------------------------------------------------
    async def serve(self, started: asyncio.Future | None = None) -> None:
        """Serve until cancelled; ``started`` gets the bound port once listening and warmed up."""
        self._worker = ModelWorker(self.settings.batch, self.counters, self.sessions.sessions)
        self._ready = asyncio.Event()
        batches = asyncio.create_task(self._worker.run())
        try:
            async with serve(
                self._handle,
                self.settings.host,
                self.settings.port,
                process_request=self._process_request,
                compression=None,
                max_size=self.settings.max_message_bytes,
            ) as server:
                self.port = next(iter(server.sockets)).getsockname()[1]
                logger.info("oxygen-serve listening on %s:%d", self.settings.host, self.port)
                start = time.monotonic()
                await self._worker.call(
                    lambda: warm_up(
                        self._make_engine(1), self.reader.synthetic(), self.settings.language
                    )
                )
                self.warm_up_s = time.monotonic() - start
                self._ready.set()
                logger.info("oxygen-serve ready: warmed up in %.2f s", self.warm_up_s)
                if started is not None:
                    started.set_result(self.port)
                await asyncio.Future()  # until cancelled
        finally:
            batches.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await batches
            await asyncio.get_running_loop().run_in_executor(None, self._worker.shutdown)

    def _process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        """Health and stats paths, the API key and the session limit, before the handshake."""
        if request.path == LIVE_PATH:
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        if request.path == HEALTH_PATH:
            if not self._ready.is_set():
                return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, "warming up\n")
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        key = self.settings.api_key
        if key:
            given = request.headers.get("Authorization")
            if given is None:
                self.counters.add("refused_auth_missing")
                return connection.respond(
                    http.HTTPStatus.UNAUTHORIZED, "missing header Authorization: Api-Key <key>\n"
                )
            if not hmac.compare_digest(given.encode(), f"Api-Key {key}".encode()):
                self.counters.add("refused_auth_wrong")
                return connection.respond(http.HTTPStatus.FORBIDDEN, "wrong API key\n")
        if request.path == STATS_PATH:
            return connection.respond(http.HTTPStatus.OK, json.dumps(self.stats()) + "\n")
        if not self.sessions.has_room() and not has_idle(self._places.values()):
            self.counters.add("refused_sessions_full")  # no session waits for its client
            return connection.respond(
                http.HTTPStatus.SERVICE_UNAVAILABLE,
                f"server full: {self.settings.max_sessions} sessions open\n",
            )
        return None

    async def _handle(self, connection: ServerConnection) -> None:
        await self._ready.wait()  # a connection made while warming up waits for it
        session = await self._admit()
        if session is None:  # lost the race for the last place, and no idle session yielded
            self.counters.add("refused_sessions_full")
            reason = f"server full: {self.settings.max_sessions} sessions open"
            await connection.close(CloseCode.TRY_AGAIN_LATER, reason)
            return
        logger.info("session %d opened from %s", session.session_id, connection.remote_address)
        place = self._places[session.session_id] = Place(session, idle_since=None)
        ended = ""
        try:
            await connection.send(pack(self.metadata(session)))
            ended = await self._serve_session(connection, place)
        except websockets.ConnectionClosed as closed:
            if closed.sent is not None and closed.sent.code == CloseCode.MESSAGE_TOO_BIG:
                self.counters.add("refused_message_too_big")
        finally:
            del self._places[session.session_id]
            await self._release(session)
            place.released.set()
        # its place is already free; now tell the client why
        if ended == "idle":
            timeout = self.settings.idle_timeout_s
            self.counters.add("sessions_closed_idle")
            logger.info("session %d closed: no observation for %g s", session.session_id, timeout)
            await connection.close(
                IDLE_CLOSE_CODE,
                f"idle: no observation for {timeout:g} s; session closed, reconnect to be served",
            )
        elif ended == "evicted":
            grace, places = self.settings.idle_grace_s, self.settings.max_sessions
            logger.info("session %d closed: idle while a robot waited", session.session_id)
            await connection.close(
                EVICT_CLOSE_CODE,
                f"idle under pressure: no observation for {grace:g} s or more, all {places} places "
                "taken; place given to a new robot; reconnect",
            )

    async def _admit(self) -> Session | None:
        """A place for a new connection: a free one, else the one an idle session yields
        (`pick_idle`), waiting up to ``idle_grace_s`` for a session to have been idle that long.
        None: every session is busy, or none became idle long enough in time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.idle_grace_s + 0.1  # + rounding of the sleeps
        while True:
            if self.sessions.has_room():
                session = await self._worker.call(self.sessions.open)
                if session is not None:
                    return session
                continue  # another connection took the place first: look for an idle one
            pick = pick_idle(self._places.values(), loop.time(), self.settings.idle_grace_s)
            if pick is None:
                return None
            place, wait = pick
            if wait > 0:
                if loop.time() + wait > deadline:
                    return None
                await asyncio.sleep(wait)
                continue
            # closed before the newcomer's engine is built: the pool never holds one too many
            self.counters.add("sessions_evicted_idle")
            place.evicted.set()
            await place.released.wait()

    async def _serve_session(self, connection: ServerConnection, place: Place) -> str:
        """Answer the client's messages in order until it leaves (raises ConnectionClosed), sends
        no observation for ``idle_timeout_s`` (returns "idle") or its place goes to a newcomer
        (returns "evicted").

        The idle clock runs while the server waits for the client, from the metadata frame or the
        last answered observation; a message the wire or observation checks refuse does not reset
        it.
        """
        loop = asyncio.get_running_loop()
        timeout = self.settings.idle_timeout_s or None
        waiting_since = loop.time()
        place.waiting(waiting_since, observed=False)
        previous_ms = None
        while True:
            left = None if timeout is None else waiting_since + timeout - loop.time()
            message = await _next_message(connection, place, left)
            if message is None:
                return "evicted" if place.evicted.is_set() else "idle"
            place.busy()
            start = time.monotonic()
            frame = self._read(message)
            if isinstance(frame, str):
                await connection.send(frame)
                place.waiting(waiting_since, observed=False)
                continue
            reply = await self._infer(place.session, frame)
            if isinstance(reply, str):
                await connection.send(reply)
            else:
                if previous_ms is not None:
                    reply["server_timing"]["prev_total_ms"] = previous_ms
                await connection.send(pack(reply))
                previous_ms = (time.monotonic() - start) * 1e3
            waiting_since = loop.time()
            place.waiting(waiting_since, observed=not isinstance(reply, str))

    async def _release(self, session: Session) -> None:
        """Give the session's place back, then finish its requests and free its KV on the model
        thread (queued before any session opened after it)."""
        self.sessions.forget(session)
        self._worker.session_left()
        await self._worker.call(session.close)
        self.counters.add("sessions_closed")
        logger.info("session %d closed", session.session_id)

    def _read(self, message: bytes | str) -> ClientFrame | str:
        """The checked frame, or the text of an error frame (each refusal counted by kind)."""
        if isinstance(message, str):
            self.counters.add("refused_text_frame")
            return "message: expected a binary msgpack frame, got a text frame"
        try:
            return self.reader.read(unpack(message, self.limits), time.monotonic())
        except WireError as error:
            self.counters.add("refused_bad_message")
            return str(error)
        except ObservationError as error:
            self.counters.add("refused_bad_observation")
            return str(error)

    async def _infer(self, session: Session, frame: ClientFrame) -> dict[str, Any] | str:
        """The model's reply, or the text of an error frame (queue full, inference failed)."""
        try:
            return await self._worker.infer(session, frame)
        except (QueueFull, InferenceFailed) as error:
            return str(error)


async def _next_message(
    connection: ServerConnection, place: Place, timeout_s: float | None
) -> bytes | str | None:
    """The client's next message; None when ``place`` is evicted first or ``timeout_s`` passes.

    Raises websockets.ConnectionClosed when the connection ends."""
    receive = asyncio.ensure_future(connection.recv())
    evicted = asyncio.ensure_future(place.evicted.wait())
    try:
        await asyncio.wait(
            {receive, evicted}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        evicted.cancel()
        if not receive.done():
            receive.cancel()  # safe: websockets keeps an unread message for the next recv
        elif place.evicted.is_set() and not receive.cancelled():
            receive.exception()  # read, so an ended connection is not logged as unhandled
    if place.evicted.is_set() or not receive.done():
        return None
    return receive.result()


@dataclasses.dataclass
class RunningServer:
    """A server running on its own event loop thread (`serve_in_thread`)."""

    server: PolicyServer
    port: int
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    task: asyncio.Task

    @property
    def uri(self) -> str:
        return f"ws://{self.server.settings.host}:{self.port}"

    def stop(self, timeout_s: float = 30.0) -> None:
        self.loop.call_soon_threadsafe(self.task.cancel)
        self.thread.join(timeout_s)


@contextlib.contextmanager
def serve_in_thread(server: PolicyServer, timeout_s: float = 60.0) -> Iterator[RunningServer]:
    """Run ``server`` on a background thread while the block runs (tests, benches)."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    def main() -> None:
        asyncio.set_event_loop(loop)
        started = loop.create_future()
        started.add_done_callback(lambda _: ready.set())
        holder["task"] = loop.create_task(server.serve(started))
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(holder["task"])
        ready.set()
        loop.close()

    thread = threading.Thread(target=main, name="oxygen-serve", daemon=True)
    thread.start()
    if not ready.wait(timeout_s):
        raise RuntimeError(f"oxygen-serve did not start listening within {timeout_s} s")
    task = holder["task"]
    if task.done():
        task.result()  # raises why it could not listen
        raise RuntimeError("oxygen-serve stopped before listening")
    running = RunningServer(server, server.port, loop, thread, task)
    try:
        yield running
    finally:
        running.stop()
