"""openpi's client side, written from its description (shared/SERVING.md), for the serve tests:
its msgpack-numpy encoding and its `WebsocketClientPolicy` (connect, metadata, infer, text frame
= error), plus observations shaped as openpi's DROID and LIBERO examples send them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable

import msgpack
import numpy as np
import websockets.sync.client

from oxygen_ros.tools import processes


def openpi_pack(obj) -> bytes:
    """openpi-client's packer: numpy arrays and scalars as byte-keyed maps."""

    def default(value):
        if isinstance(value, np.ndarray):
            return {
                b"__ndarray__": True,
                b"data": value.tobytes(),
                b"dtype": value.dtype.str,
                b"shape": value.shape,
            }
        if isinstance(value, np.generic):
            return {b"__npgeneric__": True, b"data": value.item(), b"dtype": value.dtype.str}
        return value

    return msgpack.packb(obj, default=default)


def openpi_unpack(data: bytes):
    """openpi-client's unpacker (unchecked, as openpi's is)."""

    def hook(value):
        if b"__ndarray__" in value:
            return np.ndarray(
                buffer=value[b"data"], dtype=np.dtype(value[b"dtype"]), shape=value[b"shape"]
            )
        if b"__npgeneric__" in value:
            return np.dtype(value[b"dtype"]).type(value[b"data"])
        return value

    return msgpack.unpackb(data, object_hook=hook)


class OpenpiClient:
    """`WebsocketClientPolicy`'s behaviour: no compression or size limit, the API key header,
    the metadata frame first, and any text reply raised as the server's error."""

    def __init__(self, uri: str, api_key: str | None = None, timeout_s: float = 60.0) -> None:
        headers = {"Authorization": f"Api-Key {api_key}"} if api_key else None
        self._stack = contextlib.ExitStack()
        self.ws = self._stack.enter_context(
            websockets.sync.client.connect(
                uri,
                compression=None,
                max_size=None,
                additional_headers=headers,
                open_timeout=timeout_s,
            )
        )
        self.timeout_s = timeout_s
        self.metadata = openpi_unpack(self.ws.recv(timeout_s))

    def infer(self, obs: dict) -> dict:
        self.ws.send(openpi_pack(obs))
        return self.reply()

    def reply(self) -> dict:
        response = self.ws.recv(self.timeout_s)
        if isinstance(response, str):
            raise RuntimeError(f"Error in inference server:\n{response}")
        return openpi_unpack(response)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> OpenpiClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def droid_observation(seed: int, prompt: str = "pick up the cup") -> dict:
    """What openpi's examples/droid/main.py sends (images already resized to 224)."""
    rng = np.random.default_rng(seed)
    return {
        "observation/exterior_image_1_left": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/wrist_image_left": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/joint_position": rng.uniform(-1, 1, 7),
        "observation/gripper_position": rng.uniform(0, 1, 1),
        "prompt": prompt,
    }


def libero_observation(seed: int, prompt: str = "put the bowl on the plate") -> dict:
    """What openpi's examples/libero/main.py sends."""
    rng = np.random.default_rng(seed)
    return {
        "observation/image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/wrist_image": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "observation/state": rng.uniform(-1, 1, 8).astype(np.float32),
        "prompt": prompt,
    }


def infer_together(clients: list[OpenpiClient], observations: list[dict]) -> list:
    """Each client's `infer` on its own thread at once; each reply, or the exception raised."""
    replies: list = [None] * len(clients)

    def infer(i: int) -> None:
        try:
            replies[i] = clients[i].infer(observations[i])
        except Exception as error:  # noqa: BLE001  (returned for the test to check)
            replies[i] = error

    threads = [threading.Thread(target=infer, args=(i,)) for i in range(len(clients))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return replies


def wait_for(condition: Callable[[], bool], timeout_s: float = 60.0) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout_s`` passes (False): for what the
    server does after a client has gone, which no reply announces."""
    return processes.wait_for(condition, timeout_s, interval=0.02)
