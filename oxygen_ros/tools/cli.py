"""argparse value types shared by the command-line tools, the split of a command line at
``--ros-args``, and ROS namespaces for bag topics."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def positive_int(text: str) -> int:
    """An integer > 0."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def split_ros_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``argv`` as (the tool's own arguments, ``--ros-args`` and all after it, for rclpy)."""
    argv = list(argv)
    split = argv.index("--ros-args") if "--ros-args" in argv else len(argv)
    return argv[:split], argv[split:]


_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_NAMESPACE = re.compile(rf"/?({_NAME}(/{_NAME})*)?/?")


def namespace(text: str) -> str:
    """A ROS namespace (``r1``, ``/fleet/r1``; empty or ``/``: the root), returned absolute
    without a trailing slash (``/r1``), or ``""`` for the root."""
    if not _NAMESPACE.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"not a ROS namespace: {text!r} (names of letters, digits and _ separated by /, "
            "not starting with a digit)"
        )
    name = text.strip("/")
    return f"/{name}" if name else ""


def namespaced(topic: str, ns: str) -> str:
    """Bag topic ``topic`` (fully qualified, as rosbag2 stores names) moved under namespace ``ns``:
    ``namespaced("/joint_states", "r1") == "/r1/joint_states"``; ``ns`` empty keeps it."""
    return namespace(ns) + "/" + topic.lstrip("/")
