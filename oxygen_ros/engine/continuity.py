"""Continuous chunks across frames: the previous chunk becomes the next frame's RTC guidance.

The controller executes action ``i`` of a chunk at ``stamp + (i + 1) * action_dt`` (the
trajectory's header stamp is its observation's stamp). A new chunk from an observation stamped
``offset * action_dt`` after the previous one therefore overlaps the previous chunk shifted by
``offset`` steps (fractional offsets interpolate linearly); the part the controller will run before
the new chunk arrives — the inference delay, ``ceil(latency / action_dt)`` steps from the measured
action-path latency (an EMA over recent frames) — is frozen, the rest of the overlap is softly
guided (``model.rtc``), and steps beyond the previous chunk's end are free.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from ..model.policy import Pi05Policy
from ..model.rtc import RTCGuidance, prefix_weights
from .types import ActionChunk, Observation

LATENCY_SMOOTHING = 0.2  # EMA weight of the newest frame's action-path latency


def resample_previous(previous: np.ndarray, offset: float, horizon: int) -> tuple[np.ndarray, int]:
    """The previous chunk [H_prev, J] on the new chunk's time grid: row ``j`` is the previous chunk
    at step ``offset + j``, linearly interpolated. Returns ([horizon, J], covered) where the first
    ``covered`` rows lie within the previous chunk; later rows repeat its last action (they get
    guidance weight 0). A negative offset (stamps going backwards) covers nothing."""
    length = previous.shape[0]
    out = np.repeat(previous[-1:], horizon, axis=0).astype(np.float64)
    if not math.isfinite(offset) or offset < 0 or offset > length - 1:
        return out, 0
    covered = min(horizon, int(math.floor(length - 1 - offset + 1e-9)) + 1)
    steps = offset + np.arange(covered)
    low = np.minimum(np.floor(steps + 1e-9).astype(np.int64), length - 1)
    high = np.minimum(low + 1, length - 1)
    frac = np.clip(steps - low, 0.0, 1.0)[:, None]
    out[:covered] = previous[low] * (1.0 - frac) + previous[high] * frac
    return out, covered


@dataclasses.dataclass
class PreviousChunk:
    """The chunk the controller is executing: robot units, and the observation it came from."""

    actions: np.ndarray  # [horizon, robot action_dim], as `Pi05Policy.robot_actions` returned it
    stamp: float
    state: np.ndarray


class ChunkContinuity:
    """Remembers the newest chunk and the action-path latency; builds the next frame's guidance.

    Args:
        policy: maps robot units back to model space (`Pi05Policy.model_actions`).
        action_dt: seconds between consecutive actions of a chunk (the controller's step).
        execution_horizon: at most this many steps of the new chunk are guided; 0: the whole
            overlap with the previous chunk.
        max_guidance_weight: beta, the clip of the guidance weight.
        schedule: soft-mask decay over the overlap after the frozen steps, ``exp`` or ``linear``.
    """

    def __init__(
        self,
        policy: Pi05Policy,
        action_dt: float,
        execution_horizon: int = 0,
        max_guidance_weight: float = 5.0,
        schedule: str = "exp",
    ) -> None:
        if not (math.isfinite(action_dt) and action_dt > 0):
            raise ValueError(f"action_dt must be a positive number of seconds, got {action_dt}")
        prefix_weights(0, 0, 0, schedule)  # raises for an unknown schedule
        self.policy = policy
        self.action_dt = action_dt
        self.execution_horizon = execution_horizon
        self.max_guidance_weight = max_guidance_weight
        self.schedule = schedule
        self.previous: PreviousChunk | None = None
        self.latency_s: float | None = None  # EMA of prefill + action time
        self.non_finite_chunks = 0  # chunks not kept as guidance because they hold NaN/Inf

    def frozen_steps(self) -> int:
        """Inference delay in controller steps: the new chunk's steps due before it arrives."""
        if self.latency_s is None:
            return 0
        return max(0, math.ceil(self.latency_s / self.action_dt - 1e-9))

    def guidance(self, observation: Observation) -> RTCGuidance | None:
        """The guidance for a chunk from ``observation``; None when the previous chunk does not
        overlap it (first frame, a gap longer than the chunk, stamps going backwards)."""
        if self.previous is None or self.max_guidance_weight <= 0:
            return None
        horizon = self.policy.config.action_horizon
        offset = (observation.stamp - self.previous.stamp) / self.action_dt
        target, covered = resample_previous(self.previous.actions, offset, horizon)
        end = min(covered, self.execution_horizon) if self.execution_horizon > 0 else covered
        if end == 0:
            return None
        steps = prefix_weights(horizon, self.frozen_steps(), end, self.schedule)
        dims = torch.zeros(self.policy.config.action_dim, dtype=torch.float32)
        dims[: self.policy.action_dim] = 1.0  # the model's padding dims are free
        device = self.policy.device
        model_target = torch.from_numpy(self.policy.model_actions(target, observation.state))[
            None
        ].to(device)
        return RTCGuidance(
            model_target, (steps[:, None] * dims[None]).to(device), self.max_guidance_weight
        )

    def record(self, observation: Observation, chunk: ActionChunk) -> None:
        """Keep ``chunk`` as the one the controller now executes and update the latency EMA.

        A chunk with NaN/Inf (which the node does not publish) is not kept: the next chunk starts
        free, and ``non_finite_chunks`` counts it.
        """
        latency = (chunk.prefill_ms + chunk.action_ms) * 1e-3
        self.latency_s = (
            latency
            if self.latency_s is None
            else self.latency_s + LATENCY_SMOOTHING * (latency - self.latency_s)
        )
        if not np.isfinite(chunk.actions).all():
            self.non_finite_chunks += 1
            self.previous = None
            return
        self.previous = PreviousChunk(
            np.array(chunk.actions, copy=True), chunk.stamp, np.array(observation.state, copy=True)
        )

    def reset(self) -> None:
        """Forget the previous chunk (the next one starts free); the latency estimate stays."""
        self.previous = None
