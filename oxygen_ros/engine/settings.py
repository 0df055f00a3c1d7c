"""The engine's settings (`EngineConfig`): decode mode and budget, request limits, KV memory,
prompt format and kind texts, pi0.5's subtask loop, the GPU fast path and chunk continuity.

Every value is checked when the settings are made; the node's parameters map onto them
(`ros.engine_setup`), and `base.EngineBase` builds a pool, a runner and requests from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ..model.rtc import CONTINUITY_MODES, GUIDANCE, RTC_MODES, SCHEDULES
from ..policy_io.prompts import KindFormat, PromptFormat, check_conditioning, preset
from .subtasks import HeldGate, PhaseOrder


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    num_steps: int = 10  # flow-matching denoising steps per action chunk
    # "deadline": measured step latency decides; "fixed": k steps per frame
    decode_mode: str = "deadline"
    decode_steps_per_frame: int = 5  # k, used in fixed mode
    max_active_requests: int = 16
    max_queued_requests: int = 64
    max_wait_frames: int = 300  # a queued request waiting longer than this is refused
    max_stall_frames: int = 100  # an active request that gets no decode step for this many frames
    # in a row (every tick overran its deadline) is finished as "stalled", freeing its KV
    kv_capacity_tokens: int = 0  # 0 = room for max_active_requests frames of prefix plus their text
    kv_block_size: int = 16
    # slack left unused before the deadline (the node: decode_margin_ms)
    deadline_margin_ms: float = 3.0
    seed: int = 0
    default_max_tokens: int = 30
    # The checkpoint's prompt format (policy_io/prompts.py): a preset name or a PromptFormat.
    prompt_format: str | PromptFormat = "openpi"
    # Kind texts overriding the format's ("{text}" is the request's text); None: the format's.
    kind_prompts: Mapping[str, str] | None = None
    # pi0.5's hierarchy (engine/subtasks.py): "none" | "prompt" | "same_frame"
    subtask_conditioning: str = "none"
    subtask_period_s: float = 1.0  # a new subtask is decoded this often (and when the task changes)
    subtask_max_tokens: int = 0  # 0: the format's limit for its subtask kind
    # a changed subtask conditions the chunks once decoded this many times in a row (1: at once)
    subtask_confirmations: int = 1
    # subtasks that presuppose a held object, adopted only while the gripper holds (None: off)
    subtask_held_gate: HeldGate | None = None
    # the task's phases in order: a change to a later one is adopted at once (None: off)
    subtask_phase_order: PhaseOrder | None = None
    # GPU fast path (engine/static_paths.py). Off: the eager, data-sized paths (CPU default).
    static_shapes: bool = False  # fixed-shape prefill / action / text steps (eager on CPU)
    # capture those steps in CUDA graphs; implies static_shapes, CUDA only
    cuda_graphs: bool = False
    gpu_preprocess: bool = False  # resize/scale images on the model device (static paths only)
    context_bucket: int = 128  # static action/text contexts are padded to a multiple of this
    # Continuous chunks (engine/continuity.py, model/rtc.py). "rtc": each chunk continues the
    # previous one: rtc_mode auto runs training-time RTC when the checkpoint declares
    # rtc_training_max_delay, else guided RTC with rtc_guidance (see `continuity_mode`).
    chunk_continuity: str = "none"  # "none" | "rtc"
    rtc_mode: str = "auto"  # "auto" | "trained" | "guided"
    action_dt: float = 0.02  # seconds between consecutive actions of a chunk (the controller step)
    rtc_execution_horizon: int = 0  # guided steps of a new chunk at most; 0: the whole overlap
    rtc_max_guidance_weight: float = 5.0  # beta: clip of the guidance weight
    rtc_schedule: str = "exp"  # soft-mask decay over the overlap: "exp" | "linear"
    rtc_guidance: str = "identity"  # guided RTC's correction: "identity" | "vjp"
    # the checkpoint's declaration (the loader sets it); > 0: training-time RTC, refused (guided
    # fallback) for a delay above it
    rtc_training_max_delay: int = 0

    def __post_init__(self) -> None:
        if self.decode_mode not in ("deadline", "fixed"):
            raise ValueError(f"decode_mode must be 'deadline' or 'fixed', got {self.decode_mode!r}")
        if self.gpu_preprocess and not self.uses_static_paths:
            raise ValueError(
                "gpu_preprocess=True works on the static paths: set static_shapes=True (or "
                "cuda_graphs=True)"
            )
        for name in (
            "num_steps",
            "max_active_requests",
            "kv_block_size",
            "default_max_tokens",
            "context_bucket",
            "max_stall_frames",
            "subtask_confirmations",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if (
            self.decode_steps_per_frame < 0
            or self.max_queued_requests < 0
            or self.kv_capacity_tokens < 0
        ):
            raise ValueError(
                "decode_steps_per_frame, max_queued_requests and kv_capacity_tokens must be >= 0"
            )
        if self.chunk_continuity not in CONTINUITY_MODES:
            raise ValueError(
                f"chunk_continuity must be one of {', '.join(CONTINUITY_MODES)}, got "
                f"{self.chunk_continuity!r}"
            )
        if self.rtc_guidance not in GUIDANCE:
            raise ValueError(
                f"rtc_guidance must be one of {', '.join(GUIDANCE)}, got {self.rtc_guidance!r}"
            )
        if self.rtc_mode not in RTC_MODES:
            raise ValueError(
                f"rtc_mode must be one of {', '.join(RTC_MODES)}, got {self.rtc_mode!r}"
            )
        if self.rtc_training_max_delay < 0:
            raise ValueError(
                f"rtc_training_max_delay must be >= 0, got {self.rtc_training_max_delay}"
            )
        if self.rtc_schedule not in SCHEDULES:
            raise ValueError(
                f"rtc_schedule must be one of {', '.join(SCHEDULES)}, got {self.rtc_schedule!r}"
            )
        if not (
            self.action_dt > 0
            and self.rtc_execution_horizon >= 0
            and 0 <= self.rtc_max_guidance_weight < float("inf")
        ):
            raise ValueError(
                f"action_dt must be > 0 (got {self.action_dt}), rtc_execution_horizon >= 0 (got "
                f"{self.rtc_execution_horizon}) "
                f"and rtc_max_guidance_weight finite and >= 0 (got {self.rtc_max_guidance_weight})"
            )
        if self.kind_prompts is not None:
            if not self.kind_prompts:
                raise ValueError("kind_prompts must name at least one language kind")
            empty = [k for k, v in self.kind_prompts.items() if not v.format(text="x").strip()]
            if empty:
                raise ValueError(f"kind prompts must not be empty: {empty}")
        # an unknown preset or a mode the format cannot serve: PromptFormatError (a ValueError)
        check_conditioning(self.format, self.subtask_conditioning)
        if not (self.subtask_period_s >= 0 and self.subtask_max_tokens >= 0):
            raise ValueError(
                f"subtask_period_s (got {self.subtask_period_s}) and subtask_max_tokens (got "
                f"{self.subtask_max_tokens}) must be >= 0"
            )

    @property
    def uses_static_paths(self) -> bool:
        return self.static_shapes or self.cuda_graphs

    @property
    def continuity_mode(self) -> str:
        """What continues a chunk: ``none``, ``trained`` (rtc with a checkpoint trained for it,
        unless rtc_mode is guided) or the guidance, ``identity`` | ``vjp``."""
        if self.chunk_continuity == "none":
            return "none"
        trained = self.rtc_training_max_delay > 0 and self.rtc_mode != "guided"
        return "trained" if trained else self.rtc_guidance

    @property
    def format(self) -> PromptFormat:
        """The prompt format (`prompt_format` resolved)."""
        fmt = self.prompt_format
        return fmt if isinstance(fmt, PromptFormat) else preset(fmt)

    @property
    def hierarchy(self) -> bool:
        """Whether the subtask loop runs (subtask_conditioning prompt or same_frame)."""
        return self.subtask_conditioning != "none"

    @property
    def kinds(self) -> dict[str, KindFormat]:
        """Every language kind a request may have, with its prompt: the format's, with
        ``kind_prompts`` in their place when given (the subtask kind only in the subtask loop)."""
        kinds = dict(self.format.kinds)
        if self.kind_prompts is not None:
            kinds = {k: KindFormat((v,), ours=True) for k, v in self.kind_prompts.items()} | {
                k: v for k, v in kinds.items() if k == "subtask"
            }
        if not self.hierarchy:
            kinds.pop("subtask", None)
        return kinds
