"""Render a recorded episode to an animated GIF or a PNG strip (``oxygen-render-episode``).

::

    oxygen-render-episode episodes/episode_000 --out episode.gif --every 2
    oxygen-render-episode episodes/episode_000 --out episode.png --every 10

Each tile is the scene camera at one dataset frame (the same frames, time alignment and mapping
as ``oxygen-bag-to-lerobot``, :mod:`oxygen_ros.data.bag_to_lerobot`; every ``--every``-th), scaled
to ``--width``, above a panel with the task, the current subtask, the latest narration (held
since it was said), each wrapped to the tile's width and never cut, and one bar per joint: the
executed position (``joint_states``, a filled bar) and the commanded reference (both controllers'
trajectories, a red tick), on a range common to both over the episode. Every tile of an episode
has the panel of its longest text. ``.gif`` writes an animation at the frames' pace, ``.png`` a
horizontal strip.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from oxygen_ros.data.bag_episode import BagError
from oxygen_ros.data.bag_to_lerobot import convert_bag
from oxygen_ros.data.mapping import DatasetMapping, MappingError, load_mapping
from oxygen_ros.tools.cli import positive_int

DEFAULT_MAPPING = Path(__file__).resolve().parents[2] / "config" / "sim_dataset.yaml"
BACKGROUND = (24, 24, 28)
TEXT = (235, 235, 235)
EXECUTED = (80, 160, 240)
COMMANDED = (240, 60, 60)
LINE_HEIGHT = 13


@dataclasses.dataclass
class EpisodeView:
    """What a tile shows, per frame."""

    images: list[np.ndarray]
    state: np.ndarray
    action: np.ndarray
    joint_names: list[str]
    tasks: list[str]
    subtasks: list[str]
    narration: list[str]
    fps: int


def _held_strings(mapping: DatasetMapping) -> DatasetMapping:
    """The mapping with every string feature held (narration shows until the next one)."""
    features = tuple(
        dataclasses.replace(f, mode="latest") if f.kind == "string" else f for f in mapping.features
    )
    return dataclasses.replace(mapping, features=features)


def load_episode_view(
    bag: Path,
    mapping: DatasetMapping,
    scene: str = "observation.images.scene",
    state: str = "observation.state",
    action: str = "action",
) -> EpisodeView:
    """The frames of ``bag`` (all its kept runs, in order) for rendering."""
    keys = {f.key: f for f in mapping.features}
    for key in (scene, state, action):
        if key not in keys:
            raise MappingError(f"the mapping has no feature {key!r} to render")
    conversion = convert_bag(bag, _held_strings(mapping))
    episodes = conversion.episodes
    if not episodes:
        raise BagError(f"{bag}: no frame to render (drops: {dict(conversion.drops)})")

    def column(key: str) -> list:
        if key not in keys:
            return [""] * sum(len(e.tasks) for e in episodes)
        return [v for e in episodes for v in e.frames[key]]

    return EpisodeView(
        images=column(scene),
        state=np.asarray(column(state), dtype=np.float64),
        action=np.asarray(column(action), dtype=np.float64),
        joint_names=list(keys[state].names),
        tasks=[t for e in episodes for t in e.tasks],
        subtasks=column("subtask"),
        narration=column("narration"),
        fps=mapping.fps,
    )


def _font() -> ImageFont.ImageFont:
    return ImageFont.load_default()


def wrap_to_width(text: str, font: ImageFont.ImageFont, width: float) -> list[str]:
    """``text`` as lines no wider than ``width`` pixels in ``font``, broken between words (a word
    wider than a line is broken inside it): every character is kept."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        candidate = f"{line} {word}" if line else word
        if font.getlength(candidate) <= width:
            line = candidate
            continue
        if line:
            lines.append(line)
        while font.getlength(word) > width and len(word) > 1:
            fits = (i for i in range(len(word) - 1, 0, -1) if font.getlength(word[:i]) <= width)
            cut = next(fits, 1)
            lines.append(word[:cut])
            word = word[cut:]
        line = word
    if line:
        lines.append(line)
    return lines


def tile_text(view: EpisodeView, frame: int, width: int) -> list[str]:
    """The panel's text lines for ``frame``: task, subtask and narration, wrapped to the tile."""
    font = _font()
    fields = (
        ("task", view.tasks[frame]),
        ("subtask", view.subtasks[frame] or "-"),
        ("says", view.narration[frame] or "-"),
    )
    return [
        line for name, text in fields for line in wrap_to_width(f"{name}: {text}", font, width - 8)
    ]


def render_tile(view: EpisodeView, frame: int, width: int, text_rows: int = 0) -> Image.Image:
    """One frame: the scene image scaled to ``width`` over the text and joint panel; the panel
    keeps room for at least ``text_rows`` text lines, so that an episode's tiles line up."""
    image = Image.fromarray(view.images[frame])
    height = round(image.height * width / image.width)
    image = image.resize((width, height), Image.NEAREST)
    lines = tile_text(view, frame, width)
    joints = len(view.joint_names)
    rows = max(len(lines), text_rows)
    panel_height = 6 + LINE_HEIGHT * rows + 4 + joints * 10 + 4
    tile = Image.new("RGB", (width, height + panel_height), BACKGROUND)
    tile.paste(image, (0, 0))
    draw = ImageDraw.Draw(tile)
    font = _font()
    y = height + 4
    for line in lines:
        draw.text((4, y), line, fill=TEXT, font=font)
        y += LINE_HEIGHT
    y += LINE_HEIGHT * (rows - len(lines)) + 4
    both = np.concatenate([view.state, view.action])
    low, high = both.min(axis=0), both.max(axis=0)
    span = np.where(high - low > 1e-9, high - low, 1.0)
    label = min(round(max(font.getlength(name) for name in view.joint_names)) + 6, width // 2)
    bar_width = width - label - 8
    for j, name in enumerate(view.joint_names):
        draw.text((4, y - 2), name, fill=TEXT, font=font)
        x0 = 4 + label
        executed = (view.state[frame, j] - low[j]) / span[j]
        commanded = (view.action[frame, j] - low[j]) / span[j]
        draw.rectangle((x0, y, x0 + bar_width, y + 6), outline=(90, 90, 90))
        draw.rectangle((x0, y + 1, x0 + round(executed * bar_width), y + 5), fill=EXECUTED)
        cx = x0 + round(commanded * bar_width)
        draw.rectangle((cx - 1, y - 1, cx + 1, y + 7), fill=COMMANDED)
        y += 10
    return tile


def render_episode(
    view: EpisodeView, out: Path, every: int = 1, width: int = 256
) -> list[Image.Image]:
    """Write every ``every``-th frame of ``view`` to ``out`` (.gif animation or .png strip)."""
    frames = list(range(0, len(view.tasks), every))
    text_rows = max(len(tile_text(view, f, width)) for f in frames)
    tiles = [render_tile(view, f, width, text_rows) for f in frames]
    suffix = out.suffix.lower()
    if suffix == ".gif":
        duration = round(1000 * every / view.fps)
        tiles[0].save(
            out, save_all=True, append_images=tiles[1:], duration=duration, loop=0, optimize=False
        )
    elif suffix == ".png":
        strip = Image.new("RGB", (sum(t.width for t in tiles), tiles[0].height), BACKGROUND)
        for i, tile in enumerate(tiles):
            strip.paste(tile, (i * tile.width, 0))
        strip.save(out)
    else:
        raise ValueError(f"{out}: the output must end in .gif or .png")
    return tiles


def build_parser() -> argparse.ArgumentParser:
    """Command-line interface of ``oxygen-render-episode``."""
    parser = argparse.ArgumentParser(
        prog="oxygen-render-episode",
        description="Render a recorded episode (scene camera, task, subtask, narration, "
        "commanded vs executed joints) to an animated GIF or a PNG strip.",
    )
    parser.add_argument("bag", type=Path, help="the episode's rosbag2 folder")
    parser.add_argument("--out", type=Path, required=True, help="episode.gif or strip.png")
    parser.add_argument("--mapping", type=Path, default=DEFAULT_MAPPING, help="mapping YAML")
    parser.add_argument("--every", type=positive_int, default=1, help="render every k-th frame")
    parser.add_argument("--width", type=positive_int, default=256, help="tile width in pixels")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``oxygen-render-episode``; returns the process exit status."""
    args = build_parser().parse_args(argv)
    if args.out.suffix.lower() not in (".gif", ".png"):
        print("oxygen-render-episode: --out must end in .gif or .png", file=sys.stderr)
        return 1
    try:
        view = load_episode_view(args.bag, load_mapping(args.mapping))
        tiles = render_episode(view, args.out, args.every, args.width)
    except (BagError, MappingError, ValueError) as error:
        print(f"oxygen-render-episode: {error}", file=sys.stderr)
        return 1
    print(
        f"oxygen-render-episode: wrote {args.out} ({len(tiles)} of {len(view.tasks)} frames, "
        f"{tiles[0].width}x{tiles[0].height} each)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
