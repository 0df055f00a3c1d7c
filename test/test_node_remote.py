"""The node as a client of ``oxygen-serve`` (``engine: remote``), over real sockets and DDS.

A real ``oxygen-serve`` process serves the tiny checkpoint with an API key; the real node (its
own process) ticks over it: chunks and trajectories come from the server, an Ask goal is answered
by it, a reply past its deadline is dropped and counted, and when the server goes away and comes
back the node keeps ticking, says disconnected and then reconnected on /diagnostics. The
configure-time checks (a wrong key, a robot the server does not serve), the parameters naming the
servers, the answer's token limit reaching the server, and what restarts when the engine moves on
to another server (RTC feedback, questions in flight) run against servers in this process.
The whole node failing over between two oxygen-serve processes is test_node_failover.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from node_harness import (
    STATE_ACTIVE,
    AskClient,
    NodeProcess,
    Probe,
    wait_for,
)

from oxygen_ros.engine.requests import SamplingParams
from oxygen_ros.engine.settings import EngineConfig
from oxygen_ros.engine.types import Observation
from oxygen_ros.policy_io.policy import load_policy
from oxygen_ros.ros.params import PARAMETERS, NodeSettings, SettingsError
from oxygen_ros.ros.remote_engine import ServerRefused
from oxygen_ros.ros.remote_setup import connect_remote_engine
from oxygen_ros.serving.client import ASK_MAX_TOKENS_KEY, PUBLISHED_CHUNK_KEY
from oxygen_ros.serving.server import PolicyServer, ServerSettings, serve_in_thread
from oxygen_ros.tools.benches.serve_processes import ServeProcess, free_port
from oxygen_ros.tools.make_bag import camera_topic, joint_names, write_synthetic_bag
from oxygen_ros.tools.make_checkpoint import (
    LEROBOT_CAMERAS,
    LEROBOT_STATE_DIM,
    make_lerobot_checkpoint,
)

pytestmark = [pytest.mark.ros, pytest.mark.slow]
API_KEY = "remote-test-key"
JOINTS = 8  # the tiny checkpoint's state width, which oxygen-serve requires exactly
WAIT_S = 120.0  # generous: nothing here depends on how busy the machine is


def start_server(checkpoint: Path, port: int, key_file: Path, log: Path) -> ServeProcess:
    """``oxygen-serve`` on the tiny checkpoint with the API key, narrating every 2 frames, each
    session's chunks continuing the previous one (RTC, from what the node published)."""
    args = ["--api-key-file", str(key_file), "--narration-every", "2", "--chunk-continuity", "rtc"]
    server = ServeProcess(checkpoint, port, log, args)
    server.wait_healthy(WAIT_S)
    return server


@pytest.fixture(scope="module")
def bag(tmp_path_factory):
    """3 s of two 64x64 cameras and 8 joints."""
    return write_synthetic_bag(
        tmp_path_factory.mktemp("remote_bag") / "bag",
        duration_s=3.0,
        width=64,
        height=64,
        num_joints=JOINTS,
    )


def test_the_node_ticks_over_oxygen_serve_and_outlives_a_server_restart(
    tiny_checkpoint, bag, tmp_path
):
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY + "\n")
    port = free_port()
    server = start_server(tiny_checkpoint, port, key_file, tmp_path / "serve.log")
    node = NodeProcess(
        {
            "engine": "remote",
            "server_uri": f"127.0.0.1:{port}",
            "server_api_key_file": str(key_file),
            "server_timeout_ms": 30_000.0,  # no deadline miss from a busy machine
            "camera_topics": [camera_topic("base"), camera_topic("wrist")],
            "camera_slots": ["base_0_rgb", "left_wrist_0_rgb"],
            "joint_names": joint_names(JOINTS),
            "rate_hz": 5.0,
            "action_dt": 0.5,  # a chunk spans 5 s: its trajectory outlives a slow round trip
            "max_observation_age_s": 30.0,
        },
        tmp_path,
    )
    probe = Probe()
    try:
        probe.wait_active(node, WAIT_S)
        playback = probe.play_in_background(bag)
        try:
            _ticks_and_answers_over_the_server(probe, node, port)
            _a_late_reply_is_dropped_and_counted(probe)
            server.stop()
            _disconnected_the_node_keeps_ticking(probe, node)
            server = start_server(tiny_checkpoint, port, key_file, tmp_path / "serve.log")
            _reconnected_chunks_flow_again(probe, node)
        finally:
            playback.stop()
        assert node.stop() == 0, node.log()[-3000:]
    finally:
        probe.close()
        node.stop()
        server.stop()


def _diagnostics(probe: Probe, **expected: str) -> bool:
    values = probe.fresh_diagnostics(30.0)
    return all(values.get(key) == value for key, value in expected.items())


def _counter(probe: Probe, key: str) -> int:
    return int(probe.fresh_diagnostics(30.0).get(key, 0))


def _ticks_and_answers_over_the_server(probe: Probe, node: NodeProcess, port: int) -> None:
    assert wait_for(lambda: len(probe.chunks) >= 3, WAIT_S), node.log()[-3000:]
    assert wait_for(lambda: len(probe.trajectories) >= 3, WAIT_S), node.log()[-3000:]
    chunk = probe.chunks[-1][1]
    assert len(chunk.joint_names) == JOINTS
    assert wait_for(lambda: _diagnostics(probe, server_connected="true"), WAIT_S)
    values = probe.fresh_diagnostics(30.0)
    assert values["server_uri"] == f"ws://127.0.0.1:{port}"
    assert values["server_name"] == "oxygen-serve" and values["server_robot"] == "generic"
    assert values["server_rtc_feedback"] == "true" and values["server_errors"] == "0"
    ask = AskClient(probe, wait_s=WAIT_S)
    handle = ask.send("what is on the table?", max_tokens=4)
    assert handle.accepted
    result = ask.result(handle).result
    # the server's answer, whatever ended it (a busy server may stall it; a lost one fails it)
    assert result.finish_reason in ("length", "eos", "stop", "stalled"), (
        result.finish_reason,
        result.detail,
    )
    # narrations the server decides (--narration-every 2) are published by the node
    assert wait_for(lambda: any(m.kind == "narration" for m in probe.narrations), WAIT_S)


def _a_late_reply_is_dropped_and_counted(probe: Probe) -> None:
    """A deadline no round trip can meet (10 us): no action, counted; the reply is dropped."""
    assert probe.set("server_timeout_ms", 0.01).successful
    assert wait_for(lambda: _counter(probe, "no_action_server_late") >= 2, WAIT_S)
    assert wait_for(lambda: _counter(probe, "server_late_replies_dropped") >= 1, WAIT_S)
    assert probe.set("server_timeout_ms", 30_000.0).successful


def _disconnected_the_node_keeps_ticking(probe: Probe, node: NodeProcess) -> None:
    assert wait_for(lambda: _diagnostics(probe, server_connected="false"), WAIT_S)
    before = _counter(probe, "no_action_server_disconnected")
    assert wait_for(lambda: _counter(probe, "no_action_server_disconnected") > before, WAIT_S), (
        "the node stopped ticking without its server"
    )
    assert node.alive() and probe.get_state() == STATE_ACTIVE
    assert probe.fresh_diagnostics(30.0)["server_last_error"]


def _reconnected_chunks_flow_again(probe: Probe, node: NodeProcess) -> None:
    assert wait_for(lambda: _diagnostics(probe, server_connected="true"), WAIT_S), node.log()[
        -3000:
    ]
    assert int(probe.fresh_diagnostics(30.0)["server_reconnects"]) >= 1
    seen = len(probe.chunks)
    assert wait_for(lambda: len(probe.chunks) >= seen + 2, WAIT_S), node.log()[-3000:]
    assert probe.get_state() == STATE_ACTIVE
    log = node.log()
    assert "no connection to oxygen-serve" in log and log.count("connected to oxygen-serve") >= 2


# -- configure-time checks, against a server in this process ------------------------------------
def _settings(**overrides) -> NodeSettings:
    values = {spec.name: spec.default for spec in PARAMETERS}
    values.update({"joint_names": joint_names(JOINTS), "engine": "remote", **overrides})
    return NodeSettings.from_values(values)


class _Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, line: str) -> None:
        self.lines.append(line)

    warning = info


@pytest.fixture(scope="module")
def keyed_server(tiny_checkpoint):
    server = PolicyServer(
        load_policy(tiny_checkpoint), EngineConfig(), ServerSettings(port=0, api_key=API_KEY)
    )
    with serve_in_thread(server) as running:
        yield running


def test_configure_reaches_the_server_with_its_key(keyed_server, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY)
    log = _Log()
    engine = connect_remote_engine(
        _settings(server_uri=keyed_server.uri, server_api_key_file=str(key_file)), log, lambda: 30.0
    )
    try:
        assert engine.policy.robot == "generic" and engine.policy.action_horizon > 0
        assert any("remote engine: oxygen-serve" in line for line in log.lines)
    finally:
        engine.close()


def test_configure_says_why_a_wrong_key_gets_no_connection(keyed_server, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("not-the-key")
    settings = _settings(
        server_uri=keyed_server.uri,
        server_api_key_file=str(key_file),
        server_connect_timeout_s=2.0,
    )
    with pytest.raises(ConnectionError, match="HTTP 403.*API key"):
        connect_remote_engine(settings, _Log(), lambda: 30.0)


def test_configure_refuses_a_robot_the_server_does_not_serve(keyed_server, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY)
    settings = _settings(
        server_uri=keyed_server.uri,
        server_api_key_file=str(key_file),
        robot="droid",
        camera_slots=["base_0_rgb", "left_wrist_0_rgb"],
    )
    with pytest.raises(SettingsError, match="serves robot 'generic' but robot is 'droid'"):
        connect_remote_engine(settings, _Log(), lambda: 30.0)


def test_engine_remote_needs_a_server_uri():
    with pytest.raises(SettingsError, match="engine remote needs server_uri .* or server_uris"):
        _settings()
    with pytest.raises(SettingsError, match="engine must be one of local, remote"):
        _settings(engine="cloud", server_uri="ws://gpu-box:8000")


def test_one_server_in_server_uri_or_several_in_server_uris():
    assert _settings(server_uri="ws://a:8000").servers == ("ws://a:8000",)
    several = _settings(server_uris=["ws://a:8000", "ws://b:8000"])
    assert several.servers == ("ws://a:8000", "ws://b:8000")
    with pytest.raises(SettingsError, match="server_uri .* or server_uris .*, not both"):
        _settings(server_uri="ws://a:8000", server_uris=["ws://b:8000"])
    with pytest.raises(SettingsError, match="server_uris must be unique"):
        _settings(server_uris=["ws://a:8000", "ws://a:8000"])
    with pytest.raises(SettingsError, match="server_uris must not contain empty"):
        _settings(server_uris=["ws://a:8000", " "])


def test_a_served_lerobot_folder_is_driven_as_robot_generic(tmp_path):
    """oxygen-serve names a LeRobot folder's robot ``lerobot`` (the generic adapter with the
    folder's widths); the node, robot generic as for a local LeRobot folder, drives it."""
    folder = make_lerobot_checkpoint(tmp_path / "lerobot", "tiny")
    server = PolicyServer(load_policy(folder), EngineConfig(), ServerSettings(port=0))
    with serve_in_thread(server) as running:
        settings = _settings(
            server_uri=running.uri,
            joint_names=joint_names(LEROBOT_STATE_DIM),
            camera_slots=list(LEROBOT_CAMERAS),
        )
        engine = connect_remote_engine(settings, _Log(), lambda: 60.0)
        try:
            assert engine.policy.robot == "lerobot"
            images = {LEROBOT_CAMERAS[0]: np.zeros((32, 32, 3), np.uint8)}
            chunk = engine.act(Observation(images, np.zeros(LEROBOT_STATE_DIM), "pick", 1.0))
            assert chunk.actions.shape[1] == LEROBOT_STATE_DIM
        finally:
            engine.close()


def test_a_frame_the_server_refuses_names_the_field_and_the_next_frame_is_served(
    keyed_server, tmp_path
):
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY)
    settings = _settings(server_uri=keyed_server.uri, server_api_key_file=str(key_file))
    engine = connect_remote_engine(settings, _Log(), lambda: 60.0)
    image = np.zeros((32, 32, 3), np.uint8)
    try:
        short = Observation({"base_0_rgb": image}, np.zeros(JOINTS - 1), "pick", 1.0)
        with pytest.raises(ServerRefused, match="state: expected 8 values, got 7"):
            engine.act(short)
        chunk = engine.act(Observation({"base_0_rgb": image}, np.zeros(JOINTS), "pick", 2.0))
        assert chunk.actions.shape == (engine.policy.action_horizon, engine.policy.action_dim)
        assert chunk.frame_id == 1 and chunk.stamp == 2.0
        stats = engine.server_stats()
        assert stats["server_errors"] == 1 and stats["server_connected"] is True
    finally:
        engine.close()


def test_rtc_feedback_carries_the_published_rows_in_all_the_models_dims(tiny_checkpoint):
    """A node driving 7 of the model's 8 action dims: the chunk it published goes back with the
    server's own values in the dim it does not drive, and the server takes it."""
    server = PolicyServer(
        load_policy(tiny_checkpoint), EngineConfig(chunk_continuity="rtc"), ServerSettings(port=0)
    )
    joints = joint_names(JOINTS)
    image = np.zeros((32, 32, 3), np.uint8)
    with serve_in_thread(server) as running:
        settings = _settings(server_uri=running.uri, action_joint_names=joints[:-1])
        engine = connect_remote_engine(settings, _Log(), lambda: 60.0)
        try:
            assert engine.policy.takes_rtc_feedback
            first = engine.act(Observation({"base_0_rgb": image}, np.zeros(JOINTS), "pick", 1.0))
            assert first.actions.shape[1] == JOINTS - 1
            engine.chunk_published(first.frame_id, first.actions[:4] + 0.5, 0.05)
            # the server checks the feedback's shape ([1..horizon, 8]) before it acts
            second = engine.act(Observation({"base_0_rgb": image}, np.ones(JOINTS), "pick", 2.0))
            assert second.frame_id == 2 and engine.server_stats()["server_errors"] == 0
        finally:
            engine.close()


class _Spy:
    """Records the messages a client sends (and sends them)."""

    def __init__(self, client) -> None:
        self.sent: list[dict] = []
        self._infer = client.infer
        client.infer = self.infer

    def infer(self, message: dict, *args, **kwargs) -> dict:
        self.sent.append(message)
        return self._infer(message, *args, **kwargs)


def _frame(stamp: float) -> Observation:
    return Observation(
        {"base_0_rgb": np.zeros((32, 32, 3), np.uint8)}, np.zeros(JOINTS), "pick", stamp
    )


def test_the_asks_token_limit_reaches_the_server(tiny_checkpoint):
    server = PolicyServer(load_policy(tiny_checkpoint), EngineConfig(), ServerSettings(port=0))
    with serve_in_thread(server) as running:
        engine = connect_remote_engine(_settings(server_uri=running.uri), _Log(), lambda: 60.0)
        spy = _Spy(engine.client)
        try:
            request = engine.submit("answer", "what is here?", SamplingParams(max_tokens=3))
            finals = []
            for frame in range(1, 20):
                engine.act(_frame(float(frame)))
                finals += [d for d in engine.decode() if d.final and d.request_id == request]
                if finals:
                    break
            assert spy.sent[0]["ask"] == "what is here?" and spy.sent[0][ASK_MAX_TOKENS_KEY] == 3
            assert finals[0].finish_reason == "length"  # random weights never say eos
            (session,) = server.sessions.sessions()
            assert session.engine.tokens_generated == 3  # the server's own limit is 24
        finally:
            engine.close()


def test_moving_on_to_the_next_server_starts_a_clean_session(tiny_checkpoint):
    """RTC feedback about the first server's chunks never reaches the second; the question in
    flight on the first ends failed, saying the server changed; the next question goes to the
    second server."""
    policy = load_policy(tiny_checkpoint)
    config = EngineConfig(chunk_continuity="rtc")
    first = PolicyServer(policy, config, ServerSettings(port=0))
    second = PolicyServer(policy, config, ServerSettings(port=0))
    with serve_in_thread(second) as running_second:
        with serve_in_thread(first) as running_first:
            settings = _settings(server_uris=[running_first.uri, running_second.uri])
            engine = connect_remote_engine(settings, _Log(), lambda: 60.0)
            spy = _Spy(engine.client)
            chunk = engine.act(_frame(1.0))
            engine.chunk_published(chunk.frame_id, chunk.actions, 0.05)
            asked = engine.submit("answer", "what is here?", SamplingParams(max_tokens=20))
            engine.act(_frame(2.0))  # carries the question and the first chunk's feedback
            assert PUBLISHED_CHUNK_KEY in spy.sent[-1] and spy.sent[-1]["ask"]
        try:
            assert wait_for(lambda: engine.client.connection == 2, WAIT_S)
            failed = [d for d in engine.decode() if d.request_id == asked]
            assert failed[-1].final and failed[-1].finish_reason == "failed"
            assert failed[-1].detail.startswith("the server changed: ")
            assert running_second.uri in failed[-1].detail
            again = engine.submit("answer", "and now?", SamplingParams(max_tokens=2))
            chunk = engine.act(_frame(3.0))
            assert PUBLISHED_CHUNK_KEY not in spy.sent[-1] and spy.sent[-1]["ask"] == "and now?"
            assert chunk.frame_id == 3 and engine.policy.session_id == 1  # the second's first
            stats = engine.server_stats()
            assert stats["server_uri"] == running_second.uri and stats["server_switches"] == 1
            assert stats["server_sessions"] == 2
            assert engine.active_requests == 1 and again not in {d.request_id for d in failed}
        finally:
            engine.close()
