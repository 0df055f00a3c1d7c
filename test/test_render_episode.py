"""oxygen-render-episode on the hand-made episode bag of test_bag_to_lerobot: GIF frame count and
size, PNG strip size, the scene image kept and the text/joint panel drawn and changing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from test_bag_to_lerobot import MAPPING, write_episode_bag

from oxygen_ros.data.mapping import load_mapping
from oxygen_ros.tools.render_episode import load_episode_view, main, render_tile

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
