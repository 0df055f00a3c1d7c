"""What the configure transition does with the model: find the checkpoint (or generate a
random-weight one), load the policy, build the OxyGen engine and warm it up.

No rclpy here: the node passes a ``warn`` callable for its logger, so this is usable and testable
on its own.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from ..engine.requests import SamplingParams
from ..engine.scheduler import EngineConfig, OxygenEngine
from ..engine.types import Observation
from ..model.policy import Pi05Policy, load_policy
from .params import RANDOM_WEIGHT_PRESETS, NodeSettings, SettingsError

Log = Callable[[str], None]

CACHE_ENV = "OXYGEN_ROS_CACHE"
RANDOM_WEIGHTS_SEED = 0


def cache_dir() -> Path:
    """``$OXYGEN_ROS_CACHE``, else ``$XDG_CACHE_HOME/oxygen_ros``, else ``~/.cache/oxygen_ros``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "oxygen_ros"


def random_checkpoint(preset: str, root: Optional[Path] = None) -> Path:
    """The cached random-weight checkpoint of ``preset``, generated on first use.

    Generation writes into a temporary sibling directory and renames it into place, so concurrent
    nodes never see a half-written checkpoint.

    Raises:
        ValueError: ``preset`` is not one that may be generated (tiny, small).
    """
    if preset not in RANDOM_WEIGHT_PRESETS:
        raise ValueError(f"random weights are generated only for presets {RANDOM_WEIGHT_PRESETS}, not {preset!r}")
    from ..tools.make_checkpoint import make_checkpoint  # local: pulls in the tokenizer trainer

    parent = (root or cache_dir()) / "checkpoints"
    target = parent / f"random-{preset}-seed{RANDOM_WEIGHTS_SEED}"
    if (target / "model.safetensors").is_file():
        return target
    parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=parent))
    try:
        make_checkpoint(scratch / "ckpt", preset, RANDOM_WEIGHTS_SEED)
        try:
            os.rename(scratch / "ckpt", target)
        except OSError:
            if not (target / "model.safetensors").is_file():  # lost a race only if the winner finished
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return target


def resolve_checkpoint(settings: NodeSettings, warn: Log) -> Path:
    """The checkpoint directory to load: ``checkpoint_dir``, or the preset's random weights (loudly)."""
    if settings.checkpoint_dir:
        return Path(settings.checkpoint_dir).expanduser()
    path = random_checkpoint(settings.preset)
    banner = "!" * 78
    warn(
        f"\n{banner}\n  RANDOM WEIGHTS: checkpoint_dir is empty, so the node runs a random-weight "
        f"'{settings.preset}' model\n  from {path}.\n  Its actions and text are meaningless. Set checkpoint_dir "
        f"to trained pi0.5 weights for a robot.\n{banner}"
    )
    return path


def engine_config(settings: NodeSettings) -> EngineConfig:
    """The engine settings the node's parameters ask for."""
    return EngineConfig(
        decode_mode=settings.decode_mode,
        decode_steps_per_frame=settings.decode_steps_per_frame,
        max_active_requests=settings.max_active_requests,
        kv_capacity_tokens=settings.kv_capacity_tokens,
        deadline_margin_ms=settings.decode_margin_ms,
        seed=settings.seed,
        default_max_tokens=max(settings.narration_max_tokens, settings.answer_max_tokens),
        static_shapes=settings.static_shapes,
        cuda_graphs=settings.cuda_graphs,
        gpu_preprocess=settings.gpu_preprocess,
        chunk_continuity=settings.chunk_continuity,
        action_dt=settings.action_dt,
        rtc_execution_horizon=settings.rtc_execution_horizon,
        rtc_max_guidance_weight=settings.rtc_max_guidance_weight,
        rtc_schedule=settings.rtc_schedule,
    )


def check_fits_model(settings: NodeSettings, policy: Pi05Policy) -> None:
    """Raise :class:`SettingsError` when the parameters ask for more than the model has."""
    config = policy.config
    if settings.action_horizon > config.action_horizon:
        raise SettingsError(
            f"action_horizon {settings.action_horizon} exceeds the model's horizon {config.action_horizon}"
        )
    if len(settings.action_joint_names) > config.action_dim:
        raise SettingsError(
            f"{len(settings.action_joint_names)} action joints but the model has {config.action_dim} action dims"
        )
    if len(settings.joint_names) > policy.state_stats.dim:
        raise SettingsError(
            f"{len(settings.joint_names)} joint_names but the checkpoint's state norm stats cover "
            f"{policy.state_stats.dim} dims"
        )


def load_engine(settings: NodeSettings, warn: Log, info: Log) -> OxygenEngine:
    """Load the policy and build the engine (the thread calling this gets ``torch_threads``).

    Raises:
        CheckpointError (a ValueError), FileNotFoundError, SettingsError, RuntimeError: the
        checkpoint cannot be loaded or does not fit the parameters; the message says why.
    """
    torch.set_num_threads(settings.torch_threads)
    path = resolve_checkpoint(settings, warn)
    started = time.monotonic()
    policy = load_policy(
        path,
        tokenizer_path=settings.tokenizer_path or None,
        device=settings.device,
        dtype=settings.dtype,
        action_dim=len(settings.action_joint_names),
        robot=settings.robot,
    )
    check_fits_model(settings, policy)
    info(
        f"loaded '{policy.config.name}' model from {path} in {time.monotonic() - started:.2f} s "
        f"(horizon {policy.config.action_horizon}, {len(settings.action_joint_names)} action joints, "
        f"device {settings.device}, {settings.dtype})"
    )
    return OxygenEngine(policy, engine_config(settings), clock=time.monotonic)


def synthetic_observation(settings: NodeSettings, size: int = 224) -> Observation:
    """A grey observation with every configured camera slot, for warming up."""
    image = np.full((size, size, 3), 128, dtype=np.uint8)
    return Observation(
        images={cam.slot: image for cam in settings.cameras},
        state=np.zeros(len(settings.joint_names), dtype=np.float32),
        prompt=settings.task,
    )


@dataclasses.dataclass(frozen=True)
class WarmUpTimes:
    """What the warm-up measured of the engine's part of a tick (milliseconds)."""

    action_ms: float  # prefill + action expert, median of the frames after the first
    language_step_ms: float  # one decode step at batch 1 (the engine's estimate)


def warm_up(engine: OxygenEngine, settings: NodeSettings, frames: int = 5) -> WarmUpTimes:
    """Prepare the engine before the first real deadline: `OxygenEngine.warm_up` captures the CUDA
    graphs (if any) and times decode steps at every batch size it may use; a few frames with language
    requests then pay the first-call costs of the whole tick and time the action path.
    """
    observation = synthetic_observation(settings)
    engine.warm_up(observation)
    sampling = SamplingParams(max_tokens=4, temperature=0.0, seed=settings.seed)
    action_s = []
    for frame in range(max(frames, 2)):
        started = time.monotonic()
        engine.act(observation)
        action_s.append(time.monotonic() - started)
        for _ in range(min(frame, 2) + 1):  # batches of 1, 2, 3
            engine.submit("narration", sampling=sampling)
        engine.decode()
        engine.decode(max_steps=16)
    engine.decode(max_steps=64)
    return WarmUpTimes(action_ms=1e3 * float(np.median(action_s[1:])),
                       language_step_ms=1e3 * engine.timer.estimate(1))
