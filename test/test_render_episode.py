"""oxygen-render-episode on the hand-made episode bag of test_bag_to_lerobot: GIF frame count and
size, PNG strip size, the scene image kept and the text/joint panel drawn and changing; long texts
wrapped, never cut, and an episode's tiles of one height."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFont
from test_bag_to_lerobot import MAPPING, write_episode_bag

from oxygen_ros.data.mapping import load_mapping
from oxygen_ros.tools.render_episode import (
    load_episode_view,
    main,
    render_episode,
    render_tile,
    tile_text,
    wrap_to_width,
)

FRAMES = 9  # the bag's kept frames (see test_bag_to_lerobot)


@pytest.fixture(scope="module")
def bag(tmp_path_factory) -> Path:
    return write_episode_bag(tmp_path_factory.mktemp("render") / "episode")


def test_gif_has_every_kth_frame(bag: Path, tmp_path: Path) -> None:
    out = tmp_path / "episode.gif"
    assert main([str(bag), "--out", str(out), "--every", "2", "--width", "128"]) == 0
    with Image.open(out) as gif:
        assert gif.n_frames == 5  # frames 0, 2, 4, 6, 8
        assert gif.width == 128 and gif.height > 128
        assert gif.info["duration"] == 200  # 2 frames at 10 fps


def test_png_strip_and_panel(bag: Path, tmp_path: Path) -> None:
    out = tmp_path / "strip.png"
    assert main([str(bag), "--out", str(out), "--every", "3", "--width", "96"]) == 0
    with Image.open(out) as strip:
        assert strip.width == 3 * 96

    view = load_episode_view(bag, load_mapping(MAPPING))
    assert len(view.tasks) == FRAMES
    assert view.narration[5] == "got it"  # the latest sentence, held (not an event) when rendering
    tile = np.asarray(render_tile(view, 1, 128))
    raw = np.asarray(Image.fromarray(view.images[1]).resize((128, 128), Image.NEAREST))
    assert np.array_equal(tile[:128], raw)  # the camera image itself is untouched
    panel = tile[128:]
    assert (panel != panel[0, -1]).any(axis=2).sum() > 200  # text and bars drawn on the panel
    other = np.asarray(render_tile(view, 4, 128))[128:]
    assert not np.array_equal(panel, other)  # subtask, narration and joints changed


def test_bad_output_suffix(bag: Path, tmp_path: Path) -> None:
    assert main([str(bag), "--out", str(tmp_path / "x.mp4")]) == 1


def test_wrap_keeps_every_word_within_the_width() -> None:
    font = ImageFont.load_default()
    text = "subtask: touch the red cube, far left and a_word_far_wider_than_any_line"
    lines = wrap_to_width(text, font, 60)
    assert len(lines) > 2
    assert all(font.getlength(line) <= 60 for line in lines)
    assert "".join(lines).replace(" ", "") == text.replace(" ", "")
    assert "subtask: touch the red cube, far left" in " ".join(lines)


def test_long_subtask_is_wrapped_and_tiles_line_up(bag: Path, tmp_path: Path) -> None:
    view = load_episode_view(bag, load_mapping(MAPPING))
    subtask = "touch the red cube, far left, then come back to the start pose"
    subtasks = [subtask if f == 2 else "" for f in range(len(view.tasks))]
    view = dataclasses.replace(view, subtasks=subtasks)
    text = " ".join(tile_text(view, 2, 96))
    assert f"subtask: {subtask}" in text
    assert len(tile_text(view, 2, 96)) > len(tile_text(view, 0, 96))
    tiles = render_episode(view, tmp_path / "strip.png", every=1, width=96)
    assert len({tile.height for tile in tiles}) == 1
    with Image.open(tmp_path / "strip.png") as strip:
        assert strip.height == tiles[0].height
