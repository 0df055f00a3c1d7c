"""openpi's policy-server wire encoding: msgpack with numpy arrays, checked on the way in.

Two functions, used by the server and the client alike:

* `pack(obj) -> bytes` — msgpack, a numpy array as openpi's map
  `{b"__ndarray__": True, b"data": bytes, b"dtype": dtype.str, b"shape": shape}` and a numpy
  scalar as `{b"__npgeneric__": True, b"data": item, b"dtype": dtype.str}`. Object, void and
  complex dtypes are refused (`WireError`), as openpi's own packer does.
* `unpack(data, limits=WireLimits()) -> obj` — the inverse, for bytes from an untrusted peer:
  size, nesting depth, dtype (booleans, integers, floats and fixed-size strings only), shape and
  shape-vs-data size are checked before any array is built. Any problem raises `WireError`
  whose `field` names where it is (`"observation/state"`, `"images.cam_high"`, or `"message"`
  for the frame as a whole); its text never carries a traceback.

openpi's unpacker builds `np.ndarray(buffer=data, dtype=np.dtype(any_string), shape=shape)`
unchecked (see shared/SERVING.md); this one reads the same bytes and refuses what that one
would turn into object pointers or out-of-bounds reads. Arrays come back read-only views on the
message bytes in native byte order, as openpi's do.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

_ARRAY_MARK = b"__ndarray__"
_SCALAR_MARK = b"__npgeneric__"
_REFUSED_KINDS = ("V", "O", "c")
# dtype.str of what may cross: bool, signed/unsigned ints, floats, fixed-size byte/unicode strings.
_ALLOWED_DTYPE = re.compile(r"[<>|=]?(?:b1|[iu][1248]|f[248]|[SU][1-9][0-9]{0,5})")


class WireError(ValueError):
    """A message that cannot be packed or accepted; `field` names the offending part."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class WireLimits:
    """What one incoming message may hold (refused beyond, never truncated)."""

    max_message_bytes: int = 32 * 1024 * 1024
    max_depth: int = 8
    max_ndim: int = 8
    max_keys: int = 256


def pack(obj: Any) -> bytes:
    """msgpack `obj`, numpy arrays and scalars in openpi's encoding."""
    try:
        return msgpack.packb(obj, default=_encode_numpy)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError) as error:
        raise WireError("message", f"cannot be packed: {error}") from None


def unpack(data: bytes, limits: WireLimits | None = None) -> Any:
    """Decode one message from a peer; raises `WireError` naming the field at fault."""
    limits = limits or WireLimits()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError("message", "expected a binary frame")
    if len(data) > limits.max_message_bytes:
        raise WireError(
            "message", f"{len(data)} bytes is over the limit of {limits.max_message_bytes}"
        )
    try:
        raw = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_map_len=limits.max_keys,
            max_array_len=limits.max_keys,
        )
    except (ValueError, msgpack.UnpackException) as error:
        raise WireError("message", f"not valid msgpack ({type(error).__name__})") from None
    return _decode(raw, (), limits)


def _encode_numpy(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)) and obj.dtype.kind in _REFUSED_KINDS:
        raise WireError("message", f"numpy dtype {obj.dtype} cannot cross the wire")
    if isinstance(obj, np.ndarray):
        return {
            _ARRAY_MARK: True,
            b"data": obj.tobytes(),
            b"dtype": obj.dtype.str,
            b"shape": obj.shape,
        }
    if isinstance(obj, np.generic):
        return {_SCALAR_MARK: True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"{type(obj).__name__} is not msgpack-serialisable")


def _field(path: tuple[str, ...]) -> str:
    return ".".join(path) if path else "message"


def _decode(value: Any, path: tuple[str, ...], limits: WireLimits) -> Any:
    if len(path) > limits.max_depth:
        raise WireError(_field(path), f"nested deeper than {limits.max_depth} levels")
    if isinstance(value, dict):
        if _ARRAY_MARK in value:
            return _decode_array(value, path, limits)
        if _SCALAR_MARK in value:
            return _decode_scalar(value, path)
        return {key: _decode(item, (*path, _key_name(key)), limits) for key, item in value.items()}
    if isinstance(value, list):
        return [_decode(item, (*path, str(index)), limits) for index, item in enumerate(value)]
    if isinstance(value, msgpack.ExtType) or isinstance(value, msgpack.Timestamp):
        raise WireError(_field(path), "msgpack extension types are not accepted")
    return value


def _key_name(key: str | bytes) -> str:
    return key if isinstance(key, str) else key.decode("utf-8", "replace")


def _checked_dtype(text: Any, path: tuple[str, ...]) -> np.dtype:
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    if not isinstance(text, str) or not _ALLOWED_DTYPE.fullmatch(text):
        raise WireError(
            _field(path),
            f"dtype {text!r} is not accepted (booleans, integers, floats and fixed-size strings)",
        )
    return np.dtype(text)


def _decode_array(value: dict, path: tuple[str, ...], limits: WireLimits) -> np.ndarray:
    dtype = _checked_dtype(value.get(b"dtype"), path)
    shape = value.get(b"shape")
    data = value.get(b"data")
    if not isinstance(data, bytes):
        raise WireError(_field(path), "array data must be bytes")
    if not isinstance(shape, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape
    ):
        raise WireError(_field(path), f"array shape {shape!r} is not a list of sizes")
    if len(shape) > limits.max_ndim:
        raise WireError(_field(path), f"{len(shape)} dimensions, at most {limits.max_ndim}")
    expected = math.prod(shape) * dtype.itemsize
    if expected != len(data):
        raise WireError(
            _field(path),
            f"shape {tuple(shape)} of {dtype.str} needs {expected} bytes, the data has {len(data)}",
        )
    array = np.frombuffer(data, dtype=dtype).reshape(shape)
    return array if dtype.isnative else array.astype(dtype.newbyteorder("="))


def _decode_scalar(value: dict, path: tuple[str, ...]) -> np.generic:
    dtype = _checked_dtype(value.get(b"dtype"), path)
    item = value.get(b"data")
    if not isinstance(item, (bool, int, float, str, bytes)):
        raise WireError(_field(path), f"scalar data of type {type(item).__name__}")
    try:
        return dtype.type(item)
    except (TypeError, ValueError, OverflowError) as error:
        raise WireError(_field(path), f"scalar {item!r} is not a {dtype}: {error}") from None
