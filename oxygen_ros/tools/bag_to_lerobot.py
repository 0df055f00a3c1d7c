"""Convert recorded rosbag2 episodes into a LeRobotDataset v3 folder (``oxygen-bag-to-lerobot``).

::

    oxygen-bag-to-lerobot episodes/ --out datasets/sim --mapping config/sim_dataset.yaml

Each argument is a bag (a folder with ``metadata.yaml``) or a folder of bags (its sub-folders
that are bags, in name order); every bag is one episode. The mapping (YAML, see
:mod:`oxygen_ros.data.mapping`) says which topic becomes which feature and at what fps; the
sampling rules are in :mod:`oxygen_ros.data.alignment`. Prints frames converted, frames dropped
by reason, the conversion's frames/s and the dataset's bytes per episode.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from oxygen_ros.data.bag_episode import BagError
from oxygen_ros.data.bag_to_lerobot import BagConversion, ConversionReport, convert_bags
from oxygen_ros.data.mapping import MappingError, load_mapping
from oxygen_ros.tools.cli import positive_int

DEFAULT_MAPPING = Path(__file__).resolve().parents[2] / "config" / "sim_dataset.yaml"


def find_bags(paths: Sequence[Path]) -> list[Path]:
    """The bags named by ``paths``: bags themselves, or the bags directly inside folders."""
    bags: list[Path] = []
    for path in paths:
        if (path / "metadata.yaml").is_file():
            bags.append(path)
        elif path.is_dir():
            inside = sorted(p for p in path.iterdir() if (p / "metadata.yaml").is_file())
            if not inside:
                raise BagError(f"{path}: neither a rosbag2 (no metadata.yaml) nor a folder of bags")
            bags.extend(inside)
        else:
            raise BagError(f"{path}: no such bag or folder")
    return bags


def format_report(report: ConversionReport) -> str:
    """The summary printed at the end."""
    lines = [
        f"oxygen-bag-to-lerobot: {report.frames} frames in {report.episodes} episodes from "
        f"{report.bags} bag(s) ({report.grid_frames} frames on the grid)",
        f"  dropped: {sum(report.drops.values())} frames"
        + "".join(f"\n    {reason}: {count}" for reason, count in sorted(report.drops.items())),
        f"  speed: {report.frames_per_second:.0f} frames/s ({report.seconds:.2f} s)",
        f"  size: {report.dataset_bytes / 1e6:.2f} MB, "
        f"{report.bytes_per_episode:.0f} bytes per episode",
    ]
    for bag, error in report.failed_bags.items():
        lines.append(f"  skipped {bag}: {error}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """Command-line interface of ``oxygen-bag-to-lerobot``."""
    parser = argparse.ArgumentParser(
        prog="oxygen-bag-to-lerobot",
        description="Convert rosbag2 episodes into a LeRobotDataset v3 folder.",
    )
    parser.add_argument("bags", nargs="+", type=Path, metavar="BAG_OR_DIR")
    parser.add_argument("--out", type=Path, required=True, help="dataset folder to create")
    parser.add_argument(
        "--mapping", type=Path, default=DEFAULT_MAPPING, help="topic -> feature YAML"
    )
    parser.add_argument(
        "--min-episode-frames",
        type=positive_int,
        default=1,
        help="drop runs of kept frames shorter than this (counted as short_run)",
    )
    parser.add_argument(
        "--skip-bad-bags", action="store_true", help="leave out bags that fail, and say why"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``oxygen-bag-to-lerobot``; returns the process exit status."""
    args = build_parser().parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        print(f"oxygen-bag-to-lerobot: {args.out} is not empty", file=sys.stderr)
        return 1

    def progress(conversion: BagConversion) -> None:
        frames = sum(len(e.tasks) for e in conversion.episodes)
        print(f"  {conversion.bag}: {frames} frames, {len(conversion.episodes)} episode(s)")

    try:
        mapping = load_mapping(args.mapping)
        bags = find_bags(args.bags)
        report = convert_bags(
            bags,
            args.out,
            mapping,
            min_run_frames=args.min_episode_frames,
            skip_bad_bags=args.skip_bad_bags,
            progress=progress,
        )
    except (BagError, MappingError, ValueError) as error:
        print(f"oxygen-bag-to-lerobot: {error}", file=sys.stderr)
        return 1
    print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
