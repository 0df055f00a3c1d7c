"""Build a ready OxyGen engine from plain arguments: load the policy, make the engine, warm it up.

What a program that runs the model needs, without ROS: the node converts its parameters into a
:class:`ModelSpec` and an :class:`~oxygen_ros.engine.settings.EngineConfig` and calls
:func:`load_policy`, :func:`build_engine` and :func:`warm_up`; a script can do the same.

This module imports only the model and engine layers (never ``ros`` or ``tools``). It does not
generate checkpoints: random-weight ones are made by ``oxygen-make-checkpoint`` (tooling).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from ..policy_io.policy import Pi05Policy
from ..policy_io.policy import load_policy as _load_policy
from .scheduler import OxygenEngine, PoolShare
from .settings import EngineConfig
from .types import Clock, Observation, WarmUpReport

MAKE_CHECKPOINT_HINT = (
    "make one with `oxygen-make-checkpoint --preset tiny --out DIR` (random weights, for trying "
    "the package) or run `make demo`; for a robot, convert openpi's pi0.5 weights "
    "(see docs/robot_guide.md)"
)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which model to load and where it runs."""

    # openpi layout (model.safetensors + assets/*/norm_stats.json) or a LeRobot pi05 folder
    checkpoint_dir: str
    tokenizer_path: str = ""  # sentencepiece file or HF tokenizer folder; empty: the checkpoint's
    # LeRobot folders: whose input conventions (checkpoints.conventions)
    lerobot_version: str = "auto"
    device: str = "cpu"
    dtype: str = "float32"
    robot: str = "generic"  # the robot adapter (policy_io.robots)
    action_dim: int | None = None  # action dims the robot uses; None: the model's
    torch_threads: int = 1  # torch threads of the calling thread


def load_policy(spec: ModelSpec) -> Pi05Policy:
    """Load the checkpoint of ``spec`` (the calling thread gets ``torch_threads``).

    Raises:
        ValueError: ``checkpoint_dir`` is empty (the message says how to make a checkpoint).
        CheckpointError (a ValueError), FileNotFoundError, RuntimeError: the checkpoint cannot be
            loaded; the message says why.
        DeviceUnavailable (a ValueError): ``device`` is one this torch cannot use (e.g. cuda on a
            CPU-only build: the message names torch's version, CUDA's availability and the fix).
    """
    if not spec.checkpoint_dir:
        raise ValueError(
            f"checkpoint_dir is empty: give an openpi-layout or LeRobot pi05 checkpoint directory; "
            f"{MAKE_CHECKPOINT_HINT}"
        )
    torch.set_num_threads(spec.torch_threads)
    return _load_policy(
        Path(spec.checkpoint_dir).expanduser(),
        tokenizer_path=spec.tokenizer_path or None,
        device=spec.device,
        dtype=spec.dtype,
        action_dim=spec.action_dim,
        robot=spec.robot,
        lerobot_version=spec.lerobot_version,
    )


def build_engine(
    policy: Pi05Policy,
    config: EngineConfig,
    clock: Clock = time.monotonic,
    share: PoolShare | None = None,
) -> OxygenEngine:
    """The OxyGen engine over ``policy`` (steady ``clock`` by default, as the node's deadlines),
    in a pool of its own or in ``share``'s beside other robots' engines.

    A checkpoint that declares ``rtc_training_max_delay`` (`Pi05Policy.rtc_training_max_delay`)
    sets it in the config, so ``chunk_continuity: rtc`` runs training-time RTC (``rtc_mode``
    auto or trained).

    Raises:
        ValueError: ``rtc_mode`` trained for a checkpoint that declares no training-time RTC.
    """
    if policy.rtc_training_max_delay and not config.rtc_training_max_delay:
        config = dataclasses.replace(config, rtc_training_max_delay=policy.rtc_training_max_delay)
    if config.chunk_continuity == "rtc" and config.rtc_mode == "trained":
        if not config.rtc_training_max_delay:
            raise ValueError(
                "rtc_mode trained needs a checkpoint trained with a clean action prefix (its "
                "config.json declares rtc_training_max_delay > 0); this one does not: use "
                "rtc_mode guided or auto"
            )
    return OxygenEngine(policy, config, clock=clock, share=share)


def warm_up(engine: OxygenEngine, observation: Observation) -> WarmUpReport:
    """Prepare ``engine`` before its first real deadline (`EngineBase.warm_up`: bucket capture,
    decode calibration, first-call frames) and report what its part of a tick costs."""
    return engine.warm_up(observation)
