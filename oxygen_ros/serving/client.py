"""A client of openpi's policy-server protocol (``oxygen-serve``, or openpi's own server) for a
program that must not block on the network: the node's tick, a bench's robot loop.

What it speaks is openpi's ``WebsocketClientPolicy``: a websocket without compression; the
``Authorization: Api-Key <key>`` header when given a key; the server's metadata as the first
(binary) frame; then one packed observation out, one packed reply back, in order. A text frame is
the server's error (`ServerError` with its text; the server then closes the connection).

What it adds, for a robot loop:

* **The connection lives in a background thread** that connects, reads replies and, when the
  connection drops or cannot be made, tries again with exponential backoff. `infer` never waits
  for a connection: without one it raises `NotConnected` at once (with the last reason).
* **Deadlines**: ``infer(obs, timeout_s)`` waits at most ``timeout_s`` for the reply. A reply that
  comes later is dropped when it arrives (``stats.late_replies_dropped``; ``on_late_reply`` may
  still read what else it carries, e.g. language); the next request goes out at once (the server
  answers in order), unless `MAX_IN_FLIGHT` requests are still unanswered (`ServerBehind`).
* **Failover**: given several servers (each serving the same model), it uses one at a time and
  moves on to the next when that one cannot be reached, drops the connection, or leaves
  `server_ring.SWITCH_AFTER_UNANSWERED` requests in a row without a usable reply in time (late,
  or an error: a server that refuses every frame is left too; one refused frame between good
  replies is not a reason to leave) (`server_ring`). Each connection is a new session on its
  server: `connection` numbers them, and ``infer(..., connection=n)`` refuses to send a request
  built for another one.
* **Failback**: while on another server, it asks the first one's ``/healthz`` every
  ``failback_probe_s``; once that answers 200 (oxygen-serve: listening and warmed up), it leaves
  the other server between two requests (none unanswered) and connects to the first again.
* Replies are read with `wire.unpack` (sizes, dtypes and shapes checked): a server is a peer too.

Typical use::

    client = PolicyClient(["ws://gpu-box:8000", "ws://gpu-box-2:8000"], api_key=key)
    client.start()
    client.wait_connected(10.0)
    reply = client.infer({"observation/state": state, "prompt": "pick"}, timeout_s=0.1)
    client.close()
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import websockets.exceptions
import websockets.sync.client

from .server_ring import SWITCH_AFTER_UNANSWERED, Backoff, ServerRing
from .wire import WireError, WireLimits, pack, unpack

MAX_IN_FLIGHT = 2  # unanswered requests (the late one being waited out, and the current one)
# While on another server, the first one's /healthz is asked this often: one small HTTP request a
# second costs nothing, and the node is back on its first server about a second after it is ready.
DEFAULT_FAILBACK_PROBE_S = 1.0
MAX_FAILBACK_PROBE_S = 60.0  # the probe's period doubles after each failback that did not hold
DEFAULT_PORT = 8000  # openpi's serve_policy.py

# Observation keys a client adds for the server's real-time chunking (RTC) when the server lists
# them among its metadata's ``observation.keys``: what the robot executes now, and how late it
# came. Without them a server can only assume its last reply was executed as sent, right away.
PUBLISHED_CHUNK_KEY = "rtc/published_chunk"  # float32 [H, D]: the last chunk as published
PUBLISHED_DELAY_KEY = "rtc/delay_s"  # float: its observation's stamp to its publication, s
# The token limit of the answer to a frame's ``ask`` (an int >= 1), sent to a server that lists it
# among its observation keys; the server's own limit (oxygen-serve --max-tokens) still caps it.
ASK_MAX_TOKENS_KEY = "ask/max_tokens"

logger = logging.getLogger(__name__)


class ClientError(RuntimeError):
    """Base of the errors `PolicyClient.infer` raises (each leaves the client usable)."""


class NotConnected(ClientError):
    """No connection to the server now; the background thread keeps trying (the message says
    the last reason)."""


class DeadlineMissed(ClientError):
    """No reply within the request's deadline; the reply is dropped when it arrives."""


class ServerBehind(ClientError):
    """`MAX_IN_FLIGHT` requests are still unanswered: this one was not sent."""


class ServerError(ClientError):
    """The server answered with a text frame: its error (openpi: a traceback; oxygen-serve: the
    field at fault and why)."""


@dataclasses.dataclass
class ClientStats:
    """What the connection has been through (counters only grow)."""

    connects: int = 0  # handshakes that ended with the server's metadata
    switches: int = 0  # connections made to another server than the last one
    failbacks: int = 0  # backups left because the first server was ready again
    disconnects: int = 0  # established connections lost
    failed_attempts: int = 0  # connection attempts that failed
    requests: int = 0  # observations sent
    replies: int = 0  # replies delivered in time
    server_errors: int = 0  # text frames (the server's errors; unanswered for the switch rule)
    bad_replies: int = 0  # replies that failed `wire.unpack`
    deadline_misses: int = 0  # requests whose reply was not there by their deadline
    late_replies_dropped: int = 0  # replies that arrived after their deadline
    behind: int = 0  # requests not sent: MAX_IN_FLIGHT unanswered


def server_uri(uri: str) -> str:
    """``uri`` as a websocket address: ``host:port`` and ``host`` (openpi's port 8000) get ws://."""
    if uri.startswith(("ws://", "wss://")):
        return uri
    if "://" in uri:
        raise ValueError(f"server_uri {uri!r}: only ws:// and wss:// servers are spoken to")
    if not uri:
        raise ValueError("server_uri is empty: give ws://HOST:PORT (oxygen-serve's address)")
    return f"ws://{uri}" if ":" in uri.rsplit("]", 1)[-1] else f"ws://{uri}:{DEFAULT_PORT}"


@contextlib.contextmanager
def connect(
    uri: str, api_key: str | None = None, timeout_s: float = 10.0, limits: WireLimits | None = None
) -> Iterator[tuple[websockets.sync.client.ClientConnection, dict[str, Any]]]:
    """One connection attempt: the handshake (with the API key) and the server's metadata frame;
    the connection closes when the block ends.

    Raises:
        OSError (ConnectionRefusedError, TimeoutError, ...), websockets.exceptions.InvalidHandshake
        (e.g. HTTP 401 for a wrong key), ServerError (a text frame instead of the metadata),
        WireError (metadata that is not a valid message).
    """
    limits = limits or WireLimits()
    headers = {"Authorization": f"Api-Key {api_key}"} if api_key else None
    with websockets.sync.client.connect(
        server_uri(uri),
        compression=None,
        max_size=limits.max_message_bytes,
        additional_headers=headers,
        open_timeout=timeout_s,
        proxy=None,
    ) as conn:
        first = conn.recv(timeout=timeout_s)
        if isinstance(first, str):
            raise ServerError(f"the server refused the connection: {first}")
        metadata = unpack(first, limits)
        if not isinstance(metadata, dict):
            raise WireError("metadata", f"expected a map, got {type(metadata).__name__}")
        yield conn, metadata


def health_url(uri: str) -> str:
    """The readiness address of the server at websocket ``uri`` (its ``/healthz``)."""
    scheme, rest = server_uri(uri).split("://", 1)
    host = rest.split("/", 1)[0]
    return f"{'https' if scheme == 'wss' else 'http'}://{host}/healthz"


_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def is_ready(uri: str, timeout_s: float) -> bool:
    """Whether the server at ``uri`` answers ``GET /healthz`` with 200 within ``timeout_s``."""
    try:
        with _NO_PROXY.open(health_url(uri), timeout=timeout_s) as reply:
            return reply.status == 200
    except (OSError, urllib.error.URLError, ValueError):  # refused, 503, timed out, ...
        return False


def describe(error: BaseException) -> str:
    """A one-line reason for a failed attempt or a lost connection."""
    if isinstance(error, websockets.exceptions.InvalidStatus):
        status = error.response.status_code
        hint = " (wrong or missing API key?)" if status in (401, 403) else ""
        return f"the server refused the handshake: HTTP {status}{hint}"
    if isinstance(error, ClientError):
        return str(error)
    if isinstance(error, ConnectionRefusedError):
        return "connection refused (is oxygen-serve running there?)"
    if isinstance(error, websockets.exceptions.ConnectionClosed):
        if error.rcvd is None:
            return "connection closed without a close frame (the server went away?)"
        reason = f": {error.rcvd.reason}" if error.rcvd.reason else ""
        return f"connection closed (code {error.rcvd.code}{reason})"
    return f"{type(error).__name__}: {error}"


class _Waiter:
    """One request's reply slot."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.abandoned = False  # its deadline passed: drop the reply
        self.reply: dict[str, Any] | None = None
        self.error: ClientError | WireError | None = None

    def deliver(self, reply: dict[str, Any] | None, error: ClientError | WireError | None) -> None:
        self.reply, self.error = reply, error
        self.done.set()


class PolicyClient:
    """openpi's protocol with the connection in a background thread (see the module docstring).

    servers: one address, or several serving the same model (tried in order, cycling; see
    `server_ring`). switch_after_unanswered: requests in a row without a usable reply in time (late
    or an error) after which the client leaves a server for the next (only with several).
    failback_probe_s: while on another server, how often the first one's readiness is asked
    (only with several; 0: never go back on its own).
    check_metadata(metadata): called with each new server's metadata before its connection is
    used; a ValueError it raises refuses that server (a failed attempt, with its message); may be
    set later.
    on_change(connected, detail): called from the connection thread when the connection is made
    (detail: the server's address, and the one it moved on from) or lost / cannot be made
    (detail: why); optional.
    on_late_reply(reply): called from the connection thread with each reply that came after its
    request's deadline (its actions are stale; anything else in it may not be); optional.
    """

    def __init__(
        self,
        servers: str | Sequence[str],
        api_key: str | None = None,
        *,
        open_timeout_s: float = 5.0,
        backoff: Backoff | None = None,
        switch_after_unanswered: int = SWITCH_AFTER_UNANSWERED,
        failback_probe_s: float = DEFAULT_FAILBACK_PROBE_S,
        limits: WireLimits | None = None,
        check_metadata: Callable[[dict[str, Any]], None] | None = None,
        on_change: Callable[[bool, str], None] | None = None,
        on_late_reply: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        uris = [servers] if isinstance(servers, str) else list(servers)
        self._ring = ServerRing([server_uri(uri) for uri in uris], backoff, switch_after_unanswered)
        if not 0 <= failback_probe_s < float("inf"):
            raise ValueError(
                f"failback_probe_s must be finite seconds >= 0 (0: no failback), got "
                f"{failback_probe_s}"
            )
        self._failback_probe_s = failback_probe_s if self._ring.several else 0.0
        self._failing_back = False  # the connection ends to go back to the first server
        self._failbacks_in_a_row = 0  # failbacks since the last connection to the first server
        self._api_key = api_key
        self._open_timeout_s = open_timeout_s
        self._limits = limits or WireLimits()
        self._on_change = on_change
        self.check_metadata = check_metadata  # may be set later
        self.on_late_reply = on_late_reply  # may be set later
        self.stats = ClientStats()
        self.metadata: dict[str, Any] | None = None  # the current (or last) server's
        # why the last attempt failed or the last connection ended (with several servers, prefixed
        # with the server's address)
        self.last_error = "not started"
        self.last_switch = ""  # "FROM -> TO: why FROM was left", after the first switch
        self._connected_to: str | None = None  # the server of the current (or last) connection
        self._drop_reason: str | None = None  # why the client itself ends the connection
        self._conn: websockets.sync.client.ClientConnection | None = None
        self._pending: collections.deque[_Waiter] = collections.deque()
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        self._prober: threading.Thread | None = None
        self._reported: bool | None = None  # the state on_change last told

    @property
    def uri(self) -> str:
        """The server in use, or the one tried next while there is no connection."""
        return self._ring.current

    @property
    def uris(self) -> tuple[str, ...]:
        """All the servers, in the order they are tried."""
        return self._ring.uris

    @property
    def connection(self) -> int:
        """The number of the current (or last) connection: 1 for the first, one more for each new
        one (a new session, on the same server or the next); 0 before any."""
        return self.stats.connects

    def current_connection(self) -> tuple[int, dict[str, Any] | None]:
        """The connection's number and its server's metadata, read together."""
        with self._lock:
            return self.stats.connects, self.metadata

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> PolicyClient:
        """Start the connection thread (it connects, and reconnects, until `close`)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="oxygen-client", daemon=True)
            self._thread.start()
        if self._prober is None and self._failback_probe_s:
            self._prober = threading.Thread(
                target=self._probe_first, name="oxygen-client-failback", daemon=True
            )
            self._prober.start()
        return self

    def wait_connected(self, timeout_s: float | None = None) -> bool:
        """Block until connected (True) or ``timeout_s`` passes (False)."""
        return self._connected.wait(timeout_s)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def close(self) -> None:
        """Close the connection and stop the thread (idempotent); waiting calls get
        `NotConnected`."""
        self._closing.set()
        with self._lock:
            conn = self._conn
        if conn is not None:
            conn.close()
        for thread in (self._thread, self._prober):
            if thread is not None and thread is not threading.current_thread():
                thread.join()
        self._fail_pending(NotConnected("the client was closed"))

    def __enter__(self) -> PolicyClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -------------------------------------------------------------------------------
    def infer(
        self,
        observation: dict[str, Any],
        timeout_s: float | None = None,
        connection: int | None = None,
    ) -> dict[str, Any]:
        """Send ``observation`` and wait for its reply, at most ``timeout_s`` (None: as long as the
        connection lasts). With ``connection`` (a `connection` number), send it only on that
        connection: a request built for one session is not sent to the next.

        Raises:
            NotConnected: no connection now (or not ``connection``), or it dropped before the
                reply.
            ServerBehind: `MAX_IN_FLIGHT` requests are unanswered; nothing was sent.
            DeadlineMissed: no reply within ``timeout_s`` (it is dropped when it comes).
            ServerError: the server's error text.
            WireError: the observation cannot be packed, or the reply is not a valid message.
        """
        data = pack(observation)
        waiter = _Waiter()
        with self._lock:
            conn = self._conn
            if conn is None:
                raise NotConnected(f"not connected to {self.uri}: {self.last_error}")
            if self._drop_reason:  # being left for the next server
                raise NotConnected(f"leaving {self.uri}: {self._drop_reason}")
            if connection is not None and connection != self.stats.connects:
                raise NotConnected(
                    f"the request was built for connection {connection}; connection "
                    f"{self.stats.connects} (to {self.uri}) is a new session"
                )
            if len(self._pending) >= MAX_IN_FLIGHT:
                self.stats.behind += 1
                self._unanswered(conn, "not sent: earlier ones unanswered")
                raise ServerBehind(
                    f"{len(self._pending)} requests to {self.uri} are still unanswered"
                )
            self._pending.append(waiter)
            try:  # under the lock: the order sent is the order the replies are matched in
                conn.send(data)
            except (websockets.exceptions.ConnectionClosed, OSError) as error:
                self._pending.remove(waiter)
                raise NotConnected(
                    f"the connection to {self.uri} dropped: {describe(error)}"
                ) from None
            self.stats.requests += 1
        if not waiter.done.wait(timeout_s):
            with self._lock:
                if not waiter.done.is_set():
                    waiter.abandoned = True
                    self.stats.deadline_misses += 1
                    self._unanswered(conn, "no reply within its deadline")
                    raise DeadlineMissed(
                        f"no reply from {self.uri} within {timeout_s * 1e3:.0f} ms"
                    )
        if waiter.error is not None:
            if isinstance(waiter.error, NotConnected):
                raise waiter.error
            with self._lock:  # an error is no usable reply: unanswered for the switch rule
                self._unanswered(conn, f"an error: {waiter.error}"[:200])
            raise waiter.error
        with self._lock:
            self._ring.answered_in_time()
            self.stats.replies += 1
        return waiter.reply

    @property
    def in_flight(self) -> int:
        """Requests sent and not answered yet (abandoned ones included)."""
        return len(self._pending)

    def _unanswered(self, conn: websockets.sync.client.ClientConnection, last: str) -> None:
        """A request on ``conn`` got no usable reply in time (``last``: how; lock held): after
        ``switch_after_unanswered`` in a row, with other servers to go to, end the connection
        (the connection thread then moves on). The socket is shut down, not closed with a
        handshake: a server that has stopped answering would not answer that either."""
        if not self._ring.unanswered() or self._conn is not conn or self._drop_reason:
            return
        self._drop_reason = (
            f"{self._ring.switch_after_unanswered} requests in a row got no reply within their "
            f"deadline or an error (the last: {last})"
        )
        with contextlib.suppress(OSError):
            conn.socket.shutdown(socket.SHUT_RDWR)

    # -- the connection thread ------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closing.is_set():
            uri = self.uri
            try:
                with connect(uri, self._api_key, self._open_timeout_s, self._limits) as (
                    conn,
                    metadata,
                ):
                    self._check(uri, metadata)
                    reason = self._serve(uri, conn, metadata)
            except Exception as error:  # any failed attempt: say why, wait, try the next server
                with self._lock:
                    self.stats.failed_attempts += 1
                self._move_on(uri, describe(error), lost=False)
                continue
            if self._closing.is_set():
                with self._lock:
                    self.stats.disconnects += 1
            else:
                self._move_on(uri, reason, lost=True)

    def _move_on(self, uri: str, reason: str, lost: bool) -> None:
        """After ``uri`` failed (or its connection was ``lost``): say why, choose the next server
        (the same one when there is only one) and wait before trying it."""
        with self._lock:  # whoever sees the disconnect sees its reason and the next server
            self.stats.disconnects += lost
            self.last_error = f"{uri}: {reason}" if self._ring.several else reason
            wait = self._ring.fail_back() if self._failing_back else self._ring.move_on()
            self._failing_back = False
        self._notify(False, self.last_error)
        self._closing.wait(wait)

    def _check(self, uri: str, metadata: dict[str, Any]) -> None:
        """Raises `ServerError` when ``check_metadata`` refuses the server's model."""
        check = self.check_metadata
        if check is None:
            return
        try:
            check(metadata)
        except ValueError as error:
            raise ServerError(f"{uri} serves a model this client cannot use: {error}") from None

    def _serve(
        self, uri: str, conn: websockets.sync.client.ClientConnection, metadata: dict
    ) -> str:
        """Make ``conn`` (to ``uri``) the connection until it ends; returns why it ended."""
        with self._lock:
            if self._closing.is_set():  # `close` ran while this connection was being made
                return "the client was closed"
            self._conn, self.metadata = conn, metadata
            self.stats.connects += 1
            left = self._connected_to if self._connected_to != uri else None
            if left is not None:
                self.stats.switches += 1
                self.last_switch = f"{left} -> {uri}: {self.last_error}"
            self._connected_to = uri
            if uri == self._ring.uris[0]:
                self._failbacks_in_a_row = 0
            self._drop_reason = None
            self._ring.connected()
        self._connected.set()
        self._notify(True, uri if left is None else f"{uri} (moved on from {left})")
        reason = self._read(conn)
        with self._lock:
            self._conn = None
            self._connected.clear()
            reason = self._drop_reason or reason
        self._fail_pending(NotConnected(f"the connection to {uri} dropped: {reason}"))
        return reason

    def _read(self, conn: websockets.sync.client.ClientConnection) -> str:
        """Match replies to requests until the connection ends; returns why it ended."""
        while True:
            try:
                message = conn.recv()
            except Exception as error:  # closed by either side, or broken
                return describe(error)
            with self._lock:
                waiter = self._pending.popleft() if self._pending else None
            if waiter is None:  # a reply nobody asked for: the stream is out of step
                conn.close()
                return "the server sent a reply to no request"
            if waiter.abandoned:
                self.stats.late_replies_dropped += 1
            if isinstance(message, str):
                self.stats.server_errors += 1
                waiter.deliver(None, ServerError(message))
                continue
            try:
                reply = unpack(message, self._limits)
                if not isinstance(reply, dict):
                    raise WireError("reply", f"expected a map, got {type(reply).__name__}")
            except WireError as error:
                self.stats.bad_replies += 1
                waiter.deliver(None, error)
                continue
            with self._lock:  # a usable reply (in time or not): the server works
                self._ring.replied()
            waiter.deliver(reply, None)
            if waiter.abandoned and self.on_late_reply is not None:
                self._call(self.on_late_reply, reply)

    # -- failback ----------------------------------------------------------------------------------
    def _probe_first(self) -> None:
        """While connected to another server, ask the first one's readiness every
        ``failback_probe_s``; once it is ready, go back to it between two requests."""
        first = self._ring.uris[0]
        while not self._closing.wait(self._probe_period_s()):
            with self._lock:
                on_backup = self._conn is not None and self._connected_to != first
            if on_backup and is_ready(first, min(self._failback_probe_s, 1.0)):
                self._fail_back(first)

    def _probe_period_s(self) -> float:
        """``failback_probe_s``, doubled for each failback in a row that did not reach the first
        server (ready, but full or serving a model this client refuses)."""
        doubled = self._failback_probe_s * 2 ** min(self._failbacks_in_a_row, 16)
        return min(doubled, max(MAX_FAILBACK_PROBE_S, self._failback_probe_s))

    def _fail_back(self, first: str) -> None:
        """End the current connection once no request is unanswered (waiting a second at most),
        so no reply is lost and nothing built for this session reaches the next; the connection
        thread then connects to ``first`` (`_move_on`)."""
        for _ in range(500):
            with self._lock:
                conn = self._conn
                if conn is None or self._drop_reason or self._closing.is_set():
                    return
                if not self._pending:
                    self._drop_reason = f"failing back to {first}: it is ready again"
                    self._failing_back = True
                    self.stats.failbacks += 1
                    self._failbacks_in_a_row += 1
                    break
            self._closing.wait(0.002)
        else:
            return  # the connection stayed busy: the next probe tries again
        conn.close()  # a clean close: the server ends the session at once

    def _fail_pending(self, error: ClientError) -> None:
        with self._lock:
            pending, self._pending = list(self._pending), collections.deque()
        for waiter in pending:
            waiter.deliver(None, error)

    def _notify(self, connected: bool, detail: str) -> None:
        """Tell on_change about a new state (not every failed attempt of a reconnection)."""
        if connected == self._reported:
            return
        self._reported = connected
        if self._on_change is not None:
            self._call(self._on_change, connected, detail)

    @staticmethod
    def _call(callback: Callable[..., None], *args: Any) -> None:
        try:
            callback(*args)
        except Exception:  # a caller's callback must not end the connection
            logger.exception("a PolicyClient callback failed")
