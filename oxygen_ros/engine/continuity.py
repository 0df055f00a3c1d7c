"""Continuous chunks across frames: the chunk the controller executes becomes the next frame's RTC
guidance (guided: `RTCGuidance`) or frozen prefix (training-time RTC: `TrainedPrefix`).

The controller executes action ``i`` of a chunk at ``stamp + (i + 1) * action_dt`` (the
trajectory's header stamp is its observation's stamp). A new chunk from an observation stamped
``offset * action_dt`` after the previous one therefore overlaps the previous chunk shifted by
``offset`` steps (fractional offsets interpolate linearly; a chunk published at another
``action_dt`` is resampled at its own). The new chunk's steps the controller runs before the new
chunk takes over — the delay ``d``, ``ceil(delay / action_dt)`` — are frozen, the rest of the
overlap is softly guided (``model.rtc``), and steps beyond the previous chunk's end are free.

The delay is what the robot sees: from the observation's stamp to the chunk published (its age at
the tick, prefill, action, limits and publishing), over the node's reports
(`ChunkContinuity.published`): an EMA plus twice the EMA of its deviation, as TCP bounds a round
trip (RFC 6298), because a chunk that arrives later than its frozen steps reach lands its switch on
a step that was only softly guided, while one frozen step too many only follows the executed chunk
a step longer. A steady delay has no deviation: then it is the EMA itself. Without reports (the
benches, a script) it is the engine's own prefill + action time, and every computed chunk counts
as executed; with them, the guidance follows the chunk actually published, after the safety
limits, converted back to model space.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from ..model.rtc import GUIDANCE, RTCGuidance, TrainedPrefix, prefix_weights
from ..policy_io.policy import Pi05Policy
from .settings import EngineConfig
from .types import ActionChunk, Observation

LATENCY_SMOOTHING = 0.2  # EMA weight of the newest frame's delay
DEVIATION_SMOOTHING = 0.25  # EMA weight of the newest frame's deviation from the delay's EMA
DELAY_BOUND_DEVIATIONS = 2.0  # the frozen delay: its EMA + this many deviations


def resample_previous(
    previous: np.ndarray, offset: float, horizon: int, step: float = 1.0
) -> tuple[np.ndarray, int]:
    """The previous chunk [H_prev, J] on the new chunk's time grid.

    Row ``j`` is the previous chunk at step ``offset + (j + 1) * step - 1``, linearly interpolated:
    ``offset`` is the new observation's stamp after the previous one in the previous chunk's steps,
    ``step`` the new chunk's action period in them (1: the same ``action_dt``; a position before
    the previous chunk's first action holds it). Returns ([horizon, J], covered) where the first
    ``covered`` rows lie within the previous chunk; later rows repeat its last action (they get
    guidance weight 0). A negative offset (stamps going backwards) covers nothing.

    Raises:
        ValueError: ``step`` not a positive number.
    """
    if not (math.isfinite(step) and step > 0):
        raise ValueError(f"step must be a positive number, got {step}")
    length = previous.shape[0]
    out = np.repeat(previous[-1:], horizon, axis=0).astype(np.float64)
    if not math.isfinite(offset) or offset < 0 or offset > length - 1:
        return out, 0
    covered = min(horizon, int(math.floor((length - offset) / step + 1e-9)))
    steps = np.maximum(offset + (np.arange(covered) + 1) * step - 1.0, 0.0)
    low = np.minimum(np.floor(steps + 1e-9).astype(np.int64), length - 1)
    high = np.minimum(low + 1, length - 1)
    frac = np.clip(steps - low, 0.0, 1.0)[:, None]
    out[:covered] = previous[low] * (1.0 - frac) + previous[high] * frac
    return out, covered


def smoothed(average: float | None, sample: float) -> float:
    """The EMA of delays after ``sample`` (the first sample starts it)."""
    return sample if average is None else average + LATENCY_SMOOTHING * (sample - average)


@dataclasses.dataclass
class PreviousChunk:
    """A chunk the controller executes: robot units, the observation it came from, and the
    ``action_dt`` it was published at."""

    actions: np.ndarray  # [steps, robot action_dim], as `Pi05Policy.robot_actions` returns them
    stamp: float
    state: np.ndarray
    action_dt: float
    frame_id: int = 0


class ChunkContinuity:
    """Remembers the executed chunk and the delay; builds the next frame's guidance.

    Args:
        policy: maps robot units back to model space (`Pi05Policy.model_actions`).
        action_dt: seconds between consecutive actions of a chunk (the controller's step); the
            node updates it at run time (`set_action_dt`).
        execution_horizon: at most this many steps of the new chunk are guided; 0: the whole
            overlap with the previous chunk.
        max_guidance_weight: beta, the clip of the guidance weight.
        schedule: soft-mask decay over the overlap after the frozen steps, ``exp`` or ``linear``.
        guidance: ``identity`` or ``vjp`` (`RTCGuidance.jacobian`).
        training_max_delay: the checkpoint's ``rtc_training_max_delay``; > 0 runs training-time
            RTC (a frozen prefix of ``d`` steps, no guidance), falling back to guided RTC for a
            chunk whose delay exceeds it (counted in ``trained_fallbacks``).

    Raises:
        ValueError: an unknown schedule or guidance, a non-positive action_dt, a negative
            training_max_delay or one not below the model's horizon.
    """

    def __init__(
        self,
        policy: Pi05Policy,
        action_dt: float,
        execution_horizon: int = 0,
        max_guidance_weight: float = 5.0,
        schedule: str = "exp",
        guidance: str = "identity",
        training_max_delay: int = 0,
    ) -> None:
        prefix_weights(0, 0, 0, schedule)  # raises for an unknown schedule
        if guidance not in GUIDANCE:
            raise ValueError(f"RTC guidance must be one of {', '.join(GUIDANCE)}, got {guidance!r}")
        horizon = policy.config.action_horizon
        if not 0 <= training_max_delay < horizon:
            raise ValueError(
                f"rtc_training_max_delay must be >= 0 and below the model's horizon {horizon}, "
                f"got {training_max_delay}"
            )
        self.policy = policy
        self.action_dt = 0.0
        self.set_action_dt(action_dt)
        self.execution_horizon = execution_horizon
        self.max_guidance_weight = max_guidance_weight
        self.schedule = schedule
        self.guidance_kind = guidance
        self.training_max_delay = training_max_delay
        self.latency_s: float | None = None  # EMA of the engine's prefill + action time
        self.delay_s: float | None = None  # EMA of the robot-seen delay the node reports
        self.delay_deviation_s = 0.0  # EMA of |report - delay_s|
        self.non_finite_chunks = 0  # chunks not kept as guidance because they hold NaN/Inf
        self.trained_fallbacks = 0  # chunks whose delay exceeded training_max_delay: guided
        self._latest: PreviousChunk | None = None  # the newest chunk computed
        self._published: PreviousChunk | None = None  # the newest chunk the node published
        self._reports = False  # the node reports what it publishes

    @property
    def mode(self) -> str:
        """``trained`` (the checkpoint declares rtc_training_max_delay) or the guidance kind."""
        return "trained" if self.training_max_delay > 0 else self.guidance_kind

    @property
    def previous(self) -> PreviousChunk | None:
        """The chunk the controller executes: the newest published one once the node reports,
        else the newest computed one."""
        return self._published if self._reports else self._latest

    def set_action_dt(self, action_dt: float) -> None:
        """The controller's step from now on (a chunk already published keeps its own)."""
        if not (math.isfinite(action_dt) and action_dt > 0):
            raise ValueError(f"action_dt must be a positive number of seconds, got {action_dt}")
        self.action_dt = float(action_dt)

    def frozen_steps(self) -> int:
        """The delay ``d`` in controller steps: the new chunk's steps due before it takes over
        (the reported delay's EMA + `DELAY_BOUND_DEVIATIONS` deviations; without reports the
        engine's own time)."""
        if self.delay_s is not None:
            delay = self.delay_s + DELAY_BOUND_DEVIATIONS * self.delay_deviation_s
        else:
            delay = self.latency_s
        if delay is None:
            return 0
        return max(0, math.ceil(delay / self.action_dt - 1e-9))

    def guidance(self, observation: Observation) -> RTCGuidance | TrainedPrefix | None:
        """How a chunk from ``observation`` continues the executed one; None when that chunk does
        not overlap it (first frame, a gap longer than the chunk, stamps going backwards), or
        when nothing would be constrained."""
        previous = self.previous
        if previous is None:
            return None
        horizon = self.policy.config.action_horizon
        offset = (observation.stamp - previous.stamp) / previous.action_dt
        target, covered = resample_previous(
            previous.actions, offset, horizon, self.action_dt / previous.action_dt
        )
        if covered == 0:
            return None
        frozen = min(self.frozen_steps(), covered)
        if self.training_max_delay > 0:
            if frozen == 0:
                return None  # nothing due before the chunk arrives: the plain chunk (as LeRobot)
            if frozen <= self.training_max_delay:
                mask = torch.arange(horizon) < frozen
                device = self.policy.device
                return TrainedPrefix(self._model_target(target, observation), mask.to(device))
            self.trained_fallbacks += 1  # beyond what the checkpoint was trained for: guided
        if self.max_guidance_weight <= 0:
            return None
        end = min(covered, self.execution_horizon) if self.execution_horizon > 0 else covered
        steps = prefix_weights(horizon, frozen, end, self.schedule)
        dims = torch.zeros(self.policy.config.action_dim, dtype=torch.float32)
        dims[: self.policy.action_dim] = 1.0  # the model's padding dims are free
        weights = (steps[:, None] * dims[None]).to(self.policy.device)
        return RTCGuidance(
            self._model_target(target, observation),
            weights,
            self.max_guidance_weight,
            self.guidance_kind,
        )

    def _model_target(self, target: np.ndarray, observation: Observation) -> torch.Tensor:
        """Robot-unit target rows -> [1, horizon, model action_dim] on the model's device."""
        model = self.policy.model_actions(target, observation.state)
        return torch.from_numpy(model)[None].to(self.policy.device)

    def record(self, observation: Observation, chunk: ActionChunk) -> None:
        """Keep ``chunk`` as the newest computed chunk and update the engine-time EMA.

        A chunk with NaN/Inf (which the node does not publish) is not kept: counted in
        ``non_finite_chunks``; without node reports the next chunk then starts free.
        """
        self.latency_s = smoothed(self.latency_s, (chunk.prefill_ms + chunk.action_ms) * 1e-3)
        if not np.isfinite(chunk.actions).all():
            self.non_finite_chunks += 1
            self._latest = None
            return
        self._latest = PreviousChunk(
            np.array(chunk.actions, copy=True),
            chunk.stamp,
            np.array(observation.state, copy=True),
            self.action_dt,
            chunk.frame_id,
        )

    def published(self, frame_id: int, actions: np.ndarray | None, delay_s: float) -> None:
        """The node's report on frame ``frame_id``'s chunk (the newest recorded).

        actions: what was published, robot units [steps, robot action_dim] after the safety limits
            (the first ``steps`` of the chunk); None when it was not published (the controller
            keeps executing the previous published chunk).
        delay_s: from the observation's stamp to the chunk published, on the stamps' clock.

        Raises:
            ValueError: ``frame_id`` is not the newest recorded chunk, or actions of the wrong
                shape.
        """
        latest = self._latest
        self._reports = True
        if math.isfinite(delay_s) and delay_s >= 0:
            if self.delay_s is not None:
                deviation = abs(delay_s - self.delay_s)
                self.delay_deviation_s += DEVIATION_SMOOTHING * (deviation - self.delay_deviation_s)
            self.delay_s = smoothed(self.delay_s, delay_s)
        if actions is None:
            return
        if latest is None or latest.frame_id != frame_id:
            raise ValueError(
                f"published frame {frame_id} is not the newest recorded chunk "
                f"({None if latest is None else latest.frame_id})"
            )
        actions = np.asarray(actions, dtype=np.float64)
        if actions.ndim != 2 or actions.shape[1] != latest.actions.shape[1] or not len(actions):
            raise ValueError(
                f"published actions must be [steps, {latest.actions.shape[1]}], got {actions.shape}"
            )
        if np.isfinite(actions).all():
            self._published = dataclasses.replace(latest, actions=actions.copy())

    def reset(self) -> None:
        """Forget the executed chunk (the next one starts free); the delay estimates stay."""
        self._latest = self._published = None


def build_continuity(policy: Pi05Policy, config: EngineConfig) -> ChunkContinuity | None:
    """The continuity ``config`` asks for (None: ``chunk_continuity`` none); training-time RTC
    only where `EngineConfig.continuity_mode` says trained."""
    if config.chunk_continuity != "rtc":
        return None
    trained = config.continuity_mode == "trained"
    return ChunkContinuity(
        policy,
        config.action_dt,
        config.rtc_execution_horizon,
        config.rtc_max_guidance_weight,
        config.rtc_schedule,
        config.rtc_guidance,
        config.rtc_training_max_delay if trained else 0,
    )
