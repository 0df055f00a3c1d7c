"""Write a model as a LeRobot ``pi05`` ``pretrained_model/`` folder, in the layout ``lerobot-train``
writes (``oxygen-make-checkpoint --format lerobot``; the tests' LeRobot folders).

Files, as LeRobot 0.4.4 (``version="0.4"``) or its main (``version="main"``) saves them::

    config.json                 "type": "pi05", input/output features, chunk_size, ...
    model.safetensors           "model." + openpi's tensor names (the tied embedding as lm_head)
    policy_preprocessor.json    rename, to_batch, [main: relative_actions], normalizer, pi05
                                prompt, tokenizer, device steps
    policy_preprocessor_step_<i>_normalizer_processor.safetensors   "<feature>.<stat>"
    policy_postprocessor.json   unnormalizer, [main: absolute_actions], device steps
    policy_postprocessor_step_0_unnormalizer_processor.safetensors

No LeRobot code is used; the format facts are in the repository's LeRobot notes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file

from oxygen_ros.checkpoints.core import MODEL_FILENAME, module_to_file_key
from oxygen_ros.checkpoints.lerobot import (
    ACTION_KEY,
    CONFIG_FILENAME,
    POSTPROCESSOR_FILENAME,
    PREPROCESSOR_FILENAME,
    STATE_KEY,
)
from oxygen_ros.checkpoints.norm_stats import NormStats
from oxygen_ros.model.pi05 import Pi05Model

EXPERT_LM_HEAD = "paligemma_with_expert.gemma_expert.lm_head.weight"  # unused, but LeRobot has it


def lerobot_stats(stats: NormStats) -> dict[str, np.ndarray]:
    """A LeRobot dataset-stats entry (mean, std, min, max, q01, q99, q10, q90) from openpi-style
    stats; min/max and q10/q90 are placed around / inside the 1%-99% range."""
    span = stats.q99 - stats.q01
    return {
        "mean": stats.mean,
        "std": stats.std,
        "min": stats.q01 - 0.1 * span,
        "max": stats.q99 + 0.1 * span,
        "q01": stats.q01,
        "q99": stats.q99,
        "q10": stats.q01 + 0.1 * span,
        "q90": stats.q99 - 0.1 * span,
    }


def _flat_stats(stats: Mapping[str, Mapping[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    return {
        f"{feature}.{name}": torch.from_numpy(np.array(values, dtype=np.float32))
        for feature, entry in stats.items()
        for name, values in entry.items()
    }


def write_lerobot_folder(
    out_dir: Path,
    model: Pi05Model,
    stats: Mapping[str, Mapping[str, np.ndarray]],
    *,
    cameras: Sequence[str] = ("observation.images.base_0_rgb", "observation.images.wrist"),
    state_dim: int = 8,
    action_dim: int = 7,
    version: str = "0.4",
    norm_mode: str = "QUANTILES",
    eps: float = 1e-8,
    empty_cameras: int = 0,
    relative_actions: bool = False,
    exclude_joints: Sequence[str] = ("gripper",),
    action_names: Sequence[str] | None = None,
    n_action_steps: int | None = None,
    num_inference_steps: int = 10,
    prefixed: bool = True,
    with_processors: bool = True,
    config_overrides: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``model`` and ``stats`` ({"observation.state": {...}, "action": {...}, ...}) as a
    LeRobot pi05 folder; returns ``out_dir``.

    ``prefixed=False`` writes bare openpi names (as ``lerobot/pi05_base`` is published);
    ``with_processors=False`` writes no processor files (no statistics at all).
    """
    if version not in ("0.4", "main"):
        raise ValueError(f"version must be 0.4 or main, got {version!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    size = cfg.vision.image_size
    tensors = {
        ("model." if prefixed else "") + module_to_file_key(k): v.detach().cpu().contiguous()
        for k, v in model.state_dict().items()
    }
    tensors[("model." if prefixed else "") + EXPERT_LM_HEAD] = torch.zeros(
        cfg.vocab_size, cfg.expert.width
    )
    save_file(tensors, str(out_dir / MODEL_FILENAME), metadata={"format": "pt"})

    input_features: dict[str, Any] = {
        key: {"type": "VISUAL", "shape": [3, size, size]} for key in cameras
    }
    input_features[STATE_KEY] = {"type": "STATE", "shape": [state_dim]}
    output_features = {ACTION_KEY: {"type": "ACTION", "shape": [action_dim]}}
    norm_map = {"VISUAL": "IDENTITY", "STATE": norm_mode, "ACTION": norm_mode}
    config: dict[str, Any] = {
        "type": "pi05",
        "n_obs_steps": 1,
        "input_features": input_features,
        "output_features": output_features,
        "device": "cpu",
        "use_amp": False,
        "paligemma_variant": "gemma_2b",
        "action_expert_variant": "gemma_300m",
        "dtype": "float32",
        "chunk_size": cfg.action_horizon,
        "n_action_steps": n_action_steps or cfg.action_horizon,
        "max_state_dim": 32,
        "max_action_dim": cfg.action_dim,
        "num_inference_steps": num_inference_steps,
        "time_sampling_beta_alpha": 1.5,
        "time_sampling_beta_beta": 1.0,
        "time_sampling_scale": 0.999,
        "time_sampling_offset": 0.001,
        "min_period": 0.004,
        "max_period": 4.0,
        "rtc_config": None,
        "image_resolution": [size, size],
        "empty_cameras": empty_cameras,
        "tokenizer_max_length": cfg.max_token_len,
        "normalization_mapping": norm_map,
        "gradient_checkpointing": False,
        "compile_model": False,
    }
    if version == "main":
        config.update(
            {
                "use_visual_memory": False,
                "use_proprioceptive_memory": False,
                "use_relative_actions": relative_actions,
                "relative_exclude_joints": list(exclude_joints),
                "action_feature_names": list(action_names) if action_names else None,
                "rtc_training_max_delay": 0,
            }
        )
    config.update(config_overrides or {})
    (out_dir / CONFIG_FILENAME).write_text(json.dumps(config, indent=4) + "\n")
    if not with_processors:
        return out_dir

    features = {k: {"type": v["type"], "shape": v["shape"]} for k, v in input_features.items()}
    features.update(output_features)
    normalizer_config = {"eps": eps, "features": features, "norm_map": norm_map}
    pre_steps: list[dict[str, Any]] = [
        {"registry_name": "rename_observations_processor", "config": {"rename_map": {}}},
        {"registry_name": "to_batch_processor", "config": {}},
    ]
    if version == "main":
        pre_steps.append(
            {
                "registry_name": "relative_actions_processor",
                "config": {
                    "enabled": relative_actions,
                    "exclude_joints": list(exclude_joints),
                    "action_names": list(action_names) if action_names else None,
                },
            }
        )
    index = len(pre_steps)
    pre_state = f"policy_preprocessor_step_{index}_normalizer_processor.safetensors"
    save_file(_flat_stats(stats), str(out_dir / pre_state))
    pre_steps += [
        {
            "registry_name": "normalizer_processor",
            "config": normalizer_config,
            "state_file": pre_state,
        },
        {"registry_name": "pi05_prepare_state_tokenizer_processor_step", "config": {}},
        {
            "registry_name": "tokenizer_processor",
            "config": {
                "max_length": cfg.max_token_len,
                "task_key": "task",
                "padding_side": "right",
                "padding": "max_length",
                "truncation": True,
                "tokenizer_name": "google/paligemma-3b-pt-224",
            },
        },
        {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}},
    ]
    post_state = "policy_postprocessor_step_0_unnormalizer_processor.safetensors"
    save_file(_flat_stats(stats), str(out_dir / post_state))
    post_steps: list[dict[str, Any]] = [
        {
            "registry_name": "unnormalizer_processor",
            "config": normalizer_config,
            "state_file": post_state,
        }
    ]
    if version == "main":
        post_steps.append(
            {"registry_name": "absolute_actions_processor", "config": {"enabled": relative_actions}}
        )
    post_steps.append(
        {"registry_name": "device_processor", "config": {"device": "cpu", "float_dtype": None}}
    )
    for filename, name, steps in (
        (PREPROCESSOR_FILENAME, "policy_preprocessor", pre_steps),
        (POSTPROCESSOR_FILENAME, "policy_postprocessor", post_steps),
    ):
        (out_dir / filename).write_text(json.dumps({"name": name, "steps": steps}, indent=2))
    return out_dir
