"""Idle sessions do not hold places: authorised clients that connect and send nothing fill every
place, are closed after ``idle_timeout_s`` with a close code and reason the client can read,
counted in ``/stats``, and a new robot is served at once; under pressure (every place taken, a
robot connecting) the session idle longest yields at once it has been idle ``idle_grace_s``,
those that never sent an observation first; a robot sending observations is never idle, a client
sending only refused messages is; the node's client reconnects by itself."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import websockets
from serve_helpers import OpenpiClient, droid_observation, wait_for

from oxygen_ros.engine.settings import EngineConfig
from oxygen_ros.policy_io.policy import load_policy
from oxygen_ros.serving.client import NotConnected, PolicyClient
from oxygen_ros.serving.server import PolicyServer, ServerSettings, serve_in_thread
from oxygen_ros.tools.serve import main as serve_main

KEY = "idle-test-key"
IDLE_S = 1.0


@pytest.fixture(scope="module")
def droid(tiny_checkpoint):
    return load_policy(tiny_checkpoint, robot="droid")


def make_server(policy, **settings) -> PolicyServer:
    config = EngineConfig(max_active_requests=2)
    settings = ServerSettings(port=0, api_key=KEY, idle_timeout_s=IDLE_S, **settings)
    return PolicyServer(policy, config, settings)


def stats(uri: str) -> dict:
    """``GET /stats`` with the key, as an operator reads it."""
    request = urllib.request.Request(
        uri.replace("ws://", "http://") + "/stats", headers={"Authorization": f"Api-Key {KEY}"}
    )
    with urllib.request.urlopen(request, timeout=30) as reply:
        return json.loads(reply.read())


def closed_by_server(client: OpenpiClient, timeout_s: float = 60.0) -> websockets.ConnectionClosed:
    """Wait for the server to close ``client``'s connection; the exception says how."""
    with pytest.raises(websockets.ConnectionClosed) as closed:
        client.ws.recv(timeout_s)
    return closed.value


def test_idle_sessions_give_their_places_back_with_a_readable_reason(droid):
    server = make_server(droid, max_sessions=3)
    with serve_in_thread(server) as running:
        idle = [OpenpiClient(running.uri, api_key=KEY) for _ in range(3)]
        for client in idle:
            close = closed_by_server(client).rcvd
            assert close.code == 1001
            assert close.reason.startswith(f"idle: no observation for {IDLE_S:g} s")
            client.close()
        # the places were given back before the idle clients were told: served at once
        with OpenpiClient(running.uri, api_key=KEY) as robot:
            assert robot.infer(droid_observation(1))["actions"].shape == (10, 8)
            counted = stats(running.uri)
        assert counted["sessions_closed_idle"] == 3
        assert counted["sessions_closed"] == 3 and counted["sessions_open"] == 1


def test_a_working_robot_is_served_while_idle_sessions_hold_every_place(droid, capsys):
    """Default flags (8 places, 600 s idle timeout, the default grace): eight authorised clients
    connect; the first sends one observation (a robot paused between episodes), the others
    nothing. A robot connecting with openpi's client is served: the longest-idle session that
    never sent an observation yields, reads why, and the rest keep their places."""
    settings = ServerSettings(port=0, api_key=KEY)
    assert settings.idle_timeout_s == 600.0 and settings.max_sessions == 8
    server = PolicyServer(droid, EngineConfig(max_active_requests=2), settings)
    with serve_in_thread(server) as running:
        paused = OpenpiClient(running.uri, api_key=KEY)
        assert paused.infer(droid_observation(0))["actions"].shape == (10, 8)
        idle = [OpenpiClient(running.uri, api_key=KEY) for _ in range(7)]
        assert stats(running.uri)["sessions_open"] == 8
        started = time.monotonic()
        with OpenpiClient(running.uri, api_key=KEY) as robot:  # openpi's: no retry on refusal
            assert robot.infer(droid_observation(1))["actions"].shape == (10, 8)
            served_s = time.monotonic() - started
            close = closed_by_server(idle[0]).rcvd
            assert close.code == 1013
            assert close.reason.startswith(
                f"idle under pressure: no observation for {settings.idle_grace_s:g} s or more, "
                "all 8 places taken; place given to a new robot"
            )
            assert robot.infer(droid_observation(2))["actions"].shape == (10, 8)
            counted = stats(running.uri)
        assert counted["sessions_evicted_idle"] == 1 and counted["sessions_open"] == 8
        assert "sessions_closed_idle" not in counted  # no idle timeout without pressure
        # the paused robot and the six others kept their places
        assert paused.infer(droid_observation(3))["actions"].shape == (10, 8)
        for client in [paused, *idle]:
            client.close()
    with capsys.disabled():
        print(f"\nidle pressure: the working robot was served {served_s:.2f} s after connecting")


def test_observations_keep_a_session_refused_messages_do_not(droid):
    server = make_server(droid)
    with serve_in_thread(server) as running:
        robot = OpenpiClient(running.uri, api_key=KEY)
        chatter = OpenpiClient(running.uri, api_key=KEY)
        chatter_close = None
        end = time.monotonic() + 3 * IDLE_S
        frame = 0
        while time.monotonic() < end:  # observations back to back: never idle
            assert robot.infer(droid_observation(frame))["actions"].shape == (10, 8)
            frame += 1
            if chatter_close is None:
                try:  # a text frame is refused with an error, and is no observation
                    chatter.ws.send("hello?")
                    assert chatter.ws.recv(30).startswith("message: expected a binary")
                except websockets.ConnectionClosed as closed:
                    chatter_close = closed.rcvd
        assert chatter_close is not None and chatter_close.code == 1001
        assert robot.infer(droid_observation(frame))["actions"].shape == (10, 8)
        robot.close()
        chatter.close()
    assert server.counters.get("sessions_closed_idle") == 1
    assert server.counters.get("refused_text_frame") >= 1


def test_the_node_client_reconnects_after_an_idle_close(droid):
    server = make_server(droid)
    with serve_in_thread(server) as running:
        with PolicyClient(running.uri, api_key=KEY) as client:
            assert client.wait_connected(60)
            first = client.metadata["session_id"]
            # idle: closed, then connected again on a new session without being asked
            assert wait_for(lambda: client.stats.connects >= 2 and client.connected, 60)
            assert "code 1001: idle: no observation" in client.last_error
            assert client.metadata["session_id"] > first
            assert served(client)


def served(client: PolicyClient, attempts: int = 5) -> bool:
    """Whether ``client`` gets actions (again after a reconnection, should it come in between)."""
    for _ in range(attempts):
        client.wait_connected(60)
        try:
            return client.infer(droid_observation(1), timeout_s=60)["actions"].shape == (10, 8)
        except NotConnected:
            continue
    return False


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
@pytest.mark.parametrize(
    ("flag", "zero"), [("--idle-timeout-s", "never close"), ("--idle-grace-s", "yield at once")]
)
def test_bad_idle_seconds_are_refused_before_loading(flag, zero, value, capsys):
    with pytest.raises(SystemExit) as exited:
        serve_main(["--checkpoint", "/nonexistent", flag, value])
    assert exited.value.code == 2
    assert f"{flag}: expected seconds >= 0 (0: {zero}), got {value!r}" in capsys.readouterr().err


@pytest.mark.parametrize("seconds", [-1.0, float("nan"), float("inf")])
@pytest.mark.parametrize("field", ["idle_timeout_s", "idle_grace_s"])
def test_server_settings_refuse_bad_idle_seconds(field, seconds):
    with pytest.raises(ValueError, match=f"{field} must be finite seconds >= 0"):
        ServerSettings(**{field: seconds})
