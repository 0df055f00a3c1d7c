"""Data that crosses the engine boundary: what goes in per frame, what comes out.

Plain dataclasses with numpy payloads, so the ROS layer, the benchmarks and the tests all speak the
same language and none of them needs torch to read a result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from ..policy_io.prompts import LANGUAGE_KINDS  # noqa: F401  (re-exported: the engine's kinds)

Clock = Callable[[], float]
"""Seconds on a monotonic clock; engines time frames and steps with one (``time.perf_counter``)."""


@dataclasses.dataclass(frozen=True)
class Observation:
    """One synchronised snapshot of the robot.

    images: image-slot name (``base_0_rgb``, ``left_wrist_0_rgb``, ``right_wrist_0_rgb``) -> RGB
        uint8 [H, W, 3] of any size; a slot that is absent is masked out of the model input.
    state: joint state in robot units, length = the robot's state dimension.
    prompt: the task text.
    stamp: observation time in seconds (the newest input's stamp).
    """

    images: dict[str, np.ndarray]
    state: np.ndarray
    prompt: str
    stamp: float = 0.0


@dataclasses.dataclass
class ActionChunk:
    """An unnormalised action chunk for one frame: ``actions`` [horizon, action_dim]."""

    frame_id: int
    stamp: float
    actions: np.ndarray
    prefill_ms: float
    action_ms: float
    subtask_id: int = 0  # the subtask that conditioned the chunk (0: none)
    subtask: str = ""  # its text
    subtask_age_s: float = 0.0  # from the start of the frame it was decoded from to this frame's


@dataclasses.dataclass
class TextDelta:
    """New text of one language request. ``final`` is set exactly once, on its last delta."""

    request_id: int
    kind: str
    text: str
    final: bool = False
    token_count: int = 0
    # eos | stop | length | refused | stalled | cancelled | failed when final
    finish_reason: str = ""
    detail: str = ""  # why, for refused, stalled and failed ("<ExceptionType>: <message>") requests
    frame_id: int = 0  # the frame whose prefix the request reads (0 while still queued)


@dataclasses.dataclass
class FrameStats:
    frame_id: int
    frame_ms: float = 0.0
    prefill_ms: float = 0.0
    action_ms: float = 0.0
    decode_ms: float = 0.0
    decode_steps: int = 0
    tokens: int = 0  # language tokens generated during this frame
    active_requests: int = 0  # after this frame's decoding
    kv_bytes_in_use: int = 0
    deadline_met: bool = True


@dataclasses.dataclass
class FrameResult:
    action: ActionChunk | None
    deltas: list[TextDelta]
    stats: FrameStats


@dataclasses.dataclass(frozen=True)
class WarmUpReport:
    """What `EngineBase.warm_up` prepared and measured.

    buckets_created: static-shape buckets (CUDA graphs) created; 0 on the eager paths.
    action_ms: prefill + action chunk, median over the warm-up frames after the first.
    language_step_ms: estimated decode step at batch 1; 0.0 for engines without a step timer.
    frames: warm-up frames run (their requests, KV and counters are gone afterwards).
    """

    buckets_created: int
    action_ms: float
    language_step_ms: float
    frames: int
