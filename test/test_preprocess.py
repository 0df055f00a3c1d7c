"""Preprocessing: openpi's resize_with_pad, [-1, 1] images, quantile norm stats."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from oxygen_ros.checkpoints.norm_stats import (
    NormStats,
    NormStatsError,
    load_norm_stats,
    save_norm_stats,
)
from oxygen_ros.policy_io.preprocess import pad_to_dim, resize_with_pad, to_model_range

COLOUR = np.array([10, 200, 30], dtype=np.uint8)


def solid(height: int, width: int) -> np.ndarray:
    return np.broadcast_to(COLOUR, (height, width, 3)).copy()


def content_box(image: np.ndarray):
    """(first row, last row, first col, last col) of COLOUR pixels; asserts all others are black."""
    is_colour = (image == COLOUR).all(-1)
    is_black = (image == 0).all(-1)
    assert (is_colour | is_black).all(), "every pixel is either the image colour or black padding"
    rows, cols = np.nonzero(is_colour.any(1))[0], np.nonzero(is_colour.any(0))[0]
    assert is_colour[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1].all(), (
        "content is one rectangle"
    )
    return rows[0], rows[-1], cols[0], cols[-1]


# -- resize_with_pad --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, target, box",
    [
        ((480, 640), (224, 224), (28, 195, 0, 223)),  # wide: 224x168, bars top and bottom
        ((640, 480), (224, 224), (0, 223, 28, 195)),  # tall: bars left and right
        ((300, 300), (224, 224), (0, 223, 0, 223)),  # square: no bars
        (
            (2, 3),
            (224, 224),
            (37, 185, 0, 223),
        ),  # tiny, upscaled: 149 rows, 75 rows of padding split 37/38
        (
            (256, 320),
            (60, 80),
            (0, 59, 2, 76),
        ),  # openpi's odd-padding case: 75 columns, bars 2 and 3
        ((100, 201), (224, 224), (56, 166, 0, 223)),
        ((1, 1000), (224, 224), (111, 111, 0, 223)),  # 0.22 rows would round to 0: kept at 1 row
    ],
)
def test_resize_with_pad_keeps_aspect_with_centred_black_bars(shape, target, box):
    out = resize_with_pad(solid(*shape), *target)
    assert out.shape == (*target, 3) and out.dtype == np.uint8
    assert content_box(out) == box


def test_resize_with_pad_equals_pil_bilinear_on_a_gradient():
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (120, 90, 3), dtype=np.uint8)
    out = resize_with_pad(image, 224, 224)
    # ratio = max(90/224, 120/224): 224 rows x int(90 * 224 / 120) = 168 columns, 28-column bars.
    expected = np.asarray(Image.fromarray(image).resize((168, 224), resample=Image.BILINEAR))
    np.testing.assert_array_equal(out[:, 28:196], expected)
    assert not out[:, :28].any() and not out[:, 196:].any()


def test_resize_with_pad_batches_and_identity():
    batch = np.stack([solid(48, 64)] * 6).reshape(2, 3, 48, 64, 3)
    out = resize_with_pad(batch, 24, 24)
    assert out.shape == (2, 3, 24, 24, 3)
    np.testing.assert_array_equal(out[1, 2], resize_with_pad(solid(48, 64), 24, 24))
    already = solid(24, 24)
    assert resize_with_pad(already, 24, 24) is already


@pytest.mark.parametrize(
    "images, match",
    [
        (np.zeros((8, 8, 3), np.float32), "uint8"),
        (np.zeros((8, 8, 4), np.uint8), r"\[\.\.\., H, W, 3\]"),
        (np.zeros((8, 3), np.uint8), r"\[\.\.\., H, W, 3\]"),
    ],
)
def test_resize_with_pad_rejects_bad_input(images, match):
    with pytest.raises(ValueError, match=match):
        resize_with_pad(images, 4, 4)


# -- model range ------------------------------------------------------------------------------


def test_to_model_range_is_channels_first_float32_in_minus_one_one():
    image = np.zeros((2, 4, 5, 3), np.uint8)
    image[..., 0] = 0
    image[..., 1] = 128
    image[..., 2] = 255
    out = to_model_range(image)
    assert out.shape == (2, 3, 4, 5) and out.dtype == np.float32 and out.flags.c_contiguous
    assert (out[:, 0] == -1.0).all() and (out[:, 2] == 1.0).all()
    assert (
        out[:, 1] == np.float32(128) / np.float32(255.0) * np.float32(2.0) - np.float32(1.0)
    ).all()
    full = to_model_range(np.arange(256, dtype=np.uint8).reshape(16, 16, 1).repeat(3, -1))
    assert full.min() == -1.0 and full.max() == 1.0


# -- pad_to_dim -------------------------------------------------------------------------------


def test_pad_to_dim():
    x = np.ones((2, 3))
    padded = pad_to_dim(x, 5)
    assert padded.shape == (2, 5) and (padded[:, :3] == 1).all() and (padded[:, 3:] == 0).all()
    assert pad_to_dim(x, 3) is x
    with pytest.raises(ValueError, match="width 3 down to 2"):
        pad_to_dim(x, 2)


# -- quantile normalisation -------------------------------------------------------------------


@pytest.fixture
def stats() -> NormStats:
    return NormStats(
        mean=np.array([0.0, 0.1, 2.0]),
        std=np.array([1.0, 0.5, 0.2]),
        q01=np.array([-1.5, -1.0, 1.5]),
        q99=np.array([1.5, 2.0, 2.5]),
    )


def test_normalize_quantile_formula(stats):
    y = stats.normalize_quantile(np.array([-1.5, 0.5, 2.5]))
    np.testing.assert_allclose(y, [-1.0, 0.0, 1.0], atol=3e-6)  # the 1e-6 span epsilon
    x = np.array([0.3, -0.2, 1.9], dtype=np.float32)
    expected = (x.astype(np.float64) - stats.q01) / (stats.q99 - stats.q01 + 1e-6) * 2.0 - 1.0
    assert (stats.normalize_quantile(x) == expected).all()


def test_quantile_round_trip(stats):
    x = np.random.default_rng(0).uniform(-3, 3, (10, 3))
    np.testing.assert_allclose(
        stats.unnormalize_quantile(stats.normalize_quantile(x)), x, rtol=0, atol=1e-12
    )


def test_unnormalize_passes_padding_dims_through_like_openpi(stats):
    y = np.array([[0.0, 0.0, 0.0, 0.7, -0.3]])
    out = stats.unnormalize_quantile(y)
    np.testing.assert_allclose(out[0, :3], (stats.q01 + stats.q99 + 1e-6) / 2)
    assert out[0, 3:].tolist() == [0.7, -0.3]


def test_normalize_narrower_input_uses_leading_stats_and_wider_fails(stats):
    assert stats.normalize_quantile(np.array([1.5, 2.0])).tolist() == pytest.approx(
        [1.0, 1.0], abs=1e-6
    )
    with pytest.raises(ValueError, match="width 4 with stats of width 3"):
        stats.normalize_quantile(np.zeros(4))


@pytest.mark.parametrize(
    "override, match",
    [
        ({"q99": np.array([1.5, 2.0])}, "lengths differ"),
        ({"q01": np.array([-1.5, np.nan, 1.5])}, "non-finite"),
        ({"std": np.array([1.0, -0.1, 0.2])}, "negative"),
        ({"q99": np.array([1.5, -2.0, 2.5])}, r"q99 < q01 at indices \[1\]"),
        ({"mean": np.zeros((1, 3))}, "1-D"),
    ],
)
def test_norm_stats_validation(stats, override, match):
    fields = {"mean": stats.mean, "std": stats.std, "q01": stats.q01, "q99": stats.q99, **override}
    with pytest.raises(ValueError, match=match):
        NormStats(**fields)


def test_constant_dimension_is_accepted_with_warning(caplog):
    NormStats(mean=np.zeros(2), std=np.zeros(2), q01=np.array([0.0, 1.0]), q99=np.array([1.0, 1.0]))
    assert "q99 == q01 at indices [1]" in caplog.text


# -- norm_stats.json --------------------------------------------------------------------------


def write_json(path, payload):
    path.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    return path


def entry(n=3, **override):
    e = {"mean": [0.0] * n, "std": [1.0] * n, "q01": [-1.0] * n, "q99": [1.0] * n}
    e.update(override)
    return e


def test_norm_stats_json_round_trip(tmp_path, stats):
    path = save_norm_stats(tmp_path / "assets" / "robot", {"state": stats, "actions": stats})
    assert path == tmp_path / "assets" / "robot" / "norm_stats.json"
    loaded = load_norm_stats(path.parent)  # a directory works too
    for key in ("state", "actions"):
        for field in ("mean", "std", "q01", "q99"):
            assert (getattr(loaded[key], field) == getattr(stats, field)).all()
    assert json.loads(path.read_text())["norm_stats"]["state"]["q99"] == [1.5, 2.0, 2.5]


def test_openpi_norm_stats_with_extra_keys_loads(tmp_path):
    # openpi files may carry more quantities than pi0.5 uses.
    payload = {"norm_stats": {"state": entry(8), "actions": entry(7), "extra/thing": entry(2)}}
    stats = load_norm_stats(write_json(tmp_path / "n.json", payload))
    assert stats["state"].dim == 8 and stats["actions"].dim == 7


@pytest.mark.parametrize(
    "payload, match",
    [
        ({"state": entry(), "actions": entry()}, "top-level"),
        ({"norm_stats": {"state": entry()}}, r"missing norm stats for \['actions'\]"),
        (
            {"norm_stats": {"state": entry(), "actions": entry(q01=None)}},
            r"'actions'.*lacks \['q01'\]",
        ),
        (
            {"norm_stats": {"state": entry(q99=[1.0, 1.0]), "actions": entry()}},
            "'state'.*lengths differ",
        ),
        (
            {"norm_stats": {"state": entry(), "actions": entry(q99=[1.0, -2.0, 1.0])}},
            "'actions'.*q99 < q01",
        ),
        ({"norm_stats": {"state": entry(mean=[0, "a", 1]), "actions": entry()}}, "list of numbers"),
        ({"norm_stats": {"state": [1, 2], "actions": entry()}}, "must be an object"),
    ],
)
def test_bad_norm_stats_json(tmp_path, payload, match):
    with pytest.raises(NormStatsError, match=match):
        load_norm_stats(write_json(tmp_path / "norm_stats.json", payload))


def test_nan_and_garbage_norm_stats_json(tmp_path):
    text = json.dumps({"norm_stats": {"state": entry(), "actions": entry()}}).replace(
        "-1.0", "NaN", 1
    )
    with pytest.raises(NormStatsError, match="non-finite number NaN"):
        load_norm_stats(write_json(tmp_path / "nan.json", text))
    with pytest.raises(NormStatsError, match="not valid JSON"):
        load_norm_stats(write_json(tmp_path / "cut.json", '{"norm_stats": {"sta'))
    with pytest.raises(FileNotFoundError, match="norm stats file not found"):
        load_norm_stats(tmp_path / "absent.json")
