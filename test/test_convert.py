"""Unit tests for oxygen_ros.ros.convert (ROS message <-> numpy conversions)."""

import array
import io

import numpy as np
import pytest
from builtin_interfaces.msg import Duration, Time
from PIL import Image as PILImage
from sensor_msgs.msg import CompressedImage, Image, JointState

from oxygen_ros.ros.convert import (
    SUPPORTED_ENCODINGS,
    InputError,
    chunk_to_joint_trajectory,
    compressed_to_rgb,
    image_to_rgb,
    joint_state_to_positions,
    rgb_to_compressed,
    rgb_to_image,
    seconds_to_duration,
    seconds_to_stamp,
    stamp_to_seconds,
)

STAMP = Time(sec=1_700_000_000, nanosec=250_000_000)

# 2 x 2 RGB image with distinct channel values: red, green / blue, grey.
RGB = np.array(
    [[[255, 0, 0], [0, 255, 0]], [[0, 0, 255], [10, 20, 30]]],
    dtype=np.uint8,
)


def make_image(pixels: np.ndarray, encoding: str, padding: int = 0, bigendian: int = 0) -> Image:
    """An Image whose rows hold ``pixels`` (H, W, bytes per pixel) plus ``padding`` bytes."""
    height, width = pixels.shape[:2]
    rows = pixels.reshape(height, -1)
    padded = np.concatenate([rows, np.full((height, padding), 0xAB, np.uint8)], axis=1)
    msg = Image(height=height, width=width, encoding=encoding, is_bigendian=bigendian)
    msg.step = padded.shape[1]
    msg.data = array.array("B", padded.tobytes())
    return msg


# ---------------------------------------------------------------------------- raw images


@pytest.mark.parametrize(
    ("encoding", "pixels"),
    [
        ("rgb8", RGB),
        ("bgr8", RGB[:, :, ::-1]),
        ("rgba8", np.dstack([RGB, np.full((2, 2), 7, np.uint8)])),
        ("bgra8", np.dstack([RGB[:, :, ::-1], np.full((2, 2), 7, np.uint8)])),
    ],
)
@pytest.mark.parametrize("padding", [0, 1, 5])
def test_colour_encodings_give_rgb_in_order(encoding, pixels, padding):
    rgb = image_to_rgb(make_image(pixels, encoding, padding))
    assert rgb.dtype == np.uint8 and rgb.shape == (2, 2, 3)
    np.testing.assert_array_equal(rgb, RGB)
    assert rgb[0, 0].tolist() == [255, 0, 0]  # top-left is red in every encoding


@pytest.mark.parametrize("encoding", ["mono8", "8UC1"])
def test_mono8_replicates_grey(encoding):
    grey = np.array([[0, 100], [200, 255]], np.uint8)
    rgb = image_to_rgb(make_image(grey[:, :, None], encoding, padding=3))
    np.testing.assert_array_equal(rgb, np.repeat(grey[:, :, None], 3, axis=2))


@pytest.mark.parametrize("encoding", ["mono16", "16UC1"])
@pytest.mark.parametrize("bigendian", [0, 1])
def test_16_bit_keeps_high_byte_in_declared_byte_order(encoding, bigendian):
    values = np.array([[0x0000, 0x12FF], [0x8001, 0xFFFF]], np.uint16)
    raw = values.astype(">u2" if bigendian else "<u2").view(np.uint8).reshape(2, 2, 2)
    rgb = image_to_rgb(make_image(raw, encoding, padding=2, bigendian=bigendian))
    np.testing.assert_array_equal(rgb[:, :, 0], [[0x00, 0x12], [0x80, 0xFF]])
    np.testing.assert_array_equal(rgb[:, :, 0], rgb[:, :, 2])


def test_image_accepts_bytes_data_and_returns_an_owned_writable_array():
    msg = make_image(RGB, "rgb8")
    msg.data = bytes(msg.data)
    rgb = image_to_rgb(msg)
    rgb[0, 0] = 0  # must not raise nor alter the message
    assert msg.data[0] == 255


def test_trailing_bytes_beyond_height_times_step_are_ignored():
    msg = make_image(RGB, "rgb8")
    msg.data = msg.data + array.array("B", [1, 2, 3])
    np.testing.assert_array_equal(image_to_rgb(msg), RGB)


def test_truncated_image_names_sizes():
    msg = make_image(RGB, "rgb8", padding=2)
    msg.data = msg.data[:-1]
    with pytest.raises(InputError, match=r"has 15 bytes, expected 16 \(height 2 x step 8\)") as err:
        image_to_rgb(msg)
    assert err.value.reason == "truncated_data"


def test_realistic_truncation_message():
    msg = Image(height=224, width=224, encoding="rgb8", step=672)
    msg.data = array.array("B", bytes(1000))
    with pytest.raises(InputError) as err:
        image_to_rgb(msg)
    assert str(err.value) == ("Image data has 1000 bytes, expected 150528 (height 224 x step 672)")


@pytest.mark.parametrize(("width", "height"), [(0, 2), (2, 0), (0, 0)])
def test_zero_size(width, height):
    msg = Image(width=width, height=height, encoding="rgb8", step=width * 3)
    with pytest.raises(InputError) as err:
        image_to_rgb(msg)
    assert err.value.reason == "zero_size"


def test_step_smaller_than_row():
    msg = make_image(RGB, "rgb8")
    msg.step = 5
    with pytest.raises(InputError, match="step 5 is smaller than width 2 x 3") as err:
        image_to_rgb(msg)
    assert err.value.reason == "bad_step"


def test_unsupported_encoding_lists_supported_ones():
    msg = make_image(RGB, "yuv422")
    with pytest.raises(InputError) as err:
        image_to_rgb(msg)
    assert err.value.reason == "unsupported_encoding"
    assert "'yuv422'" in str(err.value)
    assert all(encoding in str(err.value) for encoding in SUPPORTED_ENCODINGS)


def test_input_error_is_a_value_error():
    assert issubclass(InputError, ValueError)


@pytest.mark.parametrize("encoding", ["rgb8", "bgr8", "rgba8", "bgra8"])
def test_rgb_to_image_round_trips(encoding):
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (5, 7, 3), dtype=np.uint8)
    msg = rgb_to_image(rgb, STAMP, "cam", encoding)
    assert (msg.height, msg.width, msg.encoding) == (5, 7, encoding)
    assert msg.step == 7 * (4 if "a" in encoding else 3)
    assert msg.header.stamp == STAMP and msg.header.frame_id == "cam"
    assert isinstance(msg.data, array.array)
    np.testing.assert_array_equal(image_to_rgb(msg), rgb)


def test_rgb_to_image_bgr_byte_order():
    msg = rgb_to_image(RGB, STAMP, "cam", "bgr8")
    assert list(msg.data[:3]) == [0, 0, 255]


def test_rgb_to_image_mono8_uses_luma():
    msg = rgb_to_image(RGB, STAMP, "cam", "mono8")
    assert msg.step == 2
    assert list(msg.data) == [76, 150, 29, 18]


def test_rgb_to_image_rejects_bad_input():
    with pytest.raises(ValueError):
        rgb_to_image(np.zeros((2, 2), np.uint8), STAMP, "cam")
    with pytest.raises(ValueError):
        rgb_to_image(np.zeros((2, 2, 3), np.float32), STAMP, "cam")
    with pytest.raises(InputError):
        rgb_to_image(RGB, STAMP, "cam", "yuv422")


# ---------------------------------------------------------------------------- compressed


def smooth_image(height: int = 48, width: int = 64) -> np.ndarray:
    rows, cols = np.mgrid[0:height, 0:width]
    return np.stack([rows * 4, cols * 3, (rows + cols) * 2], axis=2).astype(np.uint8)


def test_jpeg_round_trip_within_tolerance():
    rgb = smooth_image()
    msg = rgb_to_compressed(rgb, STAMP, "cam", "jpeg", quality=95)
    assert msg.format == "rgb8; jpeg compressed bgr8"
    assert msg.header.stamp == STAMP and msg.header.frame_id == "cam"
    decoded = compressed_to_rgb(msg)
    assert decoded.shape == rgb.shape and decoded.dtype == np.uint8
    assert np.abs(decoded.astype(int) - rgb).mean() < 3


def test_jpeg_keeps_colour_channels_in_rgb_order():
    red = np.zeros((16, 16, 3), np.uint8)
    red[..., 0] = 255
    decoded = compressed_to_rgb(rgb_to_compressed(red, STAMP, "cam"))
    assert decoded[8, 8, 0] > 240 and decoded[8, 8, 1:].max() < 15


def test_png_round_trip_is_exact():
    rgb = smooth_image()
    msg = rgb_to_compressed(rgb, STAMP, "cam", "png")
    np.testing.assert_array_equal(compressed_to_rgb(msg), rgb)


@pytest.mark.parametrize(
    "fmt",
    ["jpeg", "png", "JPEG", "", "rgb8; jpeg compressed bgr8", "bgr8; png compressed bgr8", "jpg"],
)
def test_format_strings_seen_in_the_wild(fmt):
    codec = "PNG" if "png" in fmt else "JPEG"
    buffer = io.BytesIO()
    PILImage.fromarray(smooth_image()).save(buffer, format=codec)
    msg = CompressedImage(format=fmt)
    msg.data = array.array("B", buffer.getvalue())
    assert compressed_to_rgb(msg).shape == (48, 64, 3)


@pytest.mark.parametrize("mode", ["L", "RGBA", "P"])
def test_png_modes_convert_to_rgb(mode):
    buffer = io.BytesIO()
    PILImage.fromarray(smooth_image()).convert(mode).save(buffer, format="PNG")
    msg = CompressedImage(format="png")
    msg.data = array.array("B", buffer.getvalue())
    assert compressed_to_rgb(msg).shape == (48, 64, 3)


def test_corrupt_compressed():
    good = rgb_to_compressed(smooth_image(), STAMP, "cam")
    for data in (b"not an image at all", bytes(good.data)[:100]):
        msg = CompressedImage(format="jpeg")
        msg.data = array.array("B", data)
        with pytest.raises(InputError, match="could not be decoded") as err:
            compressed_to_rgb(msg)
        assert err.value.reason == "corrupt_compressed"


def test_empty_compressed():
    with pytest.raises(InputError) as err:
        compressed_to_rgb(CompressedImage(format="jpeg"))
    assert err.value.reason == "zero_size"


@pytest.mark.parametrize("fmt", ["tiff", "16UC1; compressedDepth png", "rgb8; theora"])
def test_unsupported_compressed_format(fmt):
    msg = rgb_to_compressed(smooth_image(), STAMP, "cam", "png")
    msg.format = fmt
    with pytest.raises(InputError) as err:
        compressed_to_rgb(msg)
    assert err.value.reason == "unsupported_format"


def test_compressed_pixel_limit_is_checked_before_decoding():
    msg = rgb_to_compressed(smooth_image(), STAMP, "cam", "png")
    with pytest.raises(InputError, match="claims 64x48 pixels, more than the limit 100") as err:
        compressed_to_rgb(msg, max_pixels=100)
    assert err.value.reason == "too_large"


def test_rgb_to_compressed_rejects_unknown_codec():
    with pytest.raises(ValueError):
        rgb_to_compressed(smooth_image(), STAMP, "cam", "webp")


# ---------------------------------------------------------------------------- joint states


def joint_state(names, positions) -> JointState:
    return JointState(name=list(names), position=[float(p) for p in positions])


def test_joints_reordered_by_name_and_extras_ignored():
    msg = joint_state(["gripper", "b", "a", "c"], [9.0, 2.0, 1.0, 3.0])
    positions = joint_state_to_positions(msg, ["a", "b", "c"])
    assert positions.dtype == np.float32
    np.testing.assert_array_equal(positions, [1.0, 2.0, 3.0])


def test_duplicate_joint_name_first_wins():
    msg = joint_state(["a", "a"], [1.0, 2.0])
    np.testing.assert_array_equal(joint_state_to_positions(msg, ["a"]), [1.0])


def test_missing_joints_are_named():
    msg = joint_state(["a", "b"], [1.0, 2.0])
    with pytest.raises(InputError, match=r"\['c', 'd'\]") as err:
        joint_state_to_positions(msg, ["a", "c", "b", "d"])
    assert err.value.reason == "missing_joints"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e300])
def test_non_finite_positions_are_named(bad):
    msg = joint_state(["a", "b", "c"], [1.0, bad, 3.0])
    with pytest.raises(InputError, match=r"\['b'\]") as err:
        joint_state_to_positions(msg, ["a", "b", "c"])
    assert err.value.reason == "non_finite"


def test_non_finite_unrequested_joint_is_ignored():
    msg = joint_state(["a", "b"], [1.0, float("nan")])
    np.testing.assert_array_equal(joint_state_to_positions(msg, ["a"]), [1.0])


@pytest.mark.parametrize("positions", [[1.0], [], [1.0, 2.0, 3.0]])
def test_position_length_must_match_names(positions):
    msg = joint_state(["a", "b"], positions)
    with pytest.raises(InputError, match="2 names but") as err:
        joint_state_to_positions(msg, ["a"])
    assert err.value.reason == "length_mismatch"


# ---------------------------------------------------------------------------- trajectories


def test_chunk_to_joint_trajectory_timing_and_stamp():
    actions = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    msg = chunk_to_joint_trajectory(actions, ["a", "b", "c"], 0.02, STAMP, frame_id="base")
    assert msg.header.stamp == STAMP and msg.header.frame_id == "base"
    assert list(msg.joint_names) == ["a", "b", "c"]
    assert len(msg.points) == 4
    for i, point in enumerate(msg.points):
        np.testing.assert_allclose(point.positions, actions[i], rtol=1e-6)
        assert stamp_to_seconds(point.time_from_start) == pytest.approx((i + 1) * 0.02, abs=1e-9)
    assert msg.points[-1].time_from_start == Duration(sec=0, nanosec=80_000_000)


def test_chunk_long_horizon_crosses_whole_seconds():
    msg = chunk_to_joint_trajectory(np.zeros((50, 1)), ["a"], 0.05, STAMP)
    assert msg.points[19].time_from_start == Duration(sec=1, nanosec=0)
    assert msg.points[49].time_from_start == Duration(sec=2, nanosec=500_000_000)


@pytest.mark.parametrize("shape", [(4,), (4, 2), (1, 4, 3)])
def test_chunk_shape_must_match_joints(shape):
    with pytest.raises(ValueError, match="actions must be"):
        chunk_to_joint_trajectory(np.zeros(shape), ["a", "b", "c"], 0.02, STAMP)


@pytest.mark.parametrize("dt", [0.0, -0.1, float("nan"), float("inf")])
def test_chunk_dt_must_be_positive(dt):
    with pytest.raises(ValueError, match="dt"):
        chunk_to_joint_trajectory(np.zeros((2, 1)), ["a"], dt, STAMP)


def test_chunk_non_finite_actions():
    actions = np.zeros((2, 1))
    actions[1, 0] = np.nan
    with pytest.raises(InputError) as err:
        chunk_to_joint_trajectory(actions, ["a"], 0.02, STAMP)
    assert err.value.reason == "non_finite"


# ---------------------------------------------------------------------------- time


@pytest.mark.parametrize(
    ("seconds", "sec", "nanosec"),
    [
        (0.0, 0, 0),
        (1.5, 1, 500_000_000),
        (0.02, 0, 20_000_000),
        (-0.25, -1, 750_000_000),
        (2.9999999999, 3, 0),
    ],
)
def test_seconds_to_duration_normalises(seconds, sec, nanosec):
    duration = seconds_to_duration(seconds)
    assert (duration.sec, duration.nanosec) == (sec, nanosec)
    assert stamp_to_seconds(duration) == pytest.approx(seconds, abs=1e-9)


def test_stamp_helpers_round_trip():
    assert stamp_to_seconds(STAMP) == pytest.approx(1_700_000_000.25)
    assert seconds_to_stamp(1_700_000_000.25) == STAMP


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), 2.0**40])
def test_seconds_out_of_range(seconds):
    with pytest.raises(ValueError):
        seconds_to_duration(seconds)


def test_chunk_to_joint_trajectory_carries_velocities_when_given():
    positions = np.array([[0.1, 0.2], [0.3, 0.4]])
    velocities = np.array([[1.0, -1.0], [0.5, 0.0]])
    msg = chunk_to_joint_trajectory(positions, ["a", "b"], 0.1, STAMP, velocities=velocities)
    assert [list(p.velocities) for p in msg.points] == [[1.0, -1.0], [0.5, 0.0]]
    assert [list(p.positions) for p in msg.points] == [[0.1, 0.2], [0.3, 0.4]]
    assert not chunk_to_joint_trajectory(positions, ["a", "b"], 0.1, STAMP).points[0].velocities
    with pytest.raises(ValueError, match="velocities"):
        chunk_to_joint_trajectory(positions, ["a", "b"], 0.1, STAMP, velocities=np.zeros((3, 2)))
    with pytest.raises(InputError, match="velocities"):
        chunk_to_joint_trajectory(
            positions, ["a", "b"], 0.1, STAMP, velocities=np.full((2, 2), np.nan)
        )
