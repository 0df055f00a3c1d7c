"""What the node publishes, and how each message is built: action chunks, trajectories, text
deltas, finished texts and the optional rviz narration marker.

All output publishers are lifecycle publishers, created by ``configure`` and enabled by
``activate``: nothing leaves an inactive node.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from builtin_interfaces.msg import Time
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.serialization import serialize_message
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory
from visualization_msgs.msg import Marker

from oxygen_ros.msg import ActionChunk as ActionChunkMsg
from oxygen_ros.msg import Narration

from ..engine.types import ActionChunk, TextDelta
from .commands import Command, build_command
from .messages import action_chunk_msg, narration_msg
from .params import NodeSettings
from .safety import SafetyFilter
from .trajectory_rules import TrajectoryRejected, check_trajectory

# record topics (chunks, full texts, markers, diagnostics) and text inputs (~/ask, ~/instruction)
RECORD_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
# ~/subtask: the current subtask is state, not an event: a late subscriber gets the newest one.
LATCHED_QOS = QoSProfile(
    depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL
)
TEXT_QOS = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)  # never drop a text delta
# Commands to a controller (~/joint_trajectory): ros2_control's JointTrajectoryController subscribes
# with the system-default QoS (reliable, volatile in every RMW); a reliable, volatile publisher
# matches it, and a keep-last depth of 1 means only the newest trajectory is ever waiting to be
# delivered: a stale one is replaced, never queued behind a fresh one.
TRAJECTORY_QOS = QoSProfile(
    history=HistoryPolicy.KEEP_LAST,
    depth=1,
    reliability=ReliabilityPolicy.RELIABLE,
    durability=DurabilityPolicy.VOLATILE,
)
MARKER_TEXT_HEIGHT_M = 0.08  # the height of an upper-case letter in rviz
MARKER_NAMESPACE = "narration"  # one marker (id 0): each finished text replaces the previous one


def narration_marker(text: str, settings: NodeSettings, stamp: Time) -> Marker:
    """A TEXT_VIEW_FACING marker showing ``text`` at the configured frame and position."""
    marker = Marker()
    marker.header.stamp = stamp
    marker.header.frame_id = settings.narration_marker_frame
    marker.ns = MARKER_NAMESPACE
    marker.id = 0
    marker.type = Marker.TEXT_VIEW_FACING
    marker.action = Marker.ADD
    x, y, z = settings.narration_marker_position
    marker.pose.position.x, marker.pose.position.y, marker.pose.position.z = x, y, z
    marker.pose.orientation.w = 1.0
    marker.scale.z = MARKER_TEXT_HEIGHT_M
    marker.color.r = marker.color.g = marker.color.b = marker.color.a = 1.0
    marker.text = text
    return marker


class Outputs:
    """The output publishers of a configured node (``node`` is the LifecycleNode)."""

    def __init__(self, node: Any, settings: NodeSettings) -> None:
        self._node = node
        self.trajectory = node.create_lifecycle_publisher(
            JointTrajectory, "~/joint_trajectory", TRAJECTORY_QOS
        )
        self.gripper_trajectory = (
            node.create_lifecycle_publisher(JointTrajectory, "~/gripper_trajectory", TRAJECTORY_QOS)
            if settings.gripper_trajectory_dims
            else None
        )
        self.chunk = node.create_lifecycle_publisher(ActionChunkMsg, "~/action_chunk", RECORD_QOS)
        self.narration = node.create_lifecycle_publisher(Narration, "~/narration", TEXT_QOS)
        self.text = node.create_lifecycle_publisher(String, "~/narration_text", RECORD_QOS)
        self.subtask = node.create_lifecycle_publisher(String, "~/subtask", LATCHED_QOS)
        self.marker = (
            node.create_lifecycle_publisher(Marker, "~/narration_marker", RECORD_QOS)
            if settings.narration_marker
            else None
        )
        self._all: list[Any] = [
            p
            for p in (
                self.trajectory,
                self.gripper_trajectory,
                self.chunk,
                self.narration,
                self.text,
                self.subtask,
                self.marker,
            )
            if p is not None
        ]

    def publish_command(
        self,
        settings: NodeSettings,
        chunk: ActionChunk,
        stamp: Time,
        command: Command,
        frame_ms: float,
        deadline_met: bool,
        observation_age: float,
        now_s: float,
    ) -> list[tuple[str, TrajectoryRejected]]:
        """The trajectories a stock controller accepts at ``now_s`` (the node's clock), and the
        chunk's record on ~/action_chunk. Returns the trajectories not sent, with why: one that a
        controller would drop whole (e.g. an observation so old that the chunk has already ended)
        would only make it log an error."""
        publishers = {"arm": self.trajectory, "gripper": self.gripper_trajectory}
        not_sent = []
        for name, trajectory in command.trajectories:
            try:
                check_trajectory(trajectory, trajectory.joint_names, now_s)
            except TrajectoryRejected as rejected:
                not_sent.append((name, rejected))
                continue
            publishers[name].publish(trajectory)
        self.chunk.publish(
            chunk_record(settings, chunk, stamp, command, frame_ms, deadline_met, observation_age)
        )
        return not_sent

    def publish_delta(self, delta: TextDelta, stamp: Time) -> None:
        self.narration.publish(narration_msg(delta, stamp))

    def publish_subtask(self, text: str) -> None:
        """The new current subtask on ~/subtask (transient-local: late subscribers get it)."""
        self.subtask.publish(String(data=text))

    def publish_finished(self, full_text: str, settings: NodeSettings, stamp: Time) -> None:
        """A finished request's "[kind] text" on ~/narration_text (and the marker, if enabled)."""
        self.text.publish(String(data=full_text))
        if self.marker is not None:
            self.marker.publish(narration_marker(full_text, settings, stamp))

    def destroy(self) -> None:
        for publisher in self._all:
            self._node.destroy_lifecycle_publisher(publisher)
        self._all = []


def chunk_record(
    settings: NodeSettings,
    chunk: ActionChunk,
    stamp: Time,
    command: Command,
    frame_ms: float,
    deadline_met: bool,
    observation_age: float,
) -> ActionChunkMsg:
    """The ~/action_chunk message of ``command``, the limited command of ``chunk``."""
    return action_chunk_msg(
        stamp=stamp,
        frame_id=chunk.frame_id,
        joint_names=settings.action_joint_names,
        actions=command.actions,
        dt=settings.action_dt,
        observation_age=observation_age,
        prefill_ms=chunk.prefill_ms,
        action_ms=chunk.action_ms,
        frame_ms=frame_ms,
        deadline_met=deadline_met,
        clipped_values=command.clipped,
        action_space=command.action_space,
        subtask_id=chunk.subtask_id,
        subtask=chunk.subtask,
    )


def publish_cost(
    settings: NodeSettings, horizon: int, safety: SafetyFilter, repeats: int = 20
) -> tuple[float, float]:
    """(seconds to build and serialise a tick's chunk and trajectory, seconds for one text delta),
    medians over ``repeats``: what publishing adds to the engine's part of a tick."""
    actions = np.zeros((horizon, len(settings.action_joint_names)), dtype=np.float32)
    state = np.zeros(len(settings.joint_names), dtype=np.float64)
    chunk = ActionChunk(0, 0.0, actions, 0.0, 0.0)
    delta = TextDelta(0, "narration", "word")
    chunk_s, delta_s = [], []
    for _ in range(repeats):
        started = time.monotonic()
        command = build_command(settings, actions, state, Time(), safety)
        for _, trajectory in command.trajectories:
            serialize_message(trajectory)
        serialize_message(chunk_record(settings, chunk, Time(), command, 0.0, True, 0.0))
        middle = time.monotonic()
        serialize_message(narration_msg(delta, Time()))
        chunk_s.append(middle - started)
        delta_s.append(time.monotonic() - middle)
    return float(np.median(chunk_s)), float(np.median(delta_s))
