"""openpi client observations -> engine `Observation`s, checked field by field.

Each robot family is sent by its openpi example with its own keys (shared/SERVING.md):

* droid: ``observation/exterior_image_1_left``, ``observation/wrist_image_left`` (uint8
  [H, W, 3]), ``observation/joint_position`` (7) and ``observation/gripper_position`` (1);
* libero: ``observation/image``, ``observation/wrist_image``, ``observation/state`` (8);
* aloha: ``images`` {``cam_high``, ``cam_low``, ``cam_left_wrist``, ``cam_right_wrist``} (uint8
  [3, H, W] as the client transposes them, or [H, W, 3]) and ``state`` (14);
* any other robot (generic, a LeRobot folder): ``images`` {camera or slot name: uint8 image}
  and ``state``.

All of them add ``prompt`` (the task text) and may add ``ask`` (a question, answered over the
following replies) with ``ask/max_tokens`` (its answer's token limit, at most the server's) and,
to a server running chunk continuity, ``rtc/published_chunk`` and ``rtc/delay_s`` (what the robot
published of the previous reply, and how late). Cameras map to image slots through the robot
adapter's ``cameras`` (a camera it does not use, such as ALOHA's ``cam_low``, is accepted and left
out). Anything else — a missing or unknown key, a wrong dtype or shape, a non-finite state, an
over-long text — raises `ObservationError` naming the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..engine.types import Observation
from ..policy_io.policy import Pi05Policy
from .client import ASK_MAX_TOKENS_KEY, PUBLISHED_CHUNK_KEY, PUBLISHED_DELAY_KEY

MAX_TEXT_CHARS = 2000  # prompt and ask
MAX_IMAGE_SIDE = 4096
_NUMERIC_KINDS = "biuf"


class ObservationError(ValueError):
    """An observation the server refuses; ``field`` names the offending key."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@dataclasses.dataclass(frozen=True)
class ClientFrame:
    """One checked request of a client: the engine's observation, an optional question and its
    answer's token limit (0: the server's), and (RTC feedback) what the robot published of the
    previous reply and how late: the actions [steps, action_dim] and the delay from that reply's
    observation to its publication, s."""

    observation: Observation
    ask: str = ""
    ask_max_tokens: int = 0
    published: tuple[np.ndarray, float] | None = None


@dataclasses.dataclass(frozen=True)
class ObservationLayout:
    """Where a robot's openpi client puts its cameras and state.

    flat_cameras: top-level key -> camera name (droid, libero); empty: an ``images`` map.
    state_parts: top-level keys concatenated into the state, in order.
    """

    flat_cameras: Mapping[str, str]
    state_parts: tuple[str, ...]

    @property
    def keys(self) -> frozenset[str]:
        nested = () if self.flat_cameras else ("images",)
        return frozenset(
            (*self.flat_cameras, *nested, *self.state_parts, "prompt", "ask", ASK_MAX_TOKENS_KEY)
        )


LAYOUTS: dict[str, ObservationLayout] = {
    "droid": ObservationLayout(
        {
            "observation/exterior_image_1_left": "exterior_image_1_left",
            "observation/wrist_image_left": "wrist_image_left",
        },
        ("observation/joint_position", "observation/gripper_position"),
    ),
    "libero": ObservationLayout(
        {"observation/image": "image", "observation/wrist_image": "wrist_image"},
        ("observation/state",),
    ),
}
NESTED_LAYOUT = ObservationLayout({}, ("state",))  # aloha, generic, LeRobot folders


class ObservationReader:
    """Checks and converts one robot family's client observations for ``policy``; with
    ``rtc_feedback`` it also takes (and lists in `describe`) the optional RTC feedback keys
    ``rtc/published_chunk`` and ``rtc/delay_s`` (the node's remote engine sends them)."""

    def __init__(self, policy: Pi05Policy, rtc_feedback: bool = False) -> None:
        self.policy = policy
        self.layout = LAYOUTS.get(policy.robot.name, NESTED_LAYOUT)
        self.cameras = dict(policy.robot.cameras)  # camera -> slot; empty: names are slots
        self.state_dim = policy.robot.state_dim or policy.state_dim
        self.keys = self.layout.keys | (RTC_FEEDBACK_KEYS if rtc_feedback else frozenset())

    def describe(self) -> dict[str, Any]:
        """What a client must send, and may (for the metadata frame)."""
        return {
            "keys": sorted(self.keys - {"ask"}),
            "cameras": sorted(self.cameras) or list(self.policy.image_slots),
            "state_dim": self.state_dim or 0,
        }

    def synthetic(self, size: int = 224) -> Observation:
        """A grey frame with every camera this robot feeds and a zero state (warm-up)."""
        slots = sorted(set(self.cameras.values())) or list(self.policy.image_slots)
        image = np.full((size, size, 3), 128, dtype=np.uint8)
        state = np.zeros(self.state_dim, dtype=np.float64)
        return Observation(dict.fromkeys(slots, image), state, "warm up", 0.0)

    def read(self, message: Any, stamp: float) -> ClientFrame:
        """A decoded client message -> its checked frame. Raises `ObservationError`."""
        if not isinstance(message, dict):
            raise ObservationError("message", f"expected a map of fields, got {_kind(message)}")
        unknown = sorted(str(key) for key in message if key not in self.keys)
        if unknown:
            raise ObservationError(
                unknown[0], f"unknown key; this server's robot takes {sorted(self.keys)}"
            )
        prompt = _text(message, "prompt", required=True)
        ask = _text(message, "ask", required=False)
        ask_max_tokens = _token_limit(message, ASK_MAX_TOKENS_KEY)
        images = self._images(message)
        state = self._state(message)
        published = self._published(message)
        observation = Observation(images, state, prompt, stamp)
        return ClientFrame(observation, ask, ask_max_tokens, published)

    def _published(self, message: dict) -> tuple[np.ndarray, float] | None:
        """The RTC feedback: both keys or neither."""
        given = [key for key in (PUBLISHED_CHUNK_KEY, PUBLISHED_DELAY_KEY) if key in message]
        if not given:
            return None
        if len(given) == 1:
            missing = ({PUBLISHED_CHUNK_KEY, PUBLISHED_DELAY_KEY} - set(given)).pop()
            raise ObservationError(missing, f"missing (sent with {given[0]})")
        chunk = message[PUBLISHED_CHUNK_KEY]
        horizon, width = self.policy.config.action_horizon, self.policy.action_dim
        if not isinstance(chunk, np.ndarray) or chunk.dtype.kind not in "iuf":
            problem = f"expected a float array, got {_kind(chunk)}"
            raise ObservationError(PUBLISHED_CHUNK_KEY, problem)
        if chunk.ndim != 2 or chunk.shape[1] != width or not 0 < chunk.shape[0] <= horizon:
            raise ObservationError(
                PUBLISHED_CHUNK_KEY, f"expected [1..{horizon}, {width}], got {chunk.shape}"
            )
        delay = message[PUBLISHED_DELAY_KEY]
        if isinstance(delay, np.generic):
            delay = delay.item()
        if isinstance(delay, bool) or not isinstance(delay, (int, float)):
            raise ObservationError(PUBLISHED_DELAY_KEY, f"expected seconds, got {_kind(delay)}")
        if not (math.isfinite(delay) and delay >= 0):
            problem = f"expected finite seconds >= 0, got {delay}"
            raise ObservationError(PUBLISHED_DELAY_KEY, problem)
        return chunk.astype(np.float64), float(delay)

    def _images(self, message: dict) -> dict[str, np.ndarray]:
        if self.layout.flat_cameras:
            raw = {
                camera: (key, _required(message, key))
                for key, camera in self.layout.flat_cameras.items()
            }
        else:
            given = _required(message, "images")
            if not isinstance(given, dict) or not given:
                raise ObservationError("images", "expected a non-empty map of camera -> image")
            raw = {str(camera): (f"images.{camera}", image) for camera, image in given.items()}
        images = {}
        for camera, (field, image) in raw.items():
            slot = self._slot(camera, field)
            if slot is not None:
                images[slot] = _image(field, image)
        if not images:
            raise ObservationError("images", "none of the cameras feeds the model")
        return images

    def _slot(self, camera: str, field: str) -> str | None:
        if not self.cameras:
            try:
                self.policy.present_slots({camera: None})
            except ValueError as error:
                raise ObservationError(field, str(error)) from None
            return camera
        if camera in self.cameras:
            return self.cameras[camera]
        known = sorted(self.cameras)
        if self.layout.flat_cameras or camera not in _UNUSED_CAMERAS:
            raise ObservationError(field, f"unknown camera; expected some of {known}")
        return None

    def _state(self, message: dict) -> np.ndarray:
        parts = []
        for key in self.layout.state_parts:
            value = _required(message, key)
            if not isinstance(value, np.ndarray) or value.dtype.kind not in _NUMERIC_KINDS:
                raise ObservationError(key, f"expected a numeric array, got {_kind(value)}")
            if value.ndim != 1:
                raise ObservationError(key, f"expected a vector, got shape {value.shape}")
            if not np.isfinite(value.astype(np.float64)).all():
                raise ObservationError(key, "has NaN or infinite values")
            parts.append(value.astype(np.float64))
        state = np.concatenate(parts)
        if self.state_dim and state.shape[0] != self.state_dim:
            field = "+".join(self.layout.state_parts)
            raise ObservationError(field, f"expected {self.state_dim} values, got {len(state)}")
        return state


# RTC feedback (a client of a server running chunk continuity, named by serving/client.py): the
# previous reply's chunk as the robot published it, and its delay
RTC_FEEDBACK_KEYS = frozenset({PUBLISHED_CHUNK_KEY, PUBLISHED_DELAY_KEY})

# cameras openpi's ALOHA clients send that pi0.5 never reads
_UNUSED_CAMERAS = frozenset({"cam_low"})


def _required(message: dict, key: str) -> Any:
    if key not in message:
        raise ObservationError(key, "missing")
    return message[key]


def _text(message: dict, key: str, required: bool) -> str:
    if key not in message:
        if required:
            raise ObservationError(key, "missing (the task text)")
        return ""
    value = message[key]
    if isinstance(value, np.ndarray) and value.dtype.kind == "U" and value.ndim == 0:
        value = str(value)
    if not isinstance(value, str):
        raise ObservationError(key, f"expected text, got {_kind(value)}")
    if len(value) > MAX_TEXT_CHARS:
        raise ObservationError(key, f"{len(value)} characters, at most {MAX_TEXT_CHARS}")
    return value


def _token_limit(message: dict, key: str) -> int:
    """An optional token limit: a whole number >= 1 (0 when absent)."""
    if key not in message:
        return 0
    value = message[key]
    if isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ObservationError(key, f"expected a whole number of tokens, got {_kind(value)}")
    if value < 1:
        raise ObservationError(key, f"expected at least 1 token, got {value}")
    return value


def _image(field: str, image: Any) -> np.ndarray:
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8:
        raise ObservationError(field, f"expected a uint8 image array, got {_kind(image)}")
    if image.ndim == 3 and image.shape[0] == 3 and image.shape[2] != 3:
        image = image.transpose(1, 2, 0)  # [3, H, W] as openpi's ALOHA clients send it
    if image.ndim != 3 or image.shape[2] != 3:
        raise ObservationError(field, f"expected [H, W, 3] or [3, H, W], got {image.shape}")
    if not (0 < image.shape[0] <= MAX_IMAGE_SIDE and 0 < image.shape[1] <= MAX_IMAGE_SIDE):
        raise ObservationError(field, f"image {image.shape[:2]} outside 1..{MAX_IMAGE_SIDE} px")
    return np.ascontiguousarray(image)


def _kind(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"array {value.dtype} {value.shape}"
    return type(value).__name__
