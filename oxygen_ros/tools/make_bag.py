"""Write a synthetic rosbag2 with two cameras and joint states (``oxygen-make-bag``).

The bag holds what the oxygen_ros node consumes:

* ``/camera/base/image_raw`` and ``/camera/wrist/image_raw`` (``sensor_msgs/Image`` rgb8, or
  ``.../image_raw/compressed`` ``sensor_msgs/CompressedImage`` jpeg with ``--compressed``) at
  30 Hz, each showing a coloured disc moving over a gradient, different per camera;
* ``/joint_states`` (``sensor_msgs/JointState``) at 100 Hz for ``joint_1..joint_N``, following
  smooth sinusoids with matching velocities.

With ``--namespace r1`` every topic is under ``/r1`` (``/r1/camera/base/image_raw``,
``/r1/joint_states``): the inputs of a node started in that namespace with the shipped configs,
whose input topics are relative. ``--distro`` picks the message definitions (default: the ROS 2
distribution in use, see :func:`default_distro`).

Header stamps equal the bag's receive timestamps and start at a fixed epoch, so two bags made
with the same options are identical. Serialisation and storage use the ``rosbags`` library
(mcap by default, sqlite3 on request); no ROS installation is needed.
"""

from __future__ import annotations

import argparse
import heapq
import io
import math
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image as PILImage
from rosbags.rosbag2 import StoragePlugin, Writer
from rosbags.typesys import Stores, get_typestore

from oxygen_ros.tools.cli import namespace, namespaced, positive_float, positive_int

if TYPE_CHECKING:
    from rosbags.typesys.store import Typestore

EPOCH_NS = 1_700_000_000 * 1_000_000_000
"""Bag start time (2023-11-14T22:13:20Z); fixed so generated bags are reproducible."""

CAMERAS = ("base", "wrist")
JOINT_STATES_TOPIC = "/joint_states"

_STORES = {"humble": Stores.ROS2_HUMBLE, "jazzy": Stores.ROS2_JAZZY, "kilted": Stores.ROS2_KILTED}
_STORAGES = {"mcap": StoragePlugin.MCAP, "sqlite3": StoragePlugin.SQLITE3}

Event = tuple[int, object, bytes]
"""One bag record: (timestamp ns, rosbags connection, serialised CDR message)."""


def camera_topic(camera: str, compressed: bool = False, ns: str = "") -> str:
    """Topic name of ``camera``'s raw image stream, or of its compressed transport, under
    namespace ``ns`` (default: the root)."""
    topic = namespaced(f"/camera/{camera}/image_raw", ns)
    return f"{topic}/compressed" if compressed else topic


def joint_names(count: int) -> list[str]:
    """Names ``joint_1 .. joint_<count>``."""
    return [f"joint_{i}" for i in range(1, count + 1)]


def default_distro() -> str:
    """The ROS distribution in use (``$ROS_DISTRO``, else the installed rclpy wheel's) if we know
    its message store, else ``jazzy``, the package's default distribution."""
    distro = os.environ.get("ROS_DISTRO", "") or _installed_distro()
    return distro if distro in _STORES else "jazzy"


def message_store(distro: str | None = None) -> Typestore:
    """The rosbags message definitions of ``distro`` (default: :func:`default_distro`)."""
    return get_typestore(_STORES[distro or default_distro()])


def _installed_distro() -> str:
    """The distribution of the installed rclpy (no rclpy import: bags are made without ROS)."""
    try:
        from oxygen_ros.ros.rclpy_compat import ros_distro
    except ImportError:  # no rclpy at all
        return ""
    return ros_distro()


# ----------------------------------------------------------------------------------------------
# Synthetic content
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Look:
    """Appearance and motion of one camera's scene."""

    top_left: tuple[int, int, int]
    bottom_right: tuple[int, int, int]
    disc: tuple[int, int, int]
    period_s: float
    phase: float


_LOOKS = {
    "base": _Look((20, 40, 120), (200, 220, 240), (230, 40, 30), period_s=4.0, phase=0.0),
    "wrist": _Look((90, 60, 10), (250, 200, 120), (30, 170, 60), period_s=2.5, phase=1.3),
}


class _Scene:
    """A disc moving on a Lissajous path over a diagonal gradient; one frame ~0.3 ms."""

    def __init__(self, look: _Look, width: int, height: int) -> None:
        self._look = look
        self._width, self._height = width, height
        self._rows, self._cols = np.ogrid[0:height, 0:width]
        weight = ((self._rows / max(height - 1, 1) + self._cols / max(width - 1, 1)) / 2)[..., None]
        start, end = np.array(look.top_left), np.array(look.bottom_right)
        self._background = (start + (end - start) * weight).astype(np.uint8)
        self._radius = max(1.0, min(width, height) / 8)

    def render(self, t: float) -> np.ndarray:
        """The (H, W, 3) uint8 RGB frame at ``t`` seconds."""
        angle = 2 * math.pi * t / self._look.period_s + self._look.phase
        cx = self._width / 2 + 0.3 * self._width * math.cos(angle)
        cy = self._height / 2 + 0.3 * self._height * math.sin(2 * angle)
        frame = self._background.copy()
        disc = (self._cols - cx) ** 2 + (self._rows - cy) ** 2 <= self._radius**2
        frame[disc] = self._look.disc
        return frame


def joint_motion(t: float, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions (rad) and velocities (rad/s) of ``count`` joints at ``t`` seconds."""
    j = np.arange(count)
    amplitude = 0.6 / (1 + 0.15 * j)
    omega = 2 * math.pi * (0.2 + 0.05 * j)
    phase = 0.7 * j
    return amplitude * np.sin(omega * t + phase), amplitude * omega * np.cos(omega * t + phase)


def _stamps(duration_s: float, rate_hz: float) -> Iterator[int]:
    """Nanosecond offsets of a ``rate_hz`` stream over ``[0, duration_s)``."""
    count = math.ceil(duration_s * rate_hz - 1e-9)
    return (round(i * 1e9 / rate_hz) for i in range(count))


# ----------------------------------------------------------------------------------------------
# Messages
# ----------------------------------------------------------------------------------------------


class _Messages:
    """Builds and serialises the bag's messages with a rosbags typestore."""

    def __init__(self, typestore: Typestore) -> None:
        self._store = typestore
        types = typestore.types
        self._time = types["builtin_interfaces/msg/Time"]
        self._header = types["std_msgs/msg/Header"]
        self._image = types["sensor_msgs/msg/Image"]
        self._compressed = types["sensor_msgs/msg/CompressedImage"]
        self._joint_state = types["sensor_msgs/msg/JointState"]

    def header(self, stamp_ns: int, frame_id: str) -> object:
        """A std_msgs/Header at absolute time ``stamp_ns``."""
        sec, nanosec = divmod(stamp_ns, 1_000_000_000)
        return self._header(stamp=self._time(sec=sec, nanosec=nanosec), frame_id=frame_id)

    def image(self, stamp_ns: int, frame_id: str, rgb: np.ndarray) -> bytes:
        """CDR bytes of an rgb8 sensor_msgs/Image."""
        height, width, _ = rgb.shape
        msg = self._image(
            header=self.header(stamp_ns, frame_id),
            height=height,
            width=width,
            encoding="rgb8",
            is_bigendian=0,
            step=width * 3,
            data=rgb.reshape(-1),
        )
        return self._serialize(msg)

    def compressed(self, stamp_ns: int, frame_id: str, rgb: np.ndarray) -> bytes:
        """CDR bytes of a jpeg sensor_msgs/CompressedImage."""
        buffer = io.BytesIO()
        PILImage.fromarray(rgb).save(buffer, format="JPEG", quality=90)
        msg = self._compressed(
            header=self.header(stamp_ns, frame_id),
            format="rgb8; jpeg compressed bgr8",
            data=np.frombuffer(buffer.getvalue(), dtype=np.uint8),
        )
        return self._serialize(msg)

    def joint_state(self, stamp_ns: int, names: list[str], t: float) -> bytes:
        """CDR bytes of a sensor_msgs/JointState sampled from :func:`joint_motion` at ``t``."""
        position, velocity = joint_motion(t, len(names))
        msg = self._joint_state(
            header=self.header(stamp_ns, ""),
            name=names,
            position=position,
            velocity=velocity,
            effort=np.zeros(0),
        )
        return self._serialize(msg)

    def _serialize(self, msg: object) -> bytes:
        return bytes(self._store.serialize_cdr(msg, msg.__msgtype__))


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def _camera_events(
    messages: _Messages,
    connection: object,
    camera: str,
    compressed: bool,
    width: int,
    height: int,
    duration_s: float,
    rate_hz: float,
) -> Iterator[Event]:
    """Time-ordered records of one camera."""
    scene = _Scene(_LOOKS[camera], width, height)
    frame_id = f"camera_{camera}_optical_frame"
    encode = messages.compressed if compressed else messages.image
    for offset in _stamps(duration_s, rate_hz):
        stamp = EPOCH_NS + offset
        yield stamp, connection, encode(stamp, frame_id, scene.render(offset * 1e-9))


def _joint_events(
    messages: _Messages, connection: object, names: list[str], duration_s: float, rate_hz: float
) -> Iterator[Event]:
    """Time-ordered records of the joint states."""
    for offset in _stamps(duration_s, rate_hz):
        stamp = EPOCH_NS + offset
        yield stamp, connection, messages.joint_state(stamp, names, offset * 1e-9)


def write_synthetic_bag(
    out_dir: Path | str,
    duration_s: float = 10.0,
    *,
    width: int = 224,
    height: int = 224,
    camera_rate_hz: float = 30.0,
    joint_rate_hz: float = 100.0,
    num_joints: int = 7,
    compressed: bool = False,
    storage: str = "mcap",
    distro: str | None = None,
    ns: str = "",
) -> Path:
    """Write the synthetic bag to ``out_dir`` (which must not exist) and return its path.

    Args:
        out_dir: bag directory to create.
        duration_s: length of the recording in seconds.
        width, height: camera resolution in pixels.
        camera_rate_hz, joint_rate_hz: publication rates.
        num_joints: number of joints ``joint_1..joint_N``.
        compressed: write jpeg ``CompressedImage`` on ``.../image_raw/compressed`` topics.
        storage: ``"mcap"`` or ``"sqlite3"``.
        distro: ROS distribution whose message definitions to use (humble, jazzy, kilted);
            default: :func:`default_distro`.
        ns: namespace of every topic (default: the root).
    """
    if duration_s <= 0 or width <= 0 or height <= 0 or num_joints <= 0:
        raise ValueError("duration, width, height and num_joints must be positive")
    if camera_rate_hz <= 0 or joint_rate_hz <= 0:
        raise ValueError("rates must be positive")
    typestore = message_store(distro)
    messages = _Messages(typestore)
    image_type = "sensor_msgs/msg/CompressedImage" if compressed else "sensor_msgs/msg/Image"
    path = Path(out_dir)
    with Writer(path, version=Writer.VERSION_LATEST, storage_plugin=_STORAGES[storage]) as writer:
        streams = [
            _camera_events(
                messages,
                writer.add_connection(
                    camera_topic(cam, compressed, ns), image_type, typestore=typestore
                ),
                cam,
                compressed,
                width,
                height,
                duration_s,
                camera_rate_hz,
            )
            for cam in CAMERAS
        ]
        joints = writer.add_connection(
            namespaced(JOINT_STATES_TOPIC, ns), "sensor_msgs/msg/JointState", typestore=typestore
        )
        streams.append(
            _joint_events(messages, joints, joint_names(num_joints), duration_s, joint_rate_hz)
        )
        for stamp, connection, raw in heapq.merge(*streams, key=lambda event: event[0]):
            writer.write(connection, stamp, raw)
    return path


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """Command-line interface of ``oxygen-make-bag``."""
    parser = argparse.ArgumentParser(
        prog="oxygen-make-bag",
        description="Write a synthetic rosbag2: two moving-scene cameras at 30 Hz and "
        "/joint_states at 100 Hz.",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("oxygen_synthetic_bag"),
        help="bag directory to create (must not exist)",
    )
    parser.add_argument("--duration", type=positive_float, default=10.0, help="seconds")
    parser.add_argument("--width", type=positive_int, default=224, help="image width")
    parser.add_argument("--height", type=positive_int, default=224, help="image height")
    parser.add_argument("--joints", type=positive_int, default=7, help="number of joints")
    parser.add_argument("--camera-rate", type=positive_float, default=30.0, help="Hz")
    parser.add_argument("--joint-rate", type=positive_float, default=100.0, help="Hz")
    parser.add_argument(
        "--compressed",
        action="store_true",
        help="write jpeg CompressedImage on .../image_raw/compressed",
    )
    parser.add_argument("--storage", choices=sorted(_STORAGES), default="mcap")
    parser.add_argument(
        "--distro",
        choices=sorted(_STORES),
        default=default_distro(),
        help="message definitions of this ROS 2 distribution (default: the one in use, "
        "%(default)s)",
    )
    parser.add_argument(
        "--namespace",
        type=namespace,
        default="",
        metavar="NS",
        help="put every topic under this namespace, e.g. r1: /r1/camera/base/image_raw, "
        "/r1/joint_states (default: none)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``oxygen-make-bag``; returns the process exit status."""
    args = build_parser().parse_args(argv)
    if args.out.exists():
        print(f"oxygen-make-bag: {args.out} exists; choose another --out", file=sys.stderr)
        return 1
    path = write_synthetic_bag(
        args.out,
        args.duration,
        width=args.width,
        height=args.height,
        camera_rate_hz=args.camera_rate,
        joint_rate_hz=args.joint_rate,
        num_joints=args.joints,
        compressed=args.compressed,
        storage=args.storage,
        distro=args.distro,
        ns=args.namespace,
    )
    kind = "jpeg" if args.compressed else "rgb8"
    print(
        f"oxygen-make-bag: wrote {path} ({args.storage}, {args.duration:g} s, "
        f"2 cameras {args.width}x{args.height} {kind}, {args.joints} joints, ROS 2 "
        f"{args.distro} messages, topics under {args.namespace or '/'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
