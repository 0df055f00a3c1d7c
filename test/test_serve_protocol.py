"""oxygen-serve against openpi's client, written here from openpi's description: the metadata
frame, ndarray encoding both ways, actions equal to the in-process policy's, error text frames,
/healthz and /stats, the API key, and several sessions batched with their state kept apart."""

from __future__ import annotations

import dataclasses
import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import websockets
from serve_helpers import (
    OpenpiClient,
    droid_observation,
    infer_together,
    libero_observation,
    wait_for,
)

from oxygen_ros.checkpoints.core import build_model, init_random_weights
from oxygen_ros.engine.frames import frame_noise
from oxygen_ros.engine.settings import EngineConfig
from oxygen_ros.model.config import get_preset
from oxygen_ros.policy_io.policy import Pi05Policy, load_policy
from oxygen_ros.policy_io.tokenizer import Pi05Tokenizer
from oxygen_ros.serving import server as server_module
from oxygen_ros.serving.batching import BatchSettings
from oxygen_ros.serving.server import PolicyServer, ServerSettings, serve_in_thread
from oxygen_ros.serving.sessions import LanguageSettings
from oxygen_ros.tools.make_checkpoint import synthetic_norm_stats


@pytest.fixture(scope="module")
def droid(tiny_checkpoint):
    return load_policy(tiny_checkpoint, robot="droid")


@pytest.fixture(scope="module")
def libero(tiny_checkpoint):
    return load_policy(tiny_checkpoint, robot="libero")


def server_for(policy, **settings) -> PolicyServer:
    return PolicyServer(
        policy, EngineConfig(max_active_requests=2), ServerSettings(port=0, **settings)
    )


def expected_actions(
    policy, images: dict, state: np.ndarray, prompt: str, seed: int, frame_id: int
):
    """The in-process policy's actions for the same inputs and the session's noise."""
    inputs = policy.encode(images, state, prompt)
    prefix = policy.model.prefill(
        inputs.images, inputs.image_masks, inputs.tokens, inputs.token_masks
    )
    noise = frame_noise(policy.config, seed, frame_id, policy.device)
    return policy.decode_batch(policy.model.sample_actions(prefix, noise, 10), [state])[0]


def droid_expected(policy, obs: dict, seed: int, frame_id: int) -> np.ndarray:
    images = {
        "base_0_rgb": obs["observation/exterior_image_1_left"],
        "left_wrist_0_rgb": obs["observation/wrist_image_left"],
    }
    state = np.concatenate([obs["observation/joint_position"], obs["observation/gripper_position"]])
    return expected_actions(policy, images, state, obs["prompt"], seed, frame_id)


def http_get(port: int, path: str, headers: dict | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_droid_client_gets_metadata_then_the_policys_actions(droid):
    with serve_in_thread(server_for(droid)) as running:
        with OpenpiClient(running.uri) as client:
            meta = client.metadata
            assert meta["robot"] == "droid" and meta["action_space"] == "velocity"
            assert meta["observation"]["state_dim"] == 8
            for frame_id in (1, 2):
                obs = droid_observation(frame_id)
                reply = client.infer(obs)
                actions = reply["actions"]
                assert actions.dtype == np.float32
                assert actions.shape == (droid.config.action_horizon, 8)
                expected = droid_expected(droid, obs, meta["seed"], frame_id)
                np.testing.assert_allclose(actions, expected, rtol=0, atol=1e-4)
                assert reply["server_timing"]["infer_ms"] > 0
            assert "prev_total_ms" in reply["server_timing"]  # from the second call, as openpi


def test_libero_client_loop(libero):
    with serve_in_thread(server_for(libero)) as running, OpenpiClient(running.uri) as client:
        obs = libero_observation(3)
        actions = client.infer(obs)["actions"]
        images = {
            "base_0_rgb": obs["observation/image"],
            "left_wrist_0_rgb": obs["observation/wrist_image"],
        }
        state = obs["observation/state"].astype(np.float64)
        expected = expected_actions(
            libero, images, state, obs["prompt"], client.metadata["seed"], 1
        )
        assert actions.shape == (libero.config.action_horizon, 7)
        np.testing.assert_allclose(actions, expected, rtol=0, atol=1e-4)


def test_healthz_and_stats(droid):
    with serve_in_thread(server_for(droid)) as running:
        assert http_get(running.port, "/healthz") == (200, "OK\n")
        with OpenpiClient(running.uri) as client:
            client.infer(droid_observation(1))
            with pytest.raises(RuntimeError, match="prompt: missing"):
                client.infer({k: v for k, v in droid_observation(1).items() if k != "prompt"})
        status, body = http_get(running.port, "/stats")
        stats = json.loads(body)
        assert status == 200
        assert stats["frames_served"] == 1 and stats["refused_bad_observation"] == 1


def test_ready_only_once_a_frame_went_through_every_path(droid, monkeypatch):
    """While the warm-up frame runs (held here until released): /livez 200, /healthz 503, and a
    client connecting waits for its metadata; then the frame has acted and decoded language (an
    ask and a narration), /healthz is 200 and the waiting client is served."""
    release, warmed = threading.Event(), []
    real_warm_up = server_module.warm_up

    def held_warm_up(engine, observation, language) -> None:
        release.wait(120)
        real_warm_up(engine, observation, language)
        warmed.append((engine.frame_count, engine.decode_steps, sorted(engine.config.kinds)))

    monkeypatch.setattr(server_module, "warm_up", held_warm_up)
    server = server_for(droid, language=LanguageSettings(narration_every=1, max_tokens=4))
    serving, running = serve_in_thread(server), []  # entered on a thread: it returns once ready
    starter = threading.Thread(target=lambda: running.append(serving.__enter__()))
    starter.start()
    try:
        assert wait_for(lambda: server.port != 0, 120)  # listening
        assert http_get(server.port, "/livez") == (200, "OK\n")
        assert http_get(server.port, "/healthz") == (503, "warming up\n")
        early: list = []
        waiter = threading.Thread(
            target=lambda: early.append(OpenpiClient(f"ws://127.0.0.1:{server.port}"))
        )
        waiter.start()
        assert not warmed and not early  # the warm-up is held: no metadata yet
        release.set()
        starter.join(120)
        waiter.join(120)
        assert http_get(server.port, "/healthz") == (200, "OK\n")
        [(frames, decode_steps, kinds)] = warmed
        assert frames == 1 and decode_steps >= 1 and {"answer", "narration"} <= set(kinds)
        assert server.warm_up_s is not None and server.warm_up_s >= 0.0
        with early[0] as client:
            assert client.metadata["session_id"] == 1  # the warm-up used no session
            assert client.infer(droid_observation(1))["actions"].shape == (10, 8)
        assert server.counters.get("frames_served") == 1  # the warm-up frame is not counted
    finally:
        release.set()
        starter.join(120)
        if running:
            serving.__exit__(None, None, None)


def test_api_key_checked_on_the_handshake(droid):
    with serve_in_thread(server_for(droid, api_key="s3cret")) as running:
        with pytest.raises(websockets.InvalidStatus) as missing:
            OpenpiClient(running.uri)
        assert missing.value.response.status_code == 401
        with pytest.raises(websockets.InvalidStatus) as wrong:
            OpenpiClient(running.uri, api_key="guess")
        assert wrong.value.response.status_code == 403
        with OpenpiClient(running.uri, api_key="s3cret") as client:
            assert client.infer(droid_observation(1))["actions"].shape[1] == 8
        assert http_get(running.port, "/healthz") == (200, "OK\n")  # health needs no key
        assert http_get(running.port, "/stats")[0] == 401
        status, body = http_get(running.port, "/stats", {"Authorization": "Api-Key s3cret"})
        stats = json.loads(body)
        assert status == 200
        assert stats["refused_auth_missing"] == 2 and stats["refused_auth_wrong"] == 1


def test_sessions_batched_with_their_own_prompts_noise_and_history(droid):
    # a long window: the first frame waits until both sessions have one, so they share a batch
    server = server_for(droid, batch=BatchSettings(window_s=30.0))
    with serve_in_thread(server) as running:
        clients = [OpenpiClient(running.uri), OpenpiClient(running.uri)]
        seeds = [client.metadata["seed"] for client in clients]
        assert seeds[0] != seeds[1]
        for frame_id in (1, 2):
            observations = [
                droid_observation(10 + frame_id, "pick up the cup"),
                droid_observation(20 + frame_id, "close the drawer now please"),
            ]
            replies = infer_together(clients, observations)
            for i in range(2):
                assert replies[i]["server_timing"]["batch_size"] == 2
                expected = droid_expected(droid, observations[i], seeds[i], frame_id)
                np.testing.assert_allclose(replies[i]["actions"], expected, rtol=0, atol=1e-4)
        for client in clients:
            client.close()
    assert server.counters.get("batch_size_2") == 2


def test_a_question_is_answered_over_following_replies(droid):
    with serve_in_thread(server_for(droid)) as running, OpenpiClient(running.uri) as client:
        client.infer({**droid_observation(1), "ask": "what do you see?"})
        answers = []
        for frame in range(2, 40):
            reply = client.infer(droid_observation(frame))
            answers += [entry for entry in reply.get("language", []) if entry["kind"] == "answer"]
            if any(entry.get("final") for entry in answers):
                break
        assert answers, "no answer text came back"
        assert answers[-1]["final"] and answers[-1]["finish_reason"] in ("eos", "length")
        assert len({entry["request_id"] for entry in answers}) == 1


@pytest.fixture(scope="module")
def aloha(tiny_checkpoint):
    """The tiny model widened to 32 action dims (room for ALOHA's 14), random weights."""
    config = dataclasses.replace(get_preset("tiny"), action_dim=32)
    model = build_model(config, "cpu", "float32")
    init_random_weights(model, 0)
    stats = synthetic_norm_stats(32, 0)
    return Pi05Policy(
        model, Pi05Tokenizer(tiny_checkpoint / "tokenizer.model"), stats, robot="aloha"
    )


def test_aloha_client_with_channel_first_images_and_an_unused_camera(aloha):
    rng = np.random.default_rng(4)
    cameras = ("cam_high", "cam_low", "cam_left_wrist", "cam_right_wrist")
    images = {name: rng.integers(0, 256, (3, 224, 224), dtype=np.uint8) for name in cameras}
    state = rng.uniform(0.1, 0.9, 14)  # grippers inside ALOHA's range
    with serve_in_thread(server_for(aloha)) as running, OpenpiClient(running.uri) as client:
        reply = client.infer({"images": images, "state": state, "prompt": "fold the towel"})
        slots = {"cam_high": "base_0_rgb", "cam_left_wrist": "left_wrist_0_rgb"}
        slots["cam_right_wrist"] = "right_wrist_0_rgb"
        model_images = {slot: images[name].transpose(1, 2, 0) for name, slot in slots.items()}
        seed = client.metadata["seed"]
        expected = expected_actions(aloha, model_images, state, "fold the towel", seed, 1)
        assert reply["actions"].shape == (aloha.config.action_horizon, 14)
        np.testing.assert_allclose(reply["actions"], expected, rtol=0, atol=1e-4)
        with pytest.raises(RuntimeError, match="images.cam_top: unknown camera"):
            client.infer({"images": {"cam_top": images["cam_high"]}, "state": state, "prompt": "x"})


def test_narration_rides_along_every_n_frames(droid):
    server = server_for(droid, language=LanguageSettings(narration_every=2, max_tokens=4))
    with serve_in_thread(server) as running, OpenpiClient(running.uri) as client:
        narrations, finished = [], set()
        # frames 1, 3, 5, ... each ask for one; a loaded machine leaves less slack to decode in,
        # so the replies go on until two have finished (or a bound far beyond the usual 11)
        for frame in range(1, 80):
            reply = client.infer(droid_observation(frame))
            narrations += [e for e in reply.get("language", []) if e["kind"] == "narration"]
            finished = {e["request_id"] for e in narrations if e.get("final")}
            if len(finished) >= 2:
                break
        assert len(finished) >= 2, narrations
        assert all(e["finish_reason"] in ("eos", "length") for e in narrations if e.get("final"))


def test_each_session_runs_its_own_subtask_loop(droid):
    config = EngineConfig(
        max_active_requests=2,
        subtask_conditioning="prompt",
        prompt_format="openpi_subtask",
        subtask_max_tokens=3,  # random weights never say eos: a short subtask ends by length
    )
    server = PolicyServer(droid, config, ServerSettings(port=0))
    with serve_in_thread(server) as running:
        clients = [OpenpiClient(running.uri), OpenpiClient(running.uri)]
        subtasks: list[list[dict]] = [[], []]
        conditioned = [False, False]
        for frame in range(1, 30):
            tasks = ["pick up the cup", "open the drawer"]
            observations = [droid_observation(frame, task) for task in tasks]
            for i, reply in enumerate(infer_together(clients, observations)):
                subtasks[i] += [e for e in reply.get("language", []) if e["kind"] == "subtask"]
                conditioned[i] |= "subtask" in reply
            if all(conditioned):
                break
        assert all(conditioned), subtasks  # a finished subtask conditions the next actions
        ids = [{e["request_id"] for e in entries} for entries in subtasks]
        assert ids[0] and ids[1] and not ids[0] & ids[1]  # each session's own requests
        for client in clients:
            client.close()


def test_rtc_feedback_from_the_client_drives_the_sessions_continuity(droid):
    config = EngineConfig(max_active_requests=2, chunk_continuity="rtc", action_dt=0.05)
    server = PolicyServer(droid, config, ServerSettings(port=0))
    with serve_in_thread(server) as running:
        with OpenpiClient(running.uri) as reporting, OpenpiClient(running.uri) as silent:
            keys = reporting.metadata["observation"]["keys"]
            assert {"rtc/published_chunk", "rtc/delay_s"} <= set(keys)
            engines = [session.engine for session in server.sessions.sessions()]
            first = reporting.infer(droid_observation(1))["actions"]
            silent.infer(droid_observation(1))
            feedback = {"rtc/published_chunk": first[:4], "rtc/delay_s": 0.25}
            assert reporting.infer({**droid_observation(2), **feedback})["actions"].shape == (10, 8)
            silent.infer(droid_observation(2))
            # the client's delay, not the server's guess; the silent one got the guess
            assert engines[0].continuity.delay_s == 0.25
            assert engines[1].continuity.delay_s is not None
            assert engines[1].continuity.delay_s != 0.25
            for bad, field in (
                ({"rtc/published_chunk": first[:, :3], "rtc/delay_s": 0.1}, "published_chunk"),
                ({"rtc/published_chunk": first, "rtc/delay_s": -1.0}, "rtc/delay_s"),
                ({"rtc/delay_s": 0.1}, "rtc/published_chunk: missing"),
            ):
                with pytest.raises(RuntimeError, match=field):
                    reporting.infer({**droid_observation(3), **bad})


def test_rtc_feedback_keys_are_unknown_to_a_server_without_continuity(droid):
    with serve_in_thread(server_for(droid)) as running, OpenpiClient(running.uri) as client:
        assert "rtc/delay_s" not in client.metadata["observation"]["keys"]
        with pytest.raises(RuntimeError, match="rtc/delay_s: unknown key"):
            client.infer({**droid_observation(1), "rtc/delay_s": 0.1})
