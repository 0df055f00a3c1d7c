"""Build the node's custom output messages (``oxygen_ros/ActionChunk``, ``oxygen_ros/Narration``).

Standard messages (images, joint states, trajectories) are converted in :mod:`.convert`; this module
fills the package's own messages from engine results. Float arrays go in through ``array.array``
(assigning numpy arrays to sequence fields is checked element by element and costs milliseconds).
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import numpy as np
from builtin_interfaces.msg import Time

from oxygen_ros.msg import ActionChunk as ActionChunkMsg
from oxygen_ros.msg import Narration

from ..engine.types import TextDelta


def action_chunk_msg(
    *,
    stamp: Time,
    frame_id: int,
    joint_names: Sequence[str],
    actions: np.ndarray,
    dt: float,
    observation_age: float,
    prefill_ms: float,
    action_ms: float,
    frame_ms: float,
    deadline_met: bool,
    clipped_values: int,
    action_space: str = "position",
    subtask_id: int = 0,
    subtask: str = "",
) -> ActionChunkMsg:
    """An ``ActionChunk`` for ``actions`` [horizon, joints] computed from the observation at
    ``stamp``; ``action_space`` says what the values mean (see msg/ActionChunk.msg)."""
    chunk = np.ascontiguousarray(actions, dtype=np.float32)
    horizon, action_dim = chunk.shape
    msg = ActionChunkMsg()
    msg.header.stamp = stamp
    msg.frame_id = int(frame_id)
    msg.joint_names = list(joint_names)
    msg.horizon = horizon
    msg.action_dim = action_dim
    msg.dt = float(dt)
    msg.actions = array.array("f", chunk.tobytes())
    msg.observation_age = float(observation_age)
    msg.prefill_ms = float(prefill_ms)
    msg.action_ms = float(action_ms)
    msg.frame_ms = float(frame_ms)
    msg.deadline_met = bool(deadline_met)
    msg.clipped_values = int(clipped_values)
    msg.action_space = str(action_space)
    msg.subtask_id = int(subtask_id)
    msg.subtask = str(subtask)
    return msg


def narration_msg(delta: TextDelta, stamp: Time) -> Narration:
    """A ``Narration`` carrying one text delta of a request born from the observation at
    ``stamp``."""
    msg = Narration()
    msg.header.stamp = stamp
    msg.request_id = int(delta.request_id)
    msg.kind = delta.kind
    msg.delta = delta.text
    msg.final = bool(delta.final)
    msg.token_count = int(delta.token_count)
    msg.finish_reason = delta.finish_reason
    return msg
