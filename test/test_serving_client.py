"""`PolicyClient` against a real oxygen-serve in this process (tiny checkpoint, real sockets):
deadlines (a late reply is dropped, handed to on_late_reply, and the stream stays in step), the
limit on unanswered requests, a server's error frame, and connecting to a server that starts
later."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from node_harness import wait_for

from oxygen_ros.engine.settings import EngineConfig
from oxygen_ros.policy_io.policy import load_policy
from oxygen_ros.serving.client import (
    MAX_IN_FLIGHT,
    DeadlineMissed,
    NotConnected,
    PolicyClient,
    ServerBehind,
    ServerError,
    server_uri,
)
from oxygen_ros.serving.server import PolicyServer, ServerSettings, serve_in_thread
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
