"""ROS messages (as ``rosbags`` decodes them) -> numpy values of dataset features.

* :func:`image_to_rgb`: ``sensor_msgs/Image`` rgb8 / bgr8 / rgba8 / bgra8 / mono8 -> (H, W, 3)
  uint8 RGB, honouring ``step`` (row padding), optionally resized (PIL bilinear);
* :func:`joint_positions`: ``sensor_msgs/JointState`` -> float32 positions in a given name order;
* :class:`TrajectoryReference` / :func:`sample_reference`: the commanded position of each joint
  from the latest ``trajectory_msgs/JointTrajectory`` of each controller, at a given time (the
  converter asks one frame period after the frame, :mod:`.bag_to_lerobot`).

Trajectory sampling (a controller's reference at time ``t``), with the trajectory's start time
``start`` = its header stamp, or its receipt time when the stamp is zero (ros2_control's "now"):

* before the first point (``t < start + time_from_start[0]``): the first point's positions. We
  do *not* interpolate from the previous reference or the measured state as the controller does;
  the action label is the position the command asks for;
* between two points: linear interpolation of positions (the controller's spline with positions
  only is linear too);
* after the last point: the last point's positions (the controller holds it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PIL import Image as PILImage

_CHANNELS = {"rgb8": 3, "bgr8": 3, "rgba8": 4, "bgra8": 4, "mono8": 1}


class MessageValueError(ValueError):
    """A message cannot give the feature's value; the message names topic and field."""


def image_to_rgb(msg: object, topic: str, resize: tuple[int, int] | None = None) -> np.ndarray:
    """(H, W, 3) uint8 RGB of a ``sensor_msgs/Image``; ``resize`` is (height, width)."""
    encoding = str(msg.encoding).lower()
    channels = _CHANNELS.get(encoding)
    if channels is None:
        raise MessageValueError(
            f"{topic}: image encoding {msg.encoding!r} is not supported "
            f"(supported: {', '.join(_CHANNELS)})"
        )
    height, width, step = int(msg.height), int(msg.width), int(msg.step)
    data = np.asarray(msg.data, dtype=np.uint8)
    if step < width * channels or data.size < step * height:
        raise MessageValueError(
            f"{topic}: image data of {data.size} bytes does not hold {height} rows of step {step} "
            f"for {width}x{height} {encoding}"
        )
    rows = data[: step * height].reshape(height, step)[:, : width * channels]
    pixels = rows.reshape(height, width, channels)
    if encoding == "mono8":
        rgb = np.repeat(pixels, 3, axis=2)
    elif encoding.startswith("bgr"):
        rgb = pixels[:, :, 2::-1]
    else:
        rgb = pixels[:, :, :3]
    if resize is not None and (height, width) != tuple(resize):
        image = PILImage.fromarray(np.ascontiguousarray(rgb))
        rgb = np.asarray(image.resize((resize[1], resize[0]), PILImage.BILINEAR))
    return np.ascontiguousarray(rgb)


def joint_positions(msg: object, names: Sequence[str], topic: str) -> np.ndarray:
    """float32 positions of ``names`` (in that order) from a ``sensor_msgs/JointState``."""
    order = {name: i for i, name in enumerate(msg.name)}
    missing = [n for n in names if n not in order]
    if missing:
        raise MessageValueError(
            f"{topic}: JointState has no joint {', '.join(map(repr, missing))} "
            f"(it has {', '.join(msg.name)})"
        )
    position = np.asarray(msg.position, dtype=np.float64)
    if position.size < len(msg.name):
        raise MessageValueError(
            f"{topic}: JointState has {len(msg.name)} names but {position.size} positions"
        )
    return position[[order[n] for n in names]].astype(np.float32)


@dataclass(frozen=True)
class TrajectoryReference:
    """One received JointTrajectory as a piecewise-linear reference."""

    joint_names: tuple[str, ...]
    start_ns: int
    point_ns: np.ndarray
    """int64 times of the points relative to ``start_ns`` (strictly increasing)."""
    positions: np.ndarray
    """(points, joints) float64."""

    @classmethod
    def from_message(cls, msg: object, receipt_ns: int, topic: str) -> TrajectoryReference:
        """The reference of a ``trajectory_msgs/JointTrajectory`` received at ``receipt_ns``."""
        stamp = int(msg.header.stamp.sec) * 1_000_000_000 + int(msg.header.stamp.nanosec)
        names = tuple(msg.joint_names)
        if not msg.points:
            raise MessageValueError(f"{topic}: JointTrajectory has no points")
        times = np.array(
            [
                int(p.time_from_start.sec) * 1_000_000_000 + int(p.time_from_start.nanosec)
                for p in msg.points
            ],
            dtype=np.int64,
        )
        if np.any(np.diff(times) <= 0):
            raise MessageValueError(
                f"{topic}: JointTrajectory time_from_start is not strictly increasing: "
                f"{(times / 1e9).tolist()}"
            )
        positions = np.array([np.asarray(p.positions, dtype=np.float64) for p in msg.points])
        if positions.ndim != 2 or positions.shape[1] != len(names):
            raise MessageValueError(
                f"{topic}: JointTrajectory points need {len(names)} positions each "
                f"({', '.join(names)})"
            )
        return cls(names, stamp if stamp != 0 else receipt_ns, times, positions)

    def sample(self, t_ns: int) -> np.ndarray:
        """Positions of every joint at timeline time ``t_ns`` (see the module docstring)."""
        rel = t_ns - self.start_ns
        times = self.point_ns
        if rel <= times[0]:
            return self.positions[0].copy()
        if rel >= times[-1]:
            return self.positions[-1].copy()
        after = int(np.searchsorted(times, rel, side="right"))
        t0, t1 = times[after - 1], times[after]
        w = (rel - t0) / (t1 - t0)
        return (1.0 - w) * self.positions[after - 1] + w * self.positions[after]


def sample_reference(
    references: Sequence[TrajectoryReference | None],
    topics: Sequence[str],
    names: Sequence[str],
    t_ns: int,
) -> np.ndarray:
    """float32 reference of ``names`` at ``t_ns``: each joint from the first of ``references``
    (each controller's latest trajectory, or None) that commands it."""
    out = np.empty(len(names), dtype=np.float32)
    samples = [None if ref is None else ref.sample(t_ns) for ref in references]
    for j, name in enumerate(names):
        for ref, sample in zip(references, samples, strict=False):
            if ref is not None and name in ref.joint_names:
                out[j] = sample[ref.joint_names.index(name)]
                break
        else:
            raise MessageValueError(
                f"joint {name!r} is in no latest trajectory of {', '.join(topics)} at "
                f"t={t_ns / 1e9:.3f} s"
            )
    return out
