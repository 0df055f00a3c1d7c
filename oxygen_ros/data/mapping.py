"""The topic -> feature mapping of a bag conversion, read from YAML (``config/sim_dataset.yaml``).

::

    fps: 10                      # frames per second of the dataset
    robot_type: so101_sim
    features:
      observation.images.scene:  # feature key in the dataset
        kind: image              # one of KINDS
        topic: camera/scene/image_raw
        resize: [128, 128]       # optional [height, width]
        max_staleness_s: 0.2     # optional; default per kind (DEFAULT_STALENESS_FRAMES / fps)
      action:
        kind: trajectory_reference
        topics: [arm_controller/joint_trajectory, gripper_controller/joint_trajectory]
        names: [shoulder_pan, ..., gripper]

Kinds (what each produces is said in :mod:`.bag_to_lerobot`): ``image``, ``joint_positions``
(``names`` required), ``trajectory_reference`` (``topics`` and ``names`` required), ``task``
(at most one; gives ``task_index``, not a column), ``string`` (``mode: latest`` or ``event``).
Topics are relative: a bag whose topics carry a namespace (``/r1/joint_states``) matches too.
``required`` (default: true for image, joint_positions and trajectory_reference, false for
strings and the task) says whether the frame grid waits for the feature's first message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

KINDS = ("image", "joint_positions", "trajectory_reference", "task", "string")
STRING_MODES = ("latest", "event")

DEFAULT_STALENESS_FRAMES = {"image": 2.0, "joint_positions": 2.0}
"""Default ``max_staleness_s`` in frame periods; kinds not listed have no limit (a trajectory
reference holds after its last point; a string or task holds until replaced)."""

_REQUIRED_BY_DEFAULT = frozenset({"image", "joint_positions", "trajectory_reference"})
_ALLOWED_KEYS = {
    "image": {"kind", "topic", "resize", "max_staleness_s", "required"},
    "joint_positions": {"kind", "topic", "names", "max_staleness_s", "required"},
    "trajectory_reference": {"kind", "topics", "names", "max_staleness_s", "required"},
    "task": {"kind", "topic", "required"},
    "string": {"kind", "topic", "mode", "max_staleness_s", "required"},
}


class MappingError(ValueError):
    """The mapping is invalid; the message names the feature and field."""


@dataclass(frozen=True)
class FeatureSpec:
    """One dataset feature and where it comes from."""

    key: str
    kind: str
    topics: tuple[str, ...]
    names: tuple[str, ...] = ()
    resize: tuple[int, int] | None = None
    max_staleness_s: float | None = None
    required: bool = True
    mode: str = "latest"

    @property
    def topic(self) -> str:
        """The feature's single topic (every kind but trajectory_reference has one)."""
        return self.topics[0]


@dataclass(frozen=True)
class DatasetMapping:
    """fps, robot type and features of a conversion."""

    fps: int
    robot_type: str | None
    features: tuple[FeatureSpec, ...]

    @property
    def task_feature(self) -> FeatureSpec | None:
        """The feature of kind ``task``, if any."""
        return next((f for f in self.features if f.kind == "task"), None)

    def topics(self) -> list[str]:
        """Every topic the mapping reads, once each, in feature order."""
        return list(dict.fromkeys(t for f in self.features for t in f.topics))


def _positive_number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise MappingError(f"{where} must be a positive number, got {value!r}")
    return float(value)


def _names(raw: Mapping[str, Any], where: str) -> tuple[str, ...]:
    names = raw.get("names")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise MappingError(f"{where}.names must be a non-empty list of joint names")
    if len(set(names)) != len(names):
        raise MappingError(f"{where}.names has duplicates: {names}")
    return tuple(names)


def parse_feature(key: str, raw: Any, fps: int) -> FeatureSpec:
    """One feature of the mapping; MappingError naming ``key`` when it is invalid."""
    where = f"features[{key!r}]"
    if not isinstance(raw, Mapping):
        raise MappingError(f"{where} must be a mapping with a 'kind'")
    kind = raw.get("kind")
    if kind not in KINDS:
        raise MappingError(
            f"{where}.kind: unknown feature kind {kind!r}; known: {', '.join(KINDS)}"
        )
    unknown = set(raw) - _ALLOWED_KEYS[kind]
    if unknown:
        raise MappingError(f"{where}: unknown field(s) {sorted(unknown)} for kind {kind}")
    if kind == "trajectory_reference":
        topics = raw.get("topics")
        if (
            not isinstance(topics, list)
            or not topics
            or not all(isinstance(t, str) for t in topics)
        ):
            raise MappingError(f"{where}.topics must be a non-empty list of topic names")
    else:
        if not isinstance(raw.get("topic"), str) or not raw["topic"]:
            raise MappingError(f"{where}.topic must be a topic name")
        topics = [raw["topic"]]
    names = _names(raw, where) if kind in ("joint_positions", "trajectory_reference") else ()
    resize = None
    if raw.get("resize") is not None:
        size = raw["resize"]
        if not (
            isinstance(size, list) and len(size) == 2 and all(isinstance(s, int) for s in size)
        ):
            raise MappingError(f"{where}.resize must be [height, width] in pixels")
        if min(size) <= 0:
            raise MappingError(f"{where}.resize must be positive, got {size}")
        resize = (size[0], size[1])
    if "max_staleness_s" in raw:
        staleness = raw["max_staleness_s"]
        staleness = (
            None if staleness is None else _positive_number(staleness, f"{where}.max_staleness_s")
        )
    else:
        frames = DEFAULT_STALENESS_FRAMES.get(kind)
        staleness = None if frames is None else frames / fps
    mode = raw.get("mode", "latest")
    if mode not in STRING_MODES:
        raise MappingError(f"{where}.mode must be one of {STRING_MODES}, got {mode!r}")
    required = raw.get("required", kind in _REQUIRED_BY_DEFAULT)
    if not isinstance(required, bool):
        raise MappingError(f"{where}.required must be true or false")
    return FeatureSpec(
        key=key,
        kind=kind,
        topics=tuple(topics),
        names=names,
        resize=resize,
        max_staleness_s=staleness,
        required=required,
        mode=mode,
    )


def parse_mapping(raw: Any, source: str = "mapping") -> DatasetMapping:
    """A :class:`DatasetMapping` from parsed YAML; MappingError naming ``source`` and field."""
    if not isinstance(raw, Mapping):
        raise MappingError(f"{source}: expected a mapping with fps and features")
    fps = raw.get("fps")
    if isinstance(fps, bool) or not isinstance(fps, int) or fps <= 0:
        raise MappingError(f"{source}: fps must be a positive integer (LeRobot's fps is an int)")
    features = raw.get("features")
    if not isinstance(features, Mapping) or not features:
        raise MappingError(f"{source}: features must be a non-empty mapping")
    specs = tuple(parse_feature(str(key), value, fps) for key, value in features.items())
    if sum(f.kind == "task" for f in specs) > 1:
        raise MappingError(f"{source}: at most one feature of kind task")
    if not any(f.required for f in specs):
        raise MappingError(f"{source}: at least one feature must be required (sets the frames)")
    robot_type = raw.get("robot_type")
    if robot_type is not None and not isinstance(robot_type, str):
        raise MappingError(f"{source}: robot_type must be a string")
    unknown = set(raw) - {"fps", "robot_type", "features"}
    if unknown:
        raise MappingError(f"{source}: unknown field(s) {sorted(unknown)}")
    return DatasetMapping(fps=fps, robot_type=robot_type, features=specs)


def load_mapping(path: Path | str) -> DatasetMapping:
    """Read and check a mapping YAML file."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise MappingError(f"{path}: not valid YAML: {error}") from error
    return parse_mapping(raw, str(path))
