"""From sensor topics to one engine :class:`Observation` per tick.

Subscription callbacks only call :meth:`LatestMessage.store`: it keeps the newest message with its
receive time and drops duplicates and messages whose stamp goes backwards (counted). The timer tick
calls :meth:`ObservationAssembler.assemble`, which converts each topic's newest message once (with
:mod:`oxygen_ros.ros.convert`), keeps the last good value per topic, and builds the observation from
inputs that are fresh enough:

* a message that cannot be converted is counted as ``image_<reason>`` / ``joint_<reason>`` (reasons
  from :class:`InputError`) and logged (throttled, naming the topic); the last good value of that
  topic stays usable until it is too old;
* a camera with no fresh usable image is masked out of the model input (counted per topic);
* without fresh joint states or without any fresh camera there is no observation: the tick
  publishes no action and says why (never a stale chunk).

An input's age is the larger of the time since it was received and, for stamped messages, the
time since its header stamp on the node's clock. Stamps are kept as integer nanoseconds so the
observation's stamp is exactly the newest input's header stamp (a float of epoch seconds is only
good to about 0.2 us).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..engine.counters import Counters
from ..engine.types import Observation
from .convert import InputError, compressed_to_rgb, image_to_rgb, joint_state_to_positions
from .params import CameraInput

Warn = Callable[[str, str], None]
"""warn(throttle key, message): a throttled warning."""

JOINT_STATES_TOPIC = "joint_states"
NS_PER_S = 1_000_000_000


def stamp_to_ns(stamp: Any) -> int:
    """A builtin_interfaces/Time as integer nanoseconds."""
    return stamp.sec * NS_PER_S + stamp.nanosec


@dataclasses.dataclass(frozen=True)
class Sample:
    """A stored message: its header stamp (ns, 0 when unstamped), receive time and sequence
    number."""

    msg: Any
    stamp: int
    received: float  # monotonic seconds
    seq: int


class LatestMessage:
    """The newest accepted message of one topic (written by its callback, read by the tick).

    Drops (and counts) exact duplicates and messages stamped earlier than the one held. A stamp
    that jumps back by more than ``reset_after_s`` is taken as the source's clock restarting: it is
    accepted and counted as ``stamp_resets``.
    """

    def __init__(
        self,
        topic: str,
        counters: Counters,
        reset_after_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.topic = topic
        self.reset_after_s = reset_after_s
        self._counters = counters
        self._clock = clock
        self._lock = threading.Lock()
        self._sample: Sample | None = None
        self.received = 0  # accepted messages

    @property
    def sample(self) -> Sample | None:
        return self._sample

    def store(self, msg: Any) -> None:
        """Keep ``msg`` (a message with a std_msgs/Header) unless it is a duplicate or out of
        order."""
        stamp = stamp_to_ns(msg.header.stamp)
        received = self._clock()
        with self._lock:
            previous = self._sample
            if previous is not None and stamp > 0 and previous.stamp > 0:
                if stamp == previous.stamp:
                    self._counters.add("duplicate_messages")
                    return
                if stamp < previous.stamp:
                    if (previous.stamp - stamp) / NS_PER_S <= self.reset_after_s:
                        self._counters.add("stamp_backwards")
                        return
                    self._counters.add("stamp_resets")
            self._sample = Sample(msg, stamp, received, previous.seq + 1 if previous else 1)
            self.received += 1


@dataclasses.dataclass(frozen=True)
class _Good:
    """The last successfully converted value of a topic."""

    value: np.ndarray
    stamp: int  # ns, 0 when unstamped
    received: float
    seq: int


@dataclasses.dataclass
class Assembly:
    """The outcome of one tick's assembly.

    observation: None when no action may be computed; then ``reason`` (a counter key suffix) and
        ``detail`` (a sentence for the log) say why.
    stamp_ns: the observation's stamp, exactly the newest used input's header stamp.
    ages: input age in seconds per topic (None when never received usable data).
    masked: camera topics left out of this observation.
    """

    observation: Observation | None
    stamp_ns: int = 0
    reason: str = ""
    detail: str = ""
    ages: dict[str, float | None] = dataclasses.field(default_factory=dict)
    masked: list[str] = dataclasses.field(default_factory=list)


class ObservationAssembler:
    """Holds the latest messages of the configured topics and assembles observations from them."""

    def __init__(
        self,
        cameras: Sequence[CameraInput],
        joint_names: Sequence[str],
        counters: Counters,
        warn: Warn,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cameras = tuple(cameras)
        self.joint_names = tuple(joint_names)
        self._counters = counters
        self._warn = warn
        self._clock = clock
        self.latest: dict[str, LatestMessage] = {
            cam.topic: LatestMessage(cam.topic, counters, clock=clock) for cam in self.cameras
        }
        self.latest[JOINT_STATES_TOPIC] = LatestMessage(JOINT_STATES_TOPIC, counters, clock=clock)
        self._good: dict[str, _Good] = {}
        self._tried: dict[str, int] = {}  # seq of the newest message converted per topic
        self._stale_counted: dict[str, int] = {}  # seq of the last good sample counted stale
        self.masked_ticks: dict[str, int] = {cam.topic: 0 for cam in self.cameras}

    def set_reset_threshold(self, seconds: float) -> None:
        """Stamp jumps back larger than this are clock restarts, smaller ones out-of-order drops."""
        for latest in self.latest.values():
            latest.reset_after_s = seconds

    def assemble(self, task: str, max_age_s: float, now_ros_ns: int) -> Assembly:
        """Build this tick's observation from fresh, usable inputs (see the module docstring).

        Args:
            task: prompt text.
            max_age_s: inputs older than this are not used.
            now_ros_ns: the node clock now, in nanoseconds (compared with header stamps).
        """
        now = self._clock()
        now_ros = now_ros_ns / NS_PER_S
        assembly = Assembly(observation=None)
        images: dict[str, np.ndarray] = {}
        stamps: list[int] = []
        for cam in self.cameras:
            convert = compressed_to_rgb if cam.compressed else image_to_rgb
            good, age = self._fresh(cam.topic, "image", convert, max_age_s, now, now_ros)
            assembly.ages[cam.topic] = age
            if good is None:
                assembly.masked.append(cam.topic)
                self.masked_ticks[cam.topic] += 1
                self._counters.add("camera_masked")
                continue
            images[cam.slot] = good.value
            stamps.append(self._ros_stamp(good, now, now_ros_ns))
        joints, age = self._fresh(
            JOINT_STATES_TOPIC, "joint", self._positions, max_age_s, now, now_ros
        )
        assembly.ages[JOINT_STATES_TOPIC] = age
        if joints is None:
            never = age is None
            assembly.reason = "no_joint_state" if never else "stale_joint_state"
            assembly.detail = (
                f"no usable {JOINT_STATES_TOPIC} with joints {list(self.joint_names)} received yet"
                if never
                else f"{JOINT_STATES_TOPIC} is {age:.3f} s old "
                f"(max_observation_age_s {max_age_s:g})"
            )
            return assembly
        if not images:
            assembly.reason = "no_camera"
            assembly.detail = (
                "no camera has a fresh usable image: "
                + ", ".join(
                    f"{topic} {'never received' if a is None else f'{a:.3f} s old'}"
                    for topic, a in assembly.ages.items()
                    if topic != JOINT_STATES_TOPIC
                )
                + f" (max_observation_age_s {max_age_s:g})"
            )
            return assembly
        stamps.append(self._ros_stamp(joints, now, now_ros_ns))
        assembly.stamp_ns = max(stamps)
        assembly.observation = Observation(
            images=images, state=joints.value, prompt=task, stamp=assembly.stamp_ns / NS_PER_S
        )
        return assembly

    # -- internals --------------------------------------------------------------------------------
    def _positions(self, msg: Any) -> np.ndarray:
        return joint_state_to_positions(msg, self.joint_names)

    def _fresh(
        self,
        topic: str,
        kind: str,
        convert: Callable[[Any], np.ndarray],
        max_age_s: float,
        now: float,
        now_ros: float,
    ) -> tuple[_Good | None, float | None]:
        """(the topic's last good value if fresh else None, its age or None if it never had one)."""
        sample = self.latest[topic].sample
        if sample is not None and self._tried.get(topic) != sample.seq:
            self._tried[topic] = sample.seq
            try:
                self._good[topic] = _Good(
                    convert(sample.msg), sample.stamp, sample.received, sample.seq
                )
            except InputError as exc:
                self._counters.add(f"{kind}_{exc.reason}")
                self._warn(f"{topic}:{exc.reason}", f"dropping a message on {topic}: {exc}")
        good = self._good.get(topic)
        if good is None:
            return None, None
        age = self._age(good, now, now_ros)
        if age > max_age_s:
            if self._stale_counted.get(topic) != good.seq:
                self._stale_counted[topic] = good.seq
                self._counters.add("stale_inputs")
                self._warn(
                    f"{topic}:stale",
                    f"{topic} is stale: newest usable message is {age:.3f} s old "
                    f"(max_observation_age_s {max_age_s:g})",
                )
            return None, age
        return good, age

    @staticmethod
    def _age(good: _Good, now: float, now_ros: float) -> float:
        received_age = now - good.received
        if good.stamp <= 0:
            return received_age
        return max(received_age, now_ros - good.stamp / NS_PER_S)

    @staticmethod
    def _ros_stamp(good: _Good, now: float, now_ros_ns: int) -> int:
        """The input's header stamp (ns), or its receive time on the node clock when unstamped."""
        return good.stamp if good.stamp > 0 else now_ros_ns - int((now - good.received) * NS_PER_S)
