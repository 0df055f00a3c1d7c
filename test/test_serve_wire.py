"""The wire encoding against openpi's description (shared/SERVING.md) and hostile bytes."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from serve_helpers import openpi_pack, openpi_unpack

from oxygen_ros.serving.wire import WireError, WireLimits, pack, unpack


def raw_array(dtype: str, shape, data: bytes) -> dict:
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": list(shape)}


def test_openpi_client_message_decodes_to_equal_arrays() -> None:
    rng = np.random.default_rng(0)
    obs = {
        "observation/exterior_image_1_left": rng.integers(0, 255, (224, 224, 3), dtype=np.uint8),
        "observation/joint_position": rng.standard_normal(7),
        "observation/gripper_position": np.float32([0.5]),
        "images": {"cam_high": rng.integers(0, 255, (3, 8, 8), dtype=np.uint8)},
        "step": np.int64(7),
        "flag": np.bool_(True),
        "prompt": "pick up the cup",
    }
    got = unpack(openpi_pack(obs))
    assert got["prompt"] == "pick up the cup"
    for key in ("observation/exterior_image_1_left", "observation/joint_position"):
        np.testing.assert_array_equal(got[key], obs[key])
        assert got[key].dtype == obs[key].dtype
    np.testing.assert_array_equal(got["images"]["cam_high"], obs["images"]["cam_high"])
    assert got["step"] == 7 and got["step"].dtype == np.int64
    assert got["flag"] == np.True_


def test_pack_decodes_with_openpi_unpacker() -> None:
    reply = {"actions": np.arange(30, dtype=np.float64).reshape(15, 2), "server_timing": {"a": 1.5}}
    got = openpi_unpack(pack(reply))
    np.testing.assert_array_equal(got["actions"], reply["actions"])
    assert got["server_timing"] == {"a": 1.5}


def test_big_endian_array_comes_back_native_and_equal() -> None:
    values = np.arange(6, dtype=">f4").reshape(2, 3)
    got = unpack(openpi_pack({"x": values}))["x"]
    assert got.dtype.isnative
    np.testing.assert_array_equal(got, values)


@pytest.mark.parametrize("dtype", [object, "V8", np.complex64])
def test_pack_refuses_object_void_complex(dtype) -> None:
    with pytest.raises(WireError, match="cannot cross"):
        pack({"x": np.zeros(2, dtype=dtype)})


@pytest.mark.parametrize("dtype", ["|O", "|V8", "<c8", "i4,f4", "<M8[s]", "|U0", "bogus", 3])
def test_unpack_refuses_dtypes_naming_the_field(dtype) -> None:
    message = msgpack.packb({"images": {"cam_high": raw_array(dtype, (2,), b"A" * 16)}})
    with pytest.raises(WireError) as caught:
        unpack(message)
    assert caught.value.field == "images.cam_high"
    assert "dtype" in str(caught.value)


@pytest.mark.parametrize("shape", [(100,), (1, 1), (3,), (1 << 62, 1 << 62)])
def test_unpack_refuses_shape_not_matching_data(shape) -> None:
    message = msgpack.packb({"observation/state": raw_array("<f4", shape, b"\0" * 8)})
    with pytest.raises(WireError, match="needs") as caught:
        unpack(message)
    assert caught.value.field == "observation/state"


@pytest.mark.parametrize("shape", [[-1], ["2"], [True, 2], "8"])
def test_unpack_refuses_malformed_shapes(shape) -> None:
    array = {b"__ndarray__": True, b"data": b"", b"dtype": "<f4", b"shape": shape}
    message = msgpack.packb({"s": array})
    with pytest.raises(WireError, match="shape") as caught:
        unpack(message)
    assert caught.value.field == "s"


def test_unpack_refuses_oversized_message_before_decoding() -> None:
    message = pack({"x": np.zeros(1000, dtype=np.float32)})
    with pytest.raises(WireError, match="over the limit") as caught:
        unpack(message, WireLimits(max_message_bytes=1000))
    assert caught.value.field == "message"


@pytest.mark.parametrize("data", [b"\xc1", b"\x92\x01", b"\x01\x02", b"", "text"])
def test_unpack_refuses_malformed_msgpack(data) -> None:
    with pytest.raises(WireError) as caught:
        unpack(data)
    assert caught.value.field == "message"


def test_unpack_refuses_deep_nesting_and_extensions_and_many_dims() -> None:
    deep: dict = {"leaf": 1}
    for _ in range(20):
        deep = {"d": deep}
    with pytest.raises(WireError, match="deeper"):
        unpack(msgpack.packb(deep))
    with pytest.raises(WireError, match="extension") as caught:
        unpack(msgpack.packb({"e": msgpack.ExtType(5, b"xx")}))
    assert caught.value.field == "e"
    with pytest.raises(WireError, match="dimensions"):
        unpack(msgpack.packb({"a": raw_array("|u1", [1] * 9, b"\0")}))


def test_unpack_refuses_scalar_out_of_range() -> None:
    message = msgpack.packb({"n": {b"__npgeneric__": True, b"data": 300, b"dtype": "|i1"}})
    with pytest.raises(WireError, match="not a int8") as caught:
        unpack(message)
    assert caught.value.field == "n"
