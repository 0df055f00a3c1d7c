"""The node's parameters as engine-level arguments, and the configure transition's model steps.

:func:`model_spec` and :func:`engine_config` turn :class:`NodeSettings` into what
:mod:`oxygen_ros.engine.runtime` takes; :func:`check_fits_model` checks the parameters against the
loaded model; :func:`load_engine` and :func:`warm_up_observation` are what ``configure`` runs.
No rclpy here: the node passes an ``info`` callable for its logger.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from ..engine.runtime import ModelSpec, build_engine, load_policy
from ..engine.scheduler import OxygenEngine
from ..engine.settings import EngineConfig
from ..engine.types import Observation
from ..policy_io.policy import Pi05Policy
from ..policy_io.prompts import MIN_SUBTASK_TOKENS, subtask_max_tokens
from ..policy_io.robots import DELTA_POSITION
from ..policy_io.tokenizer import PromptTooLong
from .params import NodeSettings, SettingsError, check_chunk_fits

Log = Callable[[str], None]


def model_spec(settings: NodeSettings) -> ModelSpec:
    """The model the node's parameters ask for."""
    return ModelSpec(
        checkpoint_dir=settings.checkpoint_dir,
        tokenizer_path=settings.tokenizer_path,
        lerobot_version=settings.lerobot_version,
        device=settings.device,
        dtype=settings.dtype,
        robot=settings.robot,
        action_dim=len(settings.action_joint_names),
        torch_threads=settings.torch_threads,
    )


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
        prompt_format=settings.format,
        subtask_conditioning=settings.subtask_conditioning,
        subtask_period_s=settings.subtask_period_s,
        subtask_max_tokens=settings.subtask_max_tokens,
        subtask_confirmations=settings.subtask_confirmations,
        subtask_held_gate=settings.held_gate,
        subtask_phase_order=settings.phase_order,
        rtc_mode=settings.rtc_mode,
        rtc_guidance=settings.rtc_guidance,
    )


def check_fits_model(settings: NodeSettings, policy: Pi05Policy) -> None:
    """Raise :class:`SettingsError` when the parameters ask for more than the model has (a task
    whose prompt cannot fit ``max_token_len`` included)."""
    check_chunk_fits(settings, policy.config.action_horizon, policy.config.action_dim)
    state_dim = policy.state_dim
    if state_dim is not None and len(settings.joint_names) > state_dim:
        raise SettingsError(
            f"{len(settings.joint_names)} joint_names but the checkpoint's state norm stats cover "
            f"{state_dim} dims"
        )
    if policy.lerobot is not None:
        check_fits_lerobot(settings, policy)
    conditioned = settings.subtask_conditioning != "none"
    try:  # the task parameter, also when ~/instruction sets it
        policy.check_task(
            settings.task,
            len(settings.joint_names),
            settings.format,
            conditioned,
            subtask_tokens=min(
                MIN_SUBTASK_TOKENS, subtask_max_tokens(settings.format, settings.subtask_max_tokens)
            )
            if conditioned
            else 0,
        )
    except PromptTooLong as exc:
        raise SettingsError(f"task refused ({len(settings.task)} characters): {exc}") from exc
    except ValueError as exc:  # a state width the robot's transform cannot take
        raise SettingsError(f"joint_names do not give the robot's state: {exc}") from exc


def check_fits_lerobot(settings: NodeSettings, policy: Pi05Policy) -> None:
    """A LeRobot checkpoint's own cameras, state width and action space against the parameters."""
    cameras = [cam.slot for cam in settings.cameras]
    try:
        policy.present_slots(dict.fromkeys(cameras))
    except ValueError as exc:
        raise SettingsError(
            f"camera_slots {cameras} do not name this LeRobot checkpoint's cameras "
            f"{list(policy.image_slots)} (config.json input_features): {exc}"
        ) from exc
    if policy.state_dim is not None and len(settings.joint_names) != policy.state_dim:
        raise SettingsError(
            f"the LeRobot checkpoint's observation.state has {policy.state_dim} dims but "
            f"joint_names has {len(settings.joint_names)}"
        )
    robot = policy.robot
    if robot.action_space == DELTA_POSITION:
        absolute = [
            settings.action_joint_names[i]
            for i in robot.gripper_dims
            if i < len(settings.action_joint_names)
        ]
        if settings.command_space != DELTA_POSITION or tuple(settings.gripper_dims) != tuple(
            i for i in robot.gripper_dims if i < len(settings.action_joint_names)
        ):
            raise SettingsError(
                "this LeRobot checkpoint predicts actions relative to the state "
                "(use_relative_actions): set action_space: delta_position and "
                f"gripper_joint_names: {absolute} (the dims it keeps absolute)"
            )
        if settings.chunk_continuity != "none":
            raise SettingsError(
                "chunk_continuity rtc guides a chunk towards the previous one in robot units, but "
                "this LeRobot checkpoint's actions are relative to each frame's own state "
                "(use_relative_actions); set chunk_continuity: none"
            )
    elif settings.command_space == DELTA_POSITION:
        raise SettingsError(
            "this LeRobot checkpoint predicts absolute actions (no use_relative_actions); "
            "action_space delta_position would add the state to them"
        )


def load_engine(settings: NodeSettings, info: Log) -> OxygenEngine:
    """Load the policy, check it against the parameters and build the engine (the calling thread
    gets ``torch_threads``).

    Raises:
        ValueError (CheckpointError, or an empty checkpoint_dir), FileNotFoundError, SettingsError,
        RuntimeError: the checkpoint cannot be loaded or does not fit the parameters; the message
        says why.
    """
    started = time.monotonic()
    policy = load_policy(model_spec(settings))
    check_fits_model(settings, policy)
    info(
        f"loaded '{policy.config.name}' model from {settings.checkpoint_dir} in "
        f"{time.monotonic() - started:.2f} s (horizon {policy.config.action_horizon}, "
        f"{len(settings.action_joint_names)} action joints, device {settings.device}, "
        f"{settings.dtype})"
    )
    for line in describe_checkpoint(policy):
        info(line)
    config = engine_config(settings)
    if policy.num_steps is not None:
        config = dataclasses.replace(config, num_steps=policy.num_steps)
    engine = build_engine(policy, config)
    if engine.continuity is not None:
        cfg = engine.config
        info(
            f"chunk_continuity rtc: {cfg.continuity_mode} RTC"
            + (
                f" (the checkpoint declares rtc_training_max_delay {cfg.rtc_training_max_delay};"
                f" a longer delay falls back to {cfg.rtc_guidance} guidance)"
                if cfg.continuity_mode == "trained"
                else ""
            )
        )
    return engine


def describe_checkpoint(policy: Pi05Policy) -> list[str]:
    """Which checkpoint format was found, why, and what it decides (logged at configure)."""
    spec = policy.lerobot
    if spec is None:
        return [f"checkpoint format: {policy.format_reason or 'openpi'}"]
    return [
        f"checkpoint format: {policy.format_reason}",
        *(f"LeRobot {note}" for note in spec.notes),
        f"LeRobot num_inference_steps {spec.num_inference_steps} denoising steps, "
        f"n_action_steps {policy.published_horizon} actions published per chunk "
        "(action_horizon 0)",
    ]


def warm_up_observation(settings: NodeSettings, size: int = 224) -> Observation:
    """A grey observation with every configured camera slot, for warming up."""
    image = np.full((size, size, 3), 128, dtype=np.uint8)
    return Observation(
        images={cam.slot: image for cam in settings.cameras},
        state=np.zeros(len(settings.joint_names), dtype=np.float32),
        prompt=settings.task,
    )
