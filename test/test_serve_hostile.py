"""Hostile and unlucky clients: a full server, 100 connections at once, a client that never
reads, one that disconnects mid-inference, a full frame queue. Nothing crashes, a well-behaved
client keeps being served with the right actions, every refusal is counted."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import websockets
from serve_helpers import OpenpiClient, droid_observation, openpi_pack, wait_for

from oxygen_ros.engine.settings import EngineConfig
from oxygen_ros.policy_io.policy import load_policy
from oxygen_ros.serving.batching import BatchSettings
from oxygen_ros.serving.server import PolicyServer, ServerSettings, serve_in_thread
from oxygen_ros.serving.sessions import Session


@pytest.fixture(scope="module")
def droid(tiny_checkpoint):
    return load_policy(tiny_checkpoint, robot="droid")


def make_server(policy, **settings) -> PolicyServer:
    config = EngineConfig(max_active_requests=2)
    return PolicyServer(policy, config, ServerSettings(port=0, **settings))


def served(client: OpenpiClient, frames: int = 2) -> bool:
    """Whether ``client`` gets well-formed actions for ``frames`` observations in a row."""
    for frame in range(frames):
        actions = client.infer(droid_observation(frame))["actions"]
        if actions.shape != (10, 8) or not np.isfinite(actions).all():
            return False
    return True


def test_sessions_beyond_the_limit_are_refused_when_none_is_idle(droid):
    """Two robots sending observations back to back hold both places: a third is refused (503 at
    the handshake, or 1013 "server full" once the grace passed with no session idle that long),
    and the working robots are never evicted for it."""
    server = make_server(droid, max_sessions=2, idle_grace_s=1.0)
    with serve_in_thread(server) as running:
        robots = [OpenpiClient(running.uri), OpenpiClient(running.uri)]
        stop = threading.Event()
        frames = [0, 0]

        def work(i: int) -> None:
            while not stop.is_set():
                assert served(robots[i], 1)
                frames[i] += 1

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        try:
            assert wait_for(lambda: min(frames) >= 1)
            try:
                OpenpiClient(running.uri).close()
                refusal = "admitted"
            except websockets.InvalidStatus as error:
                assert b"2 sessions" in error.response.body
                refusal = error.response.status_code
            except websockets.ConnectionClosed as error:
                refusal = error.rcvd.reason if error.rcvd else "no close frame"
            assert refusal in (503, "server full: 2 sessions open"), refusal
            seen = list(frames)
            assert wait_for(lambda: all(f > s for f, s in zip(frames, seen, strict=True)))
        finally:
            stop.set()
            for thread in threads:
                thread.join(120)
        for robot in robots:
            robot.close()
        # a closed session frees its place
        assert wait_for(lambda: len(server.sessions) == 0)
        with OpenpiClient(running.uri) as again:
            assert served(again)
    assert server.counters.get("refused_sessions_full") == 1
    assert server.counters.get("sessions_evicted_idle") == 0


def test_a_hundred_connections_at_once(droid):
    server = make_server(droid, max_sessions=4)
    outcomes: list = [None] * 100

    def connect(i: int, uri: str) -> None:
        try:
            with OpenpiClient(uri) as client:
                outcomes[i] = "served" if served(client, 1) else "bad actions"
        except websockets.InvalidStatus as error:
            outcomes[i] = error.response.status_code
        except websockets.ConnectionClosed as error:
            # lost the race for the last place after the handshake: closed with 1013
            full = error.rcvd is not None and error.rcvd.code == 1013
            outcomes[i] = "full" if full else error

    with serve_in_thread(server) as running:
        threads = [threading.Thread(target=connect, args=(i, running.uri)) for i in range(100)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert all(outcome in ("served", 503, "full") for outcome in outcomes), outcomes
        assert outcomes.count("served") >= 1
        with OpenpiClient(running.uri) as latecomer:
            assert served(latecomer)
    counted = server.counters.get("refused_sessions_full")
    assert counted == outcomes.count(503) + outcomes.count("full")
    assert server.counters.get("sessions_opened") == outcomes.count("served") + 1


def test_a_client_that_never_reads_does_not_stall_the_others(droid):
    server = make_server(droid, batch=BatchSettings(window_s=0.001))
    with serve_in_thread(server) as running:
        with OpenpiClient(running.uri) as sink, OpenpiClient(running.uri) as good:
            for frame in range(20):  # replies pile up unread
                sink.ws.send(openpi_pack(droid_observation(frame)))
            assert served(good, 5)
        assert wait_for(lambda: len(server.sessions) == 0)
    assert server.counters.get("sessions_closed") == 2


def test_a_client_that_disconnects_mid_inference(droid):
    server = make_server(droid)
    with serve_in_thread(server) as running:
        for frame in range(3):
            quitter = OpenpiClient(running.uri)
            quitter.ws.send(openpi_pack(droid_observation(frame)))
            quitter.close()  # before the reply
        with OpenpiClient(running.uri) as good:
            assert served(good, 3)
        assert wait_for(lambda: server.counters.get("sessions_closed") == 4)
        assert len(server.sessions) == 0


def test_frames_beyond_the_queue_limit_are_refused(droid):
    # three sessions open, so a first frame waits (a long window) for the other two; the queue
    # holds one frame, so a second one is refused at once
    server = make_server(
        droid, batch=BatchSettings(window_s=600.0, max_queued_frames=1), max_sessions=3
    )
    with serve_in_thread(server) as running:
        waiting, refused, idle = (OpenpiClient(running.uri) for _ in range(3))
        waiting.ws.send(openpi_pack(droid_observation(1)))
        assert wait_for(lambda: server.stats()["frames_waiting"] == 1)
        with pytest.raises(RuntimeError, match="server busy: 1 frames already wait"):
            refused.infer(droid_observation(2))
        refused.close()  # the sessions leaving end the wait: the batch runs
        idle.close()
        assert waiting.reply()["actions"].shape == (10, 8)
        assert served(waiting, 1)  # and the queue serves again
        waiting.close()
    assert server.counters.get("refused_queue_full") == 1


def test_a_fault_outside_the_engine_answers_the_batch_and_serving_goes_on(droid, monkeypatch):
    real_acted = Session.acted
    calls = []

    def acted_failing_once(self, chunk, *language):
        calls.append(self.session_id)
        if len(calls) == 1:
            raise RuntimeError("injected fault after the actions")
        return real_acted(self, chunk, *language)

    server = make_server(droid)
    with serve_in_thread(server) as running, OpenpiClient(running.uri) as client:
        monkeypatch.setattr(Session, "acted", acted_failing_once)  # after the warm-up frame
        with pytest.raises(RuntimeError, match="inference failed: RuntimeError: injected fault"):
            client.infer(droid_observation(1))
        assert served(client, 2)
    assert server.counters.get("batch_failures") == 1
