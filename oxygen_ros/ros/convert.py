"""Conversions between ROS 2 messages and numpy arrays.

This is the only module that turns sensor messages into arrays and action chunks into messages.
Every function is pure: it reads its arguments, returns a new value and keeps no state, so each
one can be unit- and fuzz-tested on its own. A message that cannot be converted raises
:class:`InputError`, whose ``reason`` is a short, stable key meant for diagnostics counters and
whose text names the cause without naming the topic (the caller knows the topic).

Performance notes: image bytes are read with ``np.frombuffer`` (no per-element Python work), and
byte payloads are written through ``array.array`` because assigning a numpy array to a message's
sequence field is checked element by element (~25 ms for a 224x224 image).
"""

from __future__ import annotations

import array
import io
import math
from collections.abc import Sequence

import numpy as np
from builtin_interfaces.msg import Duration, Time
from PIL import Image as PILImage
from sensor_msgs.msg import CompressedImage, Image, JointState
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint

__all__ = [
    "InputError",
    "SUPPORTED_ENCODINGS",
    "image_to_rgb",
    "compressed_to_rgb",
    "rgb_to_image",
    "rgb_to_compressed",
    "joint_state_to_positions",
    "chunk_to_joint_trajectory",
    "stamp_to_seconds",
    "seconds_to_duration",
    "seconds_to_stamp",
]

_NS_PER_S = 1_000_000_000
_INT32_MAX = 2**31 - 1


class InputError(ValueError):
    """A message that cannot be converted.

    Attributes:
        reason: short machine-readable cause, e.g. ``"truncated_data"``; use it as a counter key.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# ----------------------------------------------------------------------------------------------
# Raw images
# ----------------------------------------------------------------------------------------------

# encoding -> (bytes per pixel, byte offsets of R, G and B inside one pixel).
# 16-bit encodings keep their most significant byte (value >> 8); the offsets given are for
# little-endian data and flip to 0 when the message says ``is_bigendian``.
_PIXEL_LAYOUTS: dict[str, tuple[int, tuple[int, int, int]]] = {
    "rgb8": (3, (0, 1, 2)),
    "bgr8": (3, (2, 1, 0)),
    "rgba8": (4, (0, 1, 2)),
    "bgra8": (4, (2, 1, 0)),
    "mono8": (1, (0, 0, 0)),
    "8UC1": (1, (0, 0, 0)),
    "mono16": (2, (1, 1, 1)),
    "16UC1": (2, (1, 1, 1)),
}

SUPPORTED_ENCODINGS: tuple[str, ...] = tuple(_PIXEL_LAYOUTS)


def _pixel_layout(encoding: str, is_bigendian: int) -> tuple[int, tuple[int, int, int]]:
    """Bytes per pixel and R, G, B byte offsets for ``encoding``; raise if unsupported."""
    layout = _PIXEL_LAYOUTS.get(encoding)
    if layout is None:
        raise InputError(
            "unsupported_encoding",
            f"Image encoding {encoding!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ENCODINGS)}",
        )
    bytes_per_pixel, offsets = layout
    if bytes_per_pixel == 2 and is_bigendian:
        offsets = (0, 0, 0)
    return bytes_per_pixel, offsets


def image_to_rgb(msg: Image) -> np.ndarray:
    """Convert a ``sensor_msgs/Image`` to a new (H, W, 3) uint8 RGB array.

    Supports rgb8, bgr8, rgba8, bgra8 (alpha dropped), mono8/8UC1 (grey replicated) and
    mono16/16UC1 (scaled to 8 bit by keeping the high byte, honouring ``is_bigendian``).
    Row padding (``step`` larger than ``width`` x bytes per pixel) is skipped; bytes beyond
    ``height`` x ``step`` are ignored.

    Raises:
        InputError: reasons ``unsupported_encoding``, ``zero_size``, ``bad_step``,
            ``truncated_data``.
    """
    bytes_per_pixel, offsets = _pixel_layout(msg.encoding, msg.is_bigendian)
    height, width, step = int(msg.height), int(msg.width), int(msg.step)
    if height == 0 or width == 0:
        raise InputError("zero_size", f"Image has zero size (width {width}, height {height})")
    row_bytes = width * bytes_per_pixel
    if step < row_bytes:
        raise InputError(
            "bad_step",
            f"Image step {step} is smaller than width {width} x {bytes_per_pixel} bytes "
            f"per pixel ({msg.encoding}) = {row_bytes}",
        )
    data = np.frombuffer(msg.data, dtype=np.uint8)
    expected = height * step
    if data.size < expected:
        raise InputError(
            "truncated_data",
            f"Image data has {data.size} bytes, expected {expected} "
            f"(height {height} x step {step})",
        )
    rows = data[:expected].reshape(height, step)[:, :row_bytes]
    pixels = rows.reshape(height, width, bytes_per_pixel)
    return np.ascontiguousarray(pixels[:, :, list(offsets)])


def rgb_to_image(rgb: np.ndarray, stamp: Time, frame_id: str, encoding: str = "rgb8") -> Image:
    """Build a ``sensor_msgs/Image`` from an (H, W, 3) uint8 RGB array.

    ``encoding`` is one of rgb8, bgr8, rgba8, bgra8 (alpha 255) or mono8 (ITU-R BT.601 luma).
    Rows are packed (``step`` = width x channels).

    Raises:
        ValueError: ``rgb`` is not an (H, W, 3) uint8 array.
        InputError: ``unsupported_encoding`` for any other encoding.
    """
    pixels = _encode_pixels(_checked_rgb(rgb), encoding)
    msg = Image()
    msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.height, msg.width, channels = pixels.shape
    msg.encoding = encoding
    msg.is_bigendian = 0
    msg.step = msg.width * channels
    msg.data = array.array("B", pixels.tobytes())
    return msg


def _checked_rgb(rgb: np.ndarray) -> np.ndarray:
    """Return ``rgb`` as an ndarray after checking it is (H, W, 3) uint8."""
    rgb = np.asarray(rgb)
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise ValueError(f"expected an (H, W, 3) uint8 array, got {rgb.shape} {rgb.dtype}")
    return rgb


def _encode_pixels(rgb: np.ndarray, encoding: str) -> np.ndarray:
    """Rearrange RGB pixels into ``encoding``'s channel layout, (H, W, C) uint8."""
    if encoding == "rgb8":
        return rgb
    if encoding == "bgr8":
        return rgb[:, :, ::-1]
    if encoding in ("rgba8", "bgra8"):
        colour = rgb if encoding == "rgba8" else rgb[:, :, ::-1]
        alpha = np.full(rgb.shape[:2] + (1,), 255, dtype=np.uint8)
        return np.concatenate([colour, alpha], axis=2)
    if encoding == "mono8":
        weights = np.array([299, 587, 114], dtype=np.uint32)
        luma = (rgb.astype(np.uint32) @ weights + 500) // 1000
        return luma.astype(np.uint8)[:, :, None]
    raise InputError(
        "unsupported_encoding",
        f"cannot encode Image as {encoding!r}; supported: rgb8, bgr8, rgba8, bgra8, mono8",
    )


# ----------------------------------------------------------------------------------------------
# Compressed images
# ----------------------------------------------------------------------------------------------

_PIL_FORMATS = ("JPEG", "PNG")
_CODEC_WORDS = {"jpeg": "JPEG", "jpg": "JPEG", "png": "PNG"}


def _check_compressed_format(fmt: str) -> None:
    """Accept empty, jpeg and png format strings; raise ``unsupported_format`` otherwise.

    Strings seen in the wild: ``"jpeg"``, ``"png"``, ``"rgb8; jpeg compressed bgr8"``. The
    depth transport (``"16UC1; compressedDepth png"``) prefixes its own header and is refused.
    """
    lowered = fmt.lower()
    words = set(lowered.replace(";", " ").split())
    if "compresseddepth" in lowered or (words and not words & _CODEC_WORDS.keys()):
        raise InputError(
            "unsupported_format",
            f"CompressedImage format {fmt!r} is not supported; supported: jpeg, png",
        )


def compressed_to_rgb(msg: CompressedImage, max_pixels: int = 2**25) -> np.ndarray:
    """Decode a jpeg or png ``sensor_msgs/CompressedImage`` to a new (H, W, 3) uint8 RGB array.

    An empty ``format`` is accepted; the codec is then recognised from the data. Images
    claiming more than ``max_pixels`` pixels (default 2**25, above 8K UHD) are refused before
    decoding, so a corrupt or hostile header cannot make us allocate gigabytes.

    Raises:
        InputError: reasons ``unsupported_format``, ``zero_size``, ``too_large``,
            ``corrupt_compressed``.
    """
    _check_compressed_format(msg.format)
    data = bytes(msg.data)
    if not data:
        raise InputError("zero_size", "CompressedImage has no data")
    try:
        with PILImage.open(io.BytesIO(data), formats=_PIL_FORMATS) as decoded:
            _check_pixel_count(decoded.width, decoded.height, max_pixels)
            return np.array(decoded.convert("RGB"), dtype=np.uint8)
    except InputError:
        raise
    except Exception as exc:  # Pillow signals corrupt streams with many exception types.
        raise InputError(
            "corrupt_compressed",
            f"CompressedImage ({msg.format or 'no format'}, {len(data)} bytes) could not be "
            f"decoded: {exc}",
        ) from exc


def _check_pixel_count(width: int, height: int, max_pixels: int) -> None:
    """Raise ``too_large`` when a decoded header claims more than ``max_pixels`` pixels."""
    if width * height > max_pixels:
        raise InputError(
            "too_large",
            f"CompressedImage claims {width}x{height} pixels, more than the limit {max_pixels}",
        )


def rgb_to_compressed(
    rgb: np.ndarray, stamp: Time, frame_id: str, fmt: str = "jpeg", quality: int = 90
) -> CompressedImage:
    """Encode an (H, W, 3) uint8 RGB array as a ``sensor_msgs/CompressedImage``.

    ``fmt`` is ``"jpeg"`` or ``"png"``; the message's ``format`` follows image_transport's
    convention (``"rgb8; jpeg compressed bgr8"``) so standard republishers decode it.

    Raises:
        ValueError: ``rgb`` is not (H, W, 3) uint8, or ``fmt`` is neither jpeg nor png.
    """
    codec = _CODEC_WORDS.get(fmt.lower())
    if codec is None:
        raise ValueError(f"unsupported compression {fmt!r}; expected 'jpeg' or 'png'")
    buffer = io.BytesIO()
    options = {"quality": int(quality)} if codec == "JPEG" else {}
    PILImage.fromarray(_checked_rgb(rgb)).save(buffer, format=codec, **options)
    msg = CompressedImage()
    msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.format = f"rgb8; {codec.lower()} compressed bgr8"
    msg.data = array.array("B", buffer.getvalue())
    return msg


# ----------------------------------------------------------------------------------------------
# Joint states and trajectories
# ----------------------------------------------------------------------------------------------


def joint_state_to_positions(msg: JointState, joint_names: Sequence[str]) -> np.ndarray:
    """Return the positions of ``joint_names`` (in that order) as a new float32 vector.

    Joints in the message but not requested are ignored; if a name repeats, its first entry
    wins.

    Raises:
        InputError: ``length_mismatch`` (``position`` and ``name`` differ in length),
            ``missing_joints`` (naming them), ``non_finite`` (NaN/Inf, or beyond float32 range,
            naming the joints).
    """
    names = list(msg.name)
    positions = np.asarray(msg.position, dtype=np.float64)
    if positions.size != len(names):
        raise InputError(
            "length_mismatch",
            f"JointState has {len(names)} names but {positions.size} positions",
        )
    index: dict[str, int] = {}
    for i, name in enumerate(names):
        index.setdefault(name, i)
    missing = [name for name in joint_names if name not in index]
    if missing:
        raise InputError(
            "missing_joints",
            f"JointState lacks joints {missing} (it has {len(names)}: {names[:16]})",
        )
    with np.errstate(over="ignore"):
        selected = positions[[index[name] for name in joint_names]].astype(np.float32)
    bad = np.flatnonzero(~np.isfinite(selected))
    if bad.size:
        raise InputError(
            "non_finite",
            f"JointState has non-finite positions for joints {[joint_names[i] for i in bad]}",
        )
    return selected


def chunk_to_joint_trajectory(
    actions: np.ndarray,
    joint_names: Sequence[str],
    dt: float,
    stamp: Time,
    frame_id: str = "",
    velocities: np.ndarray | None = None,
) -> JointTrajectory:
    """Turn an action chunk (H, J) of positions into a ``trajectory_msgs/JointTrajectory``.

    Point ``i`` holds ``actions[i]`` as positions (and ``velocities[i]`` as velocities when given,
    as ros2_control's JointTrajectoryController takes a velocity command) and is due at
    ``(i + 1) * dt`` after ``header.stamp``, which is the stamp of the observation the chunk was
    computed from, so a trajectory controller skips the part of the chunk that inference latency
    has already used.

    Raises:
        ValueError: ``actions`` (or ``velocities``) is not (H, J) with J == len(joint_names), or
            ``dt`` is not a positive finite number.
        InputError: ``non_finite`` when ``actions`` or ``velocities`` holds NaN or Inf.
    """
    chunk = _checked_chunk(actions, joint_names, "actions")
    speeds = None if velocities is None else _checked_chunk(velocities, joint_names, "velocities")
    if speeds is not None and speeds.shape != chunk.shape:
        raise ValueError(f"velocities {speeds.shape} and actions {chunk.shape} differ in shape")
    if not (math.isfinite(dt) and dt > 0.0):
        raise ValueError(f"dt must be a positive finite number of seconds, got {dt}")
    msg = JointTrajectory()
    msg.header.stamp = stamp
    msg.header.frame_id = frame_id
    msg.joint_names = list(joint_names)
    msg.points = [
        _trajectory_point(row, (i + 1) * dt, None if speeds is None else speeds[i])
        for i, row in enumerate(chunk)
    ]
    return msg


def _checked_chunk(values: np.ndarray, joint_names: Sequence[str], what: str) -> np.ndarray:
    """``values`` as a contiguous float64 (H, len(joint_names)) array of finite numbers."""
    chunk = np.ascontiguousarray(values, dtype=np.float64)
    if chunk.ndim != 2 or chunk.shape[1] != len(joint_names):
        raise ValueError(
            f"{what} must be (horizon, {len(joint_names)}) for joints {list(joint_names)}, "
            f"got shape {chunk.shape}"
        )
    if not np.isfinite(chunk).all():
        raise InputError("non_finite", f"action chunk {what} hold NaN or Inf values")
    return chunk


def _trajectory_point(
    positions: np.ndarray, time_from_start_s: float, velocities: np.ndarray | None = None
) -> JointTrajectoryPoint:
    """One trajectory point from contiguous float64 position (and velocity) rows."""
    point = JointTrajectoryPoint()
    point.positions = array.array("d", positions.tobytes())
    if velocities is not None:
        point.velocities = array.array("d", np.ascontiguousarray(velocities).tobytes())
    point.time_from_start = seconds_to_duration(time_from_start_s)
    return point


# ----------------------------------------------------------------------------------------------
# Time
# ----------------------------------------------------------------------------------------------


def stamp_to_seconds(stamp: Time | Duration) -> float:
    """Seconds represented by a ``builtin_interfaces`` Time or Duration."""
    return stamp.sec + stamp.nanosec * 1e-9


def _split_seconds(seconds: float) -> tuple[int, int]:
    """Split seconds into (sec, nanosec) with 0 <= nanosec < 1e9, as ROS stores time."""
    if not math.isfinite(seconds):
        raise ValueError(f"time must be finite, got {seconds}")
    whole = math.floor(seconds)  # split first: seconds * 1e9 loses ns precision for epochs
    carry, nanosec = divmod(round((seconds - whole) * _NS_PER_S), _NS_PER_S)
    sec = int(whole) + carry
    if not -_INT32_MAX - 1 <= sec <= _INT32_MAX:
        raise ValueError(f"time {seconds} s does not fit a ROS int32 seconds field")
    return sec, nanosec


def seconds_to_duration(seconds: float) -> Duration:
    """A ``builtin_interfaces/Duration`` for ``seconds`` (rounded to the nanosecond)."""
    sec, nanosec = _split_seconds(seconds)
    return Duration(sec=sec, nanosec=nanosec)


def seconds_to_stamp(seconds: float) -> Time:
    """A ``builtin_interfaces/Time`` for ``seconds`` since the epoch (rounded to the ns)."""
    sec, nanosec = _split_seconds(seconds)
    return Time(sec=sec, nanosec=nanosec)
