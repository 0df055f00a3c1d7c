"""Property tests: converters return the right value or raise InputError, never anything else.

Each expected value is computed by a slow, obviously-correct reference written here, so the
properties check correctness as well as robustness.
"""

import array
import io

import numpy as np
from builtin_interfaces.msg import Time
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image as PILImage
from sensor_msgs.msg import CompressedImage, Image, JointState

from oxygen_ros.ros.convert import (
    SUPPORTED_ENCODINGS,
    InputError,
    compressed_to_rgb,
    image_to_rgb,
    joint_state_to_positions,
    rgb_to_compressed,
    rgb_to_image,
)

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

BYTES_PER_PIXEL = {
    "rgb8": 3,
    "bgr8": 3,
    "rgba8": 4,
    "bgra8": 4,
    "mono8": 1,
    "8UC1": 1,
    "mono16": 2,
    "16UC1": 2,
}
UNSUPPORTED = ["yuv422", "", "32FC1", "RGB8", "bayer_rggb8"]


def reference_pixel(pixel: bytes, encoding: str, bigendian: bool) -> list[int]:
    """The RGB value of one raw pixel, spelled out per encoding."""
    if encoding in ("rgb8", "rgba8"):
        return [pixel[0], pixel[1], pixel[2]]
    if encoding in ("bgr8", "bgra8"):
        return [pixel[2], pixel[1], pixel[0]]
    if encoding in ("mono8", "8UC1"):
        return [pixel[0]] * 3
    value = int.from_bytes(pixel, "big" if bigendian else "little")
    return [value >> 8] * 3


def reference_rgb(msg: Image) -> np.ndarray:
    """Decode a valid Image pixel by pixel."""
    bpp = BYTES_PER_PIXEL[msg.encoding]
    data = bytes(msg.data)
    out = np.zeros((msg.height, msg.width, 3), np.uint8)
    for row in range(msg.height):
        for col in range(msg.width):
            start = row * msg.step + col * bpp
            out[row, col] = reference_pixel(
                data[start : start + bpp], msg.encoding, bool(msg.is_bigendian)
            )
    return out


def expected_reason(msg: Image) -> str | None:
    """The InputError reason a converter must raise for ``msg``, or None when it is valid."""
    if msg.encoding not in BYTES_PER_PIXEL:
        return "unsupported_encoding"
    if msg.width == 0 or msg.height == 0:
        return "zero_size"
    if msg.step < msg.width * BYTES_PER_PIXEL[msg.encoding]:
        return "bad_step"
    if len(msg.data) < msg.height * msg.step:
        return "truncated_data"
    return None


@st.composite
def images(draw) -> Image:
    """Images with any encoding, small sizes, random padding, short or long data."""
    encoding = draw(st.sampled_from(list(SUPPORTED_ENCODINGS) + UNSUPPORTED))
    bpp = BYTES_PER_PIXEL.get(encoding, 3)
    width = draw(st.integers(0, 9))
    height = draw(st.integers(0, 9))
    step = max(0, width * bpp + draw(st.integers(-4, 6)))
    size = max(0, height * step + draw(st.sampled_from([0, 0, 0, -1, -step, 3])))
    msg = Image(
        width=width,
        height=height,
        step=step,
        encoding=encoding,
        is_bigendian=draw(st.integers(0, 1)),
    )
    msg.data = array.array("B", draw(st.binary(min_size=size, max_size=size)))
    return msg


@FUZZ
@given(images())
def test_image_converts_correctly_or_raises_input_error(msg):
    reason = expected_reason(msg)
    try:
        rgb = image_to_rgb(msg)
    except InputError as err:
        assert err.reason == reason
        return
    assert reason is None
    assert rgb.dtype == np.uint8 and rgb.shape == (msg.height, msg.width, 3)
    np.testing.assert_array_equal(rgb, reference_rgb(msg))


@FUZZ
@given(
    width=st.integers(0, 2**32 - 1),
    height=st.integers(0, 2**32 - 1),
    step=st.integers(0, 2**32 - 1),
    data=st.binary(max_size=64),
)
def test_huge_declared_sizes_never_allocate(width, height, step, data):
    msg = Image(width=width, height=height, step=step, encoding="rgb8")
    msg.data = array.array("B", data)
    try:
        rgb = image_to_rgb(msg)
    except InputError as err:
        assert err.reason == expected_reason(msg)
    else:
        assert rgb.size <= len(data)


@FUZZ
@given(
    rgb=st.integers(1, 6).flatmap(
        lambda h: st.integers(1, 6).flatmap(
            lambda w: st.binary(min_size=h * w * 3, max_size=h * w * 3).map(
                lambda b: np.frombuffer(b, np.uint8).reshape(h, w, 3)
            )
        )
    ),
    encoding=st.sampled_from(["rgb8", "bgr8", "rgba8", "bgra8"]),
)
def test_colour_images_round_trip(rgb, encoding):
    np.testing.assert_array_equal(image_to_rgb(rgb_to_image(rgb, Time(), "f", encoding)), rgb)


def encoded(fmt: str) -> bytes:
    """A small valid image in ``fmt`` (JPEG or PNG)."""
    buffer = io.BytesIO()
    rows, cols = np.mgrid[0:12, 0:16]
    rgb = np.stack([rows * 20, cols * 15, rows + cols], axis=2).astype(np.uint8)
    PILImage.fromarray(rgb).save(buffer, format=fmt)
    return buffer.getvalue()


VALID = {"JPEG": encoded("JPEG"), "PNG": encoded("PNG")}
FORMATS = ["jpeg", "png", "", "rgb8; jpeg compressed bgr8", "tiff", "16UC1; compressedDepth png"]


def check_compressed(data: bytes, fmt: str) -> None:
    """Decoding either yields an (H, W, 3) uint8 image or raises InputError."""
    msg = CompressedImage(format=fmt)
    msg.data = array.array("B", data)
    try:
        rgb = compressed_to_rgb(msg)
    except InputError as err:
        assert err.reason in {"unsupported_format", "zero_size", "too_large", "corrupt_compressed"}
        return
    assert rgb.dtype == np.uint8 and rgb.ndim == 3 and rgb.shape[2] == 3


@FUZZ
@given(data=st.binary(max_size=2048), fmt=st.sampled_from(FORMATS))
def test_random_bytes_never_escape_as_other_errors(data, fmt):
    check_compressed(data, fmt)


@FUZZ
@given(
    codec=st.sampled_from(sorted(VALID)),
    cut=st.integers(0, 2000),
    flips=st.lists(st.tuples(st.integers(0, 2000), st.integers(1, 255)), max_size=6),
    fmt=st.sampled_from(FORMATS[:4]),
)
def test_damaged_jpeg_and_png_never_escape_as_other_errors(codec, cut, flips, fmt):
    data = bytearray(VALID[codec][:cut] if cut else VALID[codec])
    for position, mask in flips:
        if data:
            data[position % len(data)] ^= mask
    check_compressed(bytes(data), fmt)


@settings(max_examples=50, deadline=None)
@given(height=st.integers(1, 40), width=st.integers(1, 40), seed=st.integers(0, 2**32 - 1))
def test_png_round_trip_exact(height, width, seed):
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    msg = rgb_to_compressed(rgb, Time(), "f", "png")
    np.testing.assert_array_equal(compressed_to_rgb(msg), rgb)


NAMES = st.sampled_from(["a", "b", "c", "d", "joint_1", "ü", ""])
POSITIONS = st.floats(allow_nan=True, allow_infinity=True, width=64)


@st.composite
def joint_states(draw) -> JointState:
    """JointStates with overlapping names; positions usually as long as names, sometimes not."""
    names = draw(st.lists(NAMES, max_size=6))
    length = draw(st.sampled_from([len(names)] * 4 + [0, len(names) + 1, max(len(names) - 1, 0)]))
    positions = draw(st.lists(POSITIONS, min_size=length, max_size=length))
    return JointState(name=names, position=positions)


def as_float32(value: float) -> np.float32:
    with np.errstate(over="ignore"):
        return np.float32(value)


@FUZZ
@given(msg=joint_states(), wanted=st.lists(NAMES, max_size=5))
def test_joint_state_gives_correct_vector_or_input_error(msg, wanted):
    names, positions = list(msg.name), list(msg.position)
    first = {}
    for name, value in zip(names, positions, strict=False):  # lengths may differ
        first.setdefault(name, value)
    try:
        result = joint_state_to_positions(msg, wanted)
    except InputError as err:
        if len(positions) != len(names):
            assert err.reason == "length_mismatch"
        elif any(name not in first for name in wanted):
            assert err.reason == "missing_joints"
        else:
            assert err.reason == "non_finite"
            assert any(not np.isfinite(as_float32(first[name])) for name in wanted)
        return
    assert len(positions) == len(names)
    assert result.dtype == np.float32 and result.shape == (len(wanted),)
    np.testing.assert_array_equal(result, [as_float32(first[name]) for name in wanted])
    assert np.isfinite(result).all()


@FUZZ
@given(
    count=st.integers(1, 8),
    data=st.data(),
)
def test_joint_state_reorders_any_permutation(count, data):
    names = [f"joint_{i}" for i in range(count)]
    order = data.draw(st.permutations(names))
    values = data.draw(st.lists(st.floats(-1e6, 1e6), min_size=count, max_size=count))
    msg = JointState(name=order, position=values)
    result = joint_state_to_positions(msg, names)
    lookup = dict(zip(order, values, strict=True))
    np.testing.assert_array_equal(result, np.array([lookup[n] for n in names], np.float32))
