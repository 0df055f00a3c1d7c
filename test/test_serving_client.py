"""`PolicyClient` against a real oxygen-serve in this process (tiny checkpoint, real sockets):
deadlines (a late reply is dropped, handed to on_late_reply, and the stream stays in step), the
limit on unanswered requests, a server's error frame, connecting to a server that starts later,
failover between two servers (one that goes away, one that stops answering in time, one that
answers every frame with an error, one whose model the client refuses; one refused frame between
good replies is no reason to leave), failback to the first server once it is ready again (through
the node's `RemoteEngine`, measured and printed), the waits between attempts (`ServerRing`), and
the answer's token limit sent as ``ask/max_tokens``."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import websockets.sync.server
from node_harness import wait_for

from oxygen_ros.engine.settings import EngineConfig
from oxygen_ros.engine.types import Observation
from oxygen_ros.policy_io.policy import load_policy
from oxygen_ros.ros.remote_engine import RemoteEngine, ServedModel, ServerUnavailable
from oxygen_ros.serving.client import (
    ASK_MAX_TOKENS_KEY,
    MAX_IN_FLIGHT,
    DeadlineMissed,
    NotConnected,
    PolicyClient,
    ServerBehind,
    ServerError,
    health_url,
    server_uri,
)
from oxygen_ros.serving.server import PolicyServer, ServerSettings, serve_in_thread
from oxygen_ros.serving.server_ring import Backoff, ServerRing
from oxygen_ros.serving.sessions import LanguageSettings
from oxygen_ros.serving.wire import pack
from oxygen_ros.tools.benches.serve_processes import free_port

WAIT_S = 120.0


@pytest.fixture(scope="module")
def policy(tiny_checkpoint):
    return load_policy(tiny_checkpoint)


def observation(state_dim: int = 8) -> dict:
    return {
        "images": {"base_0_rgb": np.zeros((32, 32, 3), np.uint8)},
        "state": np.zeros(state_dim, np.float32),
        "prompt": "pick up the cup",
    }


def test_a_late_reply_is_dropped_and_the_next_request_gets_its_own(policy):
    server = PolicyServer(policy, EngineConfig(), ServerSettings(port=0))
    late: list[dict] = []
    with serve_in_thread(server) as running:
        with PolicyClient(running.uri, on_late_reply=late.append) as client:
            assert client.wait_connected(WAIT_S), client.last_error
            for _ in range(MAX_IN_FLIGHT):  # no model answers within 10 us
                with pytest.raises(DeadlineMissed):
                    client.infer(observation(), timeout_s=1e-5)
            with pytest.raises(ServerBehind):  # both still unanswered: nothing is sent
                client.infer(observation(), timeout_s=1e-5)
            assert wait_for(lambda: client.stats.late_replies_dropped == MAX_IN_FLIGHT, WAIT_S)
            assert len(late) == MAX_IN_FLIGHT and all(r["actions"].ndim == 2 for r in late)
            # the third frame's reply comes after the two late ones, and only it is returned
            assert client.infer(observation(), timeout_s=WAIT_S)["actions"].ndim == 2
            stats = client.stats
            assert (stats.requests, stats.replies, stats.deadline_misses, stats.behind) == (
                MAX_IN_FLIGHT + 1,
                1,
                MAX_IN_FLIGHT,
                1,
            )
            assert server.counters.get("frames_served") == MAX_IN_FLIGHT + 1
            assert stats.connects == 1  # one server: a slow one is waited for, never left


def test_a_server_error_frame_is_raised_and_the_connection_goes_on(policy):
    server = PolicyServer(policy, EngineConfig(), ServerSettings(port=0))
    with serve_in_thread(server) as running:
        with PolicyClient(running.uri) as client:
            assert client.wait_connected(WAIT_S), client.last_error
            with pytest.raises(ServerError, match="state: expected 8 values, got 3"):
                client.infer(observation(state_dim=3), timeout_s=WAIT_S)
            assert client.infer(observation(), timeout_s=WAIT_S)["actions"].shape[0] > 0
            assert client.stats.server_errors == 1 and client.stats.connects == 1


def test_without_a_server_infer_refuses_at_once_then_the_client_connects_when_it_starts(policy):
    port = free_port()
    changes: list[tuple[bool, str]] = []
    connected = threading.Event()

    def on_change(up: bool, detail: str) -> None:
        changes.append((up, detail))
        if up:
            connected.set()

    with PolicyClient(f"127.0.0.1:{port}", on_change=on_change) as client:
        assert wait_for(lambda: client.stats.failed_attempts >= 1, WAIT_S)
        with pytest.raises(NotConnected, match="connection refused"):
            client.infer(observation(), timeout_s=WAIT_S)
        server = PolicyServer(policy, EngineConfig(), ServerSettings(port=port))
        with serve_in_thread(server):
            assert connected.wait(WAIT_S), client.last_error
            assert client.infer(observation(), timeout_s=WAIT_S)["actions"].ndim == 2
    assert changes[0][0] is False and "connection refused" in changes[0][1]
    assert changes[1] == (True, f"ws://127.0.0.1:{port}")


def test_server_uri_takes_openpi_style_addresses():
    assert server_uri("gpu-box") == "ws://gpu-box:8000"
    assert server_uri("gpu-box:9000") == "ws://gpu-box:9000"
    assert server_uri("wss://gpu-box/robot") == "wss://gpu-box/robot"
    with pytest.raises(ValueError, match="only ws:// and wss://"):
        server_uri("http://gpu-box:8000")


def test_two_servers_the_client_moves_on_when_its_server_goes_away(policy):
    first = PolicyServer(policy, EngineConfig(), ServerSettings(port=0))
    second = PolicyServer(policy, EngineConfig(), ServerSettings(port=0))
    changes: list[tuple[bool, str]] = []
    with serve_in_thread(second) as running_second:
        with serve_in_thread(first) as running_first:
            client = PolicyClient(
                [running_first.uri, running_second.uri],
                on_change=lambda up, detail: changes.append((up, detail)),
            ).start()
            assert client.wait_connected(WAIT_S), client.last_error
            assert client.uri == running_first.uri and client.connection == 1
            assert client.infer(observation(), timeout_s=WAIT_S)["actions"].ndim == 2
        # the first server is gone: the client is on the second, a new session
        assert wait_for(lambda: client.connection == 2, WAIT_S), client.last_error
        with client:
            assert client.uri == running_second.uri and client.stats.switches == 1
            assert client.last_switch.startswith(f"{running_first.uri} -> {running_second.uri}")
            with pytest.raises(NotConnected, match="new session"):  # built for the first one
                client.infer(observation(), timeout_s=WAIT_S, connection=1)
            assert client.infer(observation(), timeout_s=WAIT_S, connection=2)["actions"].ndim == 2
            assert second.counters.get("frames_served") == 1
    assert changes[0] == (True, running_first.uri)
    assert changes[1][0] is False and changes[1][1].startswith(running_first.uri)
    assert changes[2] == (True, f"{running_second.uri} (moved on from {running_first.uri})")


def test_a_server_that_stops_answering_in_time_is_left_after_three_misses(policy):
    """Replies no deadline can meet (10 us): two misses and a request not sent (two still
    unanswered) make three in a row, and the client moves on to the next server."""
    first = PolicyServer(policy, EngineConfig(), ServerSettings(port=0))
    second = PolicyServer(policy, EngineConfig(), ServerSettings(port=0))
    with serve_in_thread(first) as running_first, serve_in_thread(second) as running_second:
        # no failback: the first server stays ready, and going back is tested on its own below
        uris = [running_first.uri, running_second.uri]
        with PolicyClient(uris, failback_probe_s=0) as client:
            assert client.wait_connected(WAIT_S), client.last_error
            for error in (DeadlineMissed, DeadlineMissed, ServerBehind):
                with pytest.raises(error):
                    client.infer(observation(), timeout_s=1e-5)
            assert wait_for(lambda: client.stats.switches == 1 and client.connected, WAIT_S)
            assert client.uri == running_second.uri
            assert "3 requests in a row got no reply within their deadline" in client.last_switch
            assert client.infer(observation(), timeout_s=WAIT_S)["actions"].ndim == 2


@contextlib.contextmanager
def refusing_server(metadata: dict) -> Iterator[str]:
    """A server speaking openpi's protocol that answers every frame with an error text frame (and
    keeps the connection open, as oxygen-serve does for a refused frame); yields its address."""

    def handler(connection) -> None:
        connection.send(pack(metadata))
        for _ in connection:
            connection.send("state: this server refuses every frame")

    with websockets.sync.server.serve(handler, "127.0.0.1", 0, compression=None) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield f"ws://127.0.0.1:{server.socket.getsockname()[1]}"
        finally:
            server.shutdown()
            thread.join(WAIT_S)


def test_a_server_that_answers_only_errors_is_left_after_three(policy):
    good = PolicyServer(policy, EngineConfig(), ServerSettings(port=0))
    with serve_in_thread(good) as running_good:
        with PolicyClient(running_good.uri) as probe:  # the refusing one claims the same model
            assert probe.wait_connected(WAIT_S), probe.last_error
            metadata = dict(probe.metadata)
        with refusing_server(metadata) as refusing:
            with PolicyClient([refusing, running_good.uri]) as client:
                assert client.wait_connected(WAIT_S), client.last_error
                assert client.uri == refusing
                for _ in range(3):
                    with pytest.raises(ServerError, match="refuses every frame"):
                        client.infer(observation(), timeout_s=WAIT_S)
                assert wait_for(lambda: client.stats.switches == 1 and client.connected, WAIT_S)
                assert client.uri == running_good.uri
                assert client.last_switch.startswith(f"{refusing} -> {running_good.uri}: ")
                assert "the last: an error: state: this server refuses" in client.last_switch
                assert client.infer(observation(), timeout_s=WAIT_S)["actions"].ndim == 2
                # its /healthz is no 200: the client does not go back to it
                assert client.stats.failbacks == 0 and client.stats.server_errors == 3


def test_one_refused_frame_between_good_replies_keeps_the_server(policy):
    first = PolicyServer(policy, EngineConfig(), ServerSettings(port=0))
    second = PolicyServer(policy, EngineConfig(), ServerSettings(port=0))
    with serve_in_thread(first) as running_first, serve_in_thread(second) as running_second:
        with PolicyClient([running_first.uri, running_second.uri]) as client:
            assert client.wait_connected(WAIT_S), client.last_error
            for state_dim in (3, 3, 8, 3, 8, 3, 3, 8):  # never three errors in a row
                if state_dim == 8:
                    assert client.infer(observation(), timeout_s=WAIT_S)["actions"].ndim == 2
                    continue
                with pytest.raises(ServerError, match="state: expected 8 values, got 3"):
                    client.infer(observation(state_dim), timeout_s=WAIT_S)
            assert client.stats.server_errors == 5
            assert client.uri == running_first.uri and client.connected
            assert (client.stats.connects, client.stats.switches) == (1, 0)
    assert second.counters.get("sessions_opened") == 0


def test_health_url_of_a_websocket_address():
    assert health_url("ws://gpu-box:9000") == "http://gpu-box:9000/healthz"
    assert health_url("wss://gpu-box/robot") == "https://gpu-box/healthz"
    assert health_url("gpu-box") == "http://gpu-box:8000/healthz"


def test_the_node_fails_back_to_its_first_server_once_it_is_ready(policy, capsys):
    """The node's engine (`RemoteEngine`) ticks over the first server; it goes away, the engine
    moves on to the second; the first comes back on its port and reports ready once warmed up.
    The engine is back on it (a new session) within a few probe periods, and no chunk returned
    after the move back was computed by the second server's session (from an observation the
    node had sent it)."""
    engine_config = EngineConfig(chunk_continuity="rtc")
    port = free_port()
    second = PolicyServer(policy, engine_config, ServerSettings(port=0))
    ticks: list[tuple[float, float, int, int, str]] = []  # sent, done, conn before, after, what
    # when the client connected to the first server again, and the second's frames by then
    back: list[tuple[float, int]] = []

    def on_change(up: bool, detail: str) -> None:
        if up and detail.startswith(f"ws://127.0.0.1:{port} (moved on from"):
            back.append((time.monotonic(), second.counters.get("frames_served")))

    with serve_in_thread(second) as running_second:
        first = PolicyServer(policy, engine_config, ServerSettings(port=port))
        first_stack = contextlib.ExitStack()
        first_stack.enter_context(serve_in_thread(first))
        client = PolicyClient([f"ws://127.0.0.1:{port}", running_second.uri], on_change=on_change)
        client.start()
        try:
            assert client.wait_connected(WAIT_S), client.last_error
            model = ServedModel.from_metadata(client.metadata)
            engine = RemoteEngine(client, model, lambda: WAIT_S, action_dims=8)
            stop = threading.Event()

            def tick_loop() -> None:
                state = np.zeros(8, np.float32)
                image = np.zeros((32, 32, 3), np.uint8)
                while not stop.is_set():
                    sent = time.monotonic()
                    obs = Observation({"base_0_rgb": image}, state, "pick up the cup", sent)
                    before = client.connection
                    try:
                        chunk = engine.act(obs)
                        what = "chunk"
                        engine.chunk_published(chunk.frame_id, chunk.actions, 0.0)
                    except ServerUnavailable as error:
                        what = error.reason
                    ticks.append((sent, time.monotonic(), before, client.connection, what))
                    stop.wait(0.1)  # a 10 Hz node

            ticker = threading.Thread(target=tick_loop, daemon=True)
            ticker.start()
            assert wait_for(lambda: sum(t[4] == "chunk" for t in ticks) >= 2, WAIT_S)
            first_stack.close()  # the first server goes away
            assert wait_for(lambda: client.uri == running_second.uri and client.connected, WAIT_S)
            on_second = second.counters.get("frames_served")
            assert wait_for(lambda: second.counters.get("frames_served") >= on_second + 3, WAIT_S)
            first = PolicyServer(policy, engine_config, ServerSettings(port=port))
            with serve_in_thread(first):  # returns once listening and warmed up: ready
                ready_at = time.monotonic()
                assert wait_for(lambda: bool(back), WAIT_S), client.last_error
                assert wait_for(lambda: first.counters.get("frames_served") >= 3, WAIT_S)
                stop.set()
                ticker.join(WAIT_S)
                assert client.stats.failbacks == 1 and client.stats.switches == 2
                assert "failing back to" in client.last_switch
                assert engine.sessions == 3  # first, second, first again: each a new session
                served_second = second.counters.get("frames_served")
            returned_at, second_by_then = back[0]
            after = [t for t in ticks if t[1] > returned_at]
            chunks_after = [t for t in after if t[4] == "chunk"]
            stale = [t for t in chunks_after if t[2] != t[3] or t[0] < returned_at]
            assert chunks_after and not stale, ticks
            gap = [t for t in ticks if t[1] > ready_at and t[4] != "chunk"]
            assert all(t[4] == "disconnected" for t in gap), gap  # never a late or refused one
            assert served_second == second_by_then  # the second served nothing after the move
        finally:
            client.close()
            first_stack.close()
    with capsys.disabled():
        print(
            f"\nfailback: back on the first server {returned_at - ready_at:.2f} s after it was "
            f"ready (probe every 1 s); {len(gap)} tick(s) without a chunk meanwhile; "
            f"{len(stale)} stale chunks out of {len(chunks_after)} after the move back"
        )


def test_a_server_whose_model_the_client_refuses_is_skipped(policy):
    wrong = PolicyServer(policy, EngineConfig(), ServerSettings(port=0))
    right = PolicyServer(policy, EngineConfig(), ServerSettings(port=0))

    def only(port: int):
        def check(metadata: dict) -> None:
            if f":{port}" not in client.uri:
                raise ValueError("not the robot this client drives")

        return check

    with serve_in_thread(wrong) as running_wrong, serve_in_thread(right) as running_right:
        client = PolicyClient([running_wrong.uri, running_right.uri])
        client.check_metadata = only(running_right.port)
        with client:
            assert client.wait_connected(WAIT_S), client.last_error
            assert client.uri == running_right.uri and client.stats.failed_attempts >= 1
            assert client.stats.switches == 0  # never connected to the refused one


def test_the_waits_between_attempts():
    """One server: the backoff after each failure in a row. Two: the next server at once, the
    backoff only after a whole round failed; a reply starts the waits over."""
    backoff = Backoff(first_s=0.1, max_s=0.4)
    alone = ServerRing(["ws://a:1"], backoff)
    assert [alone.move_on() for _ in range(4)] == [0.1, 0.2, 0.4, 0.4]
    pair = ServerRing(["ws://a:1", "ws://b:1"], backoff)
    assert [pair.move_on() for _ in range(5)] == [0.0, 0.1, 0.0, 0.2, 0.0]
    assert pair.current == "ws://b:1"
    pair.replied()
    assert pair.move_on() == 0.0 and pair.current == "ws://a:1"
    assert [pair.unanswered() for _ in range(3)] == [False, False, True]
    assert pair.fail_back() == 0.0 and pair.current == "ws://a:1"  # at once, to the first
    assert not any(alone.unanswered() for _ in range(5))
    with pytest.raises(ValueError, match="more than once"):
        ServerRing(["ws://a:1", "ws://a:1"])


def test_the_answer_is_limited_to_the_clients_max_tokens(policy):
    """ask/max_tokens (listed in the metadata) limits the answer; the server's own limit (24
    here) still caps it; a limit below 1 is refused naming the field."""
    server = PolicyServer(
        policy, EngineConfig(), ServerSettings(port=0, language=LanguageSettings(max_tokens=24))
    )
    with serve_in_thread(server) as running, PolicyClient(running.uri) as client:
        assert client.wait_connected(WAIT_S), client.last_error
        assert ASK_MAX_TOKENS_KEY in client.metadata["observation"]["keys"]
        with pytest.raises(ServerError, match="ask/max_tokens: expected at least 1 token"):
            client.infer({**observation(), "ask": "what?", ASK_MAX_TOKENS_KEY: 0}, WAIT_S)
        first = client.infer({**observation(), "ask": "what?", ASK_MAX_TOKENS_KEY: 2}, WAIT_S)
        answers = list(first.get("language", []))
        for _ in range(20):
            if any(entry.get("final") for entry in answers):
                break
            answers += client.infer(observation(), timeout_s=WAIT_S).get("language", [])
        final = [entry for entry in answers if entry.get("final")]
        assert final and final[0]["finish_reason"] == "length"  # random weights never say eos
        (session,) = server.sessions.sessions()
        assert session.engine.tokens_generated == 2
