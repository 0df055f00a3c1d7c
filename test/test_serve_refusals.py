"""Every refusal of item 4, each answered by a text frame naming the field (never a
traceback), counted by kind, and the same connection served right after."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import websockets
from serve_helpers import OpenpiClient, droid_observation, openpi_pack, wait_for

from oxygen_ros.engine.settings import EngineConfig
from oxygen_ros.policy_io.policy import load_policy
from oxygen_ros.serving.server import PolicyServer, ServerSettings, serve_in_thread

MAX_MESSAGE_BYTES = 1 << 20


@pytest.fixture(scope="module")
def running(tiny_checkpoint):
    policy = load_policy(tiny_checkpoint, robot="droid")
    settings = ServerSettings(port=0, max_message_bytes=MAX_MESSAGE_BYTES)
    with serve_in_thread(PolicyServer(policy, EngineConfig(max_active_requests=2), settings)) as r:
        yield r


def raw_array(dtype: str, shape, data: bytes) -> dict:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": list(shape)}


def with_field(key: str, value) -> bytes:
    """A DROID observation with one field replaced by raw msgpack (whatever openpi's client
    could be made to send)."""
    obs = droid_observation(1)
    packed = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in obs.items()}
    for name, array in obs.items():
        if isinstance(array, np.ndarray):
            packed[name] = raw_array(array.dtype.str, array.shape, array.tobytes())
    packed[key] = value
    return msgpack.packb(packed)


def without(key: str) -> bytes:
    obs = droid_observation(1)
    del obs[key]
    return openpi_pack(obs)


STATE = "observation/joint_position"
IMAGE = "observation/exterior_image_1_left"
CASES = {
    "text frame": ("a text frame", "message: expected a binary", "refused_text_frame"),
    "random bytes": (b"\xc1\x00\xff", "message: not valid msgpack", "refused_bad_message"),
    "truncated": (msgpack.packb({"prompt": "x"})[:-1], "message: not valid", "refused_bad_message"),
    "object dtype": (
        with_field(STATE, raw_array("|O", (7,), b"A" * 56)),
        f"{STATE}: dtype '|O' is not accepted",
        "refused_bad_message",
    ),
    "void dtype": (
        with_field(STATE, raw_array("|V8", (7,), b"A" * 56)),
        f"{STATE}: dtype '|V8'",
        "refused_bad_message",
    ),
    "shape larger than data": (
        with_field(IMAGE, raw_array("|u1", (224, 224, 3), b"\0" * 100)),
        f"{IMAGE}: shape (224, 224, 3) of |u1 needs 150528 bytes",
        "refused_bad_message",
    ),
    "absurd shape": (
        with_field(STATE, raw_array("<f8", (1 << 40, 1 << 40), b"")),
        f"{STATE}: shape",
        "refused_bad_message",
    ),
    "missing key": (without("observation/gripper_position"), "gripper_position: missing", None),
    "unknown key": (with_field("observation/cartesian", 1), "observation/cartesian: unknown", None),
    "not a map": (msgpack.packb([1, 2, 3]), "message: expected a map", None),
    "wrong state width": (
        with_field(STATE, raw_array("<f8", (5,), b"\0" * 40)),
        "expected 8 values, got 6",
        None,
    ),
    "state not a vector": (
        with_field(STATE, raw_array("<f8", (7, 1), b"\0" * 56)),
        f"{STATE}: expected a vector",
        None,
    ),
    "NaN state": (
        with_field(STATE, raw_array("<f8", (7,), np.full(7, np.nan).tobytes())),
        f"{STATE}: has NaN",
        None,
    ),
    "float image": (
        with_field(IMAGE, raw_array("<f4", (8, 8, 3), b"\0" * 768)),
        f"{IMAGE}: expected a uint8 image",
        None,
    ),
    "image without channels": (
        with_field(IMAGE, raw_array("|u1", (8, 8), b"\0" * 64)),
        f"{IMAGE}: expected [H, W, 3]",
        None,
    ),
    "prompt not text": (with_field("prompt", 5), "prompt: expected text", None),
    "prompt too long": (with_field("prompt", "x" * 5000), "prompt: 5000 characters", None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_with_the_field_named_and_the_session_kept(running, case):
    message, expected, counter = CASES[case]
    counter = counter or "refused_bad_observation"
    counters = running.server.counters
    before = counters.get(counter)
    with OpenpiClient(running.uri) as client:
        client.ws.send(message)
        with pytest.raises(RuntimeError) as refused:
            client.reply()
        text = str(refused.value)
        assert expected in text
        assert "Traceback" not in text
        assert counters.get(counter) == before + 1
        # the same session goes on
        assert client.infer(droid_observation(2))["actions"].shape == (10, 8)


def test_a_message_over_the_size_limit_closes_only_that_connection(running):
    counters = running.server.counters
    before = counters.get("refused_message_too_big")
    with OpenpiClient(running.uri) as bystander, OpenpiClient(running.uri) as client:
        obs = droid_observation(1)
        obs[IMAGE] = np.zeros((1024, 1024, 3), dtype=np.uint8)  # 3 MiB > 1 MiB
        with pytest.raises(websockets.ConnectionClosedError) as closed:
            client.infer(obs)
        assert closed.value.rcvd.code == 1009
        assert bystander.infer(droid_observation(2))["actions"].shape == (10, 8)
    assert wait_for(lambda: counters.get("refused_message_too_big") == before + 1)
