"""LeRobot folders that lie: every field the loader reads from config.json and the processor files
is checked at load, with a LeRobotFormatError that names the field and the file.

Each case edits a copy of the folder ``oxygen-make-checkpoint --format lerobot`` writes (two
cameras, a 6-dim state and action, chunk_size 10) and replaces its weights with garbage: the error
is the lie's, raised before any weight is read, never a bare Python error or one at the first frame.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from oxygen_ros.checkpoints.core import CheckpointError
from oxygen_ros.checkpoints.lerobot import LeRobotFormatError
from oxygen_ros.checkpoints.loader import load_checkpoint
from oxygen_ros.tools.make_checkpoint import make_lerobot_checkpoint

CONFIG, PRE, POST = "config.json", "policy_preprocessor.json", "policy_postprocessor.json"
PRE_STATS = "policy_preprocessor_step_2_normalizer_processor.safetensors"
POST_STATS = "policy_postprocessor_step_0_unnormalizer_processor.safetensors"
STATE, ACTION = "observation.state", "action"
FRONT = "observation.images.front"
DELETE = object()  # `put` removes the key


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    return make_lerobot_checkpoint(tmp_path_factory.mktemp("made") / "lerobot", "tiny")


@pytest.fixture
def folder(made, tmp_path) -> Path:
    """A private copy whose weights are garbage: only a check before the weights can refuse it."""
    copy = Path(shutil.copytree(made, tmp_path / "lerobot"))
    (copy / "model.safetensors").write_bytes(b"not read")
    return copy


def put(data: Any, keys: Sequence[Any], value: Any) -> None:
    """``data[k0][k1]... = value`` (DELETE: remove the key)."""
    for key in keys[:-1]:
        data = data[key]
    if value is DELETE:
        del data[keys[-1]]
    else:
        data[keys[-1]] = value


def edit_json(path: Path, edit: Callable[[Any], Any]) -> None:
    """Apply ``edit`` (which changes the parsed JSON in place) to the file."""
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def wrap_in_list(path: Path) -> None:
    path.write_text(json.dumps([json.loads(path.read_text())]))


def step(processor: dict, name: str) -> dict:
    return next(s for s in processor["steps"] if s.get("registry_name") == name)


def edit_stats(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def refused(folder: Path, *parts: str) -> str:
    """Loading ``folder`` raises a LeRobotFormatError whose message holds every one of ``parts``
    (the field and the file)."""
    with pytest.raises(LeRobotFormatError) as info:
        load_checkpoint(folder)
    message = str(info.value)
    for part in parts:
        assert part in message, (part, message)
    return message


def test_the_made_folder_loads(made):
    spec = load_checkpoint(made).lerobot
    assert (spec.state_dim, spec.action_dim, spec.max_state_dim, spec.chunk_size) == (6, 6, 32, 10)


# -- the two found cases -------------------------------------------------------------------------


def test_json_nested_too_deeply_names_the_file(folder):
    (folder / CONFIG).write_text("[" * 200_000 + "]" * 200_000)
    refused(folder, f"{folder / CONFIG} is not readable JSON", "nested too deeply")


@pytest.mark.parametrize("filename", [PRE, POST])
def test_a_processor_file_nested_too_deeply_names_it(folder, filename):
    (folder / filename).write_text('{"steps": ' + "[" * 200_000 + "]" * 200_000 + "}")
    refused(folder, f"{folder / filename} is not readable JSON", "nested too deeply")


def test_json_that_is_not_utf8_names_the_file(folder):
    (folder / CONFIG).write_bytes(b'{"type": "pi05\xff"}')
    refused(folder, f"{folder / CONFIG} is not readable JSON")


def test_max_state_dim_below_the_states_width_is_refused_at_load(folder):
    edit_json(folder / CONFIG, lambda c: c.update(max_state_dim=2))
    refused(folder, str(folder / CONFIG), "max_state_dim 2 is below the state's 6 dims")


def test_max_state_dim_below_the_statistics_width_is_refused_without_a_state_feature(folder):
    def edit(c):
        del c["input_features"][STATE]
        c["max_state_dim"] = 2

    edit_json(folder / CONFIG, edit)
    refused(folder, "max_state_dim 2 is below the state's 6 dims", f"{PRE} normalizer_processor")


def test_an_action_wider_than_max_action_dim_is_refused(folder):
    edit_json(folder / CONFIG, lambda c: c.update(max_action_dim=4))
    refused(
        folder, str(folder / CONFIG), "output_features['action'] has 6 dims", "max_action_dim 4"
    )


# -- config.json: types, ranges, shapes ----------------------------------------------------------

CONFIG_LIES = [
    # integers: a string, a bool (an int in Python), a float, null, zero, negative
    (["chunk_size"], "10", "chunk_size must be a positive integer, got '10'"),
    (["chunk_size"], True, "chunk_size must be a positive integer, got True"),
    (["chunk_size"], 2.5, "chunk_size must be a positive integer, got 2.5"),
    (["chunk_size"], 10.0, "chunk_size must be a positive integer, got 10.0"),
    (["chunk_size"], None, "chunk_size must be a positive integer, got None"),
    (["chunk_size"], 0, "chunk_size must be a positive integer, got 0"),
    (["chunk_size"], -3, "chunk_size must be a positive integer, got -3"),
    (["n_action_steps"], 0, "n_action_steps must be a positive integer, got 0"),
    (["n_action_steps"], 11, "n_action_steps 11 exceeds chunk_size 10"),
    (["num_inference_steps"], 0, "num_inference_steps must be a positive integer, got 0"),
    (["num_inference_steps"], "10", "num_inference_steps must be a positive integer"),
    (["max_state_dim"], "32", "max_state_dim must be a positive integer, got '32'"),
    (["max_state_dim"], -1, "max_state_dim must be a positive integer, got -1"),
    (["max_action_dim"], 0, "max_action_dim must be a positive integer, got 0"),
    (["max_action_dim"], [32], "max_action_dim must be a positive integer, got [32]"),
    (["tokenizer_max_length"], "200", "tokenizer_max_length must be a positive integer"),
    (["tokenizer_max_length"], 0, "tokenizer_max_length must be a positive integer, got 0"),
    (["empty_cameras"], -1, "empty_cameras must be an integer >= 0, got -1"),
    (["empty_cameras"], True, "empty_cameras must be an integer >= 0, got True"),
    (["empty_cameras"], 1.5, "empty_cameras must be an integer >= 0, got 1.5"),
    # numbers and flags
    (["min_period"], "0.004", "min_period must be a positive number, got '0.004'"),
    (["max_period"], None, "max_period must be a positive number, got None"),
    (["max_period"], float("nan"), "max_period must be a positive number, got nan"),
    (["min_period"], 0.01, "min_period/max_period (0.01, 4.0) differ from pi0.5's"),
    (["use_proprioceptive_memory"], "false", "use_proprioceptive_memory must be true or false"),
    (["use_visual_memory"], 0, "use_visual_memory must be true or false, got 0"),
    (["use_relative_actions"], "false", "use_relative_actions must be true or false"),
    (["relative_exclude_joints"], "gripper", "relative_exclude_joints must be a list of strings"),
    (["action_feature_names"], [1, 2], "action_feature_names must be a list of strings"),
    # image resolution
    (["image_resolution"], 224, "image_resolution must be a list of 2 positive integers, got 224"),
    (["image_resolution"], [224], "image_resolution must be a list of 2 positive integers"),
    (["image_resolution"], [224, "224"], "image_resolution must be a list of 2 positive int"),
    (["image_resolution"], [0, 224], "image_resolution must be a list of 2 positive integers"),
    (["image_resolution"], None, "image_resolution must be a list of 2 positive integers"),
    # normalisation mapping
    (["normalization_mapping"], ["STATE"], "normalization_mapping must be an object"),
    (["normalization_mapping", "STATE"], "ZSCORE", "normalization_mapping['STATE'] must be one of"),
    (["normalization_mapping", "PIXELS"], "IDENTITY", "normalization_mapping key must be one of"),
    # features: containers, types, shapes
    (["input_features"], ["x"], "input_features must be an object, got ['x']"),
    (["input_features", STATE], "STATE", "input_features['observation.state'] must be an object"),
    (["input_features", STATE, "type"], "DEPTH", "input_features['observation.state'].type must"),
    (["input_features", STATE, "type"], "VISUAL", "input_features['observation.state'].type must"),
    (["input_features", STATE, "type"], DELETE, "input_features['observation.state'].type must"),
    (["input_features", STATE, "shape"], ["6"], "input_features['observation.state'].shape must"),
    (["input_features", STATE, "shape"], [6, 1], "input_features['observation.state'].shape must"),
    (["input_features", STATE, "shape"], [], "input_features['observation.state'].shape must"),
    (["input_features", STATE, "shape"], [-6], "input_features['observation.state'].shape must"),
    (["input_features", STATE, "shape"], DELETE, "input_features['observation.state'].shape"),
    (["input_features", FRONT, "shape"], [224, 224], f"input_features['{FRONT}'].shape must"),
    (["input_features", FRONT, "shape"], [1, 224, 224], "[3, height, width] (RGB, channels first)"),
    (["input_features", FRONT, "shape"], [3, 224, 224.0], f"input_features['{FRONT}'].shape"),
    (["output_features", ACTION, "shape"], [0], "output_features['action'].shape must be a list"),
    (
        ["output_features", ACTION, "type"],
        "STATE",
        "output_features['action'].type must be 'ACTION'",
    ),
]


@pytest.mark.parametrize(
    "keys,value,says", CONFIG_LIES, ids=[f"{'.'.join(k)}={v!r}"[:60] for k, v, _ in CONFIG_LIES]
)
def test_config_json_lies_are_refused_naming_the_field_and_file(folder, keys, value, says):
    edit_json(folder / CONFIG, lambda c: put(c, keys, value))
    refused(folder, str(folder / CONFIG), says)


def test_a_config_json_that_is_not_an_object_is_refused(folder):
    wrap_in_list(folder / CONFIG)
    refused(folder, f"{folder / CONFIG} must hold a JSON object")


# -- the processor files -------------------------------------------------------------------------

NORMALIZER = "normalizer_processor"
PROCESSOR_LIES = [
    # (file, edit of the parsed JSON, what the message says)
    (POST, lambda p: p.update(steps={"a": 1}), "steps must be a list of step objects"),
    (PRE, lambda p: p.pop("steps"), "steps must be a list of step objects, got None"),
    (PRE, lambda p: p["steps"].append(1), "steps[6]: the step must be an object, got 1"),
    (PRE, lambda p: p["steps"][0].update(registry_name=5), "steps[0]: registry_name must be a str"),
    (POST, lambda p: p["steps"][0].update(config=[]), "steps[0]: config must be an object, got []"),
    (PRE, lambda p: step(p, NORMALIZER).update(state_file=5), "state_file must be a string"),
    (
        PRE,
        lambda p: step(p, NORMALIZER).update(state_file="../x.safetensors"),
        "normalizer_processor: state_file must be a file name in the checkpoint folder",
    ),
    (
        PRE,
        lambda p: step(p, NORMALIZER).update(state_file="absent.safetensors"),
        "names the statistics file 'absent.safetensors', which is not in",
    ),
    (PRE, lambda p: put(step(p, NORMALIZER), ["config", "eps"], "1e-8"), "config: eps must be"),
    (PRE, lambda p: put(step(p, NORMALIZER), ["config", "eps"], 0), "eps must be a positive num"),
    (
        POST,
        lambda p: put(step(p, "unnormalizer_processor"), ["config", "eps"], -1.0),
        "unnormalizer_processor config: eps must be a positive number, got -1.0",
    ),
    (
        PRE,
        lambda p: put(step(p, NORMALIZER), ["config", "norm_map", "STATE"], "BOGUS"),
        "normalizer_processor config: norm_map['STATE'] must be one of IDENTITY",
    ),
    (
        POST,
        lambda p: put(step(p, "unnormalizer_processor"), ["config", "norm_map"], ["QUANTILES"]),
        "unnormalizer_processor config: norm_map must be an object",
    ),
    (
        PRE,
        lambda p: put(step(p, NORMALIZER), ["config", "features", STATE, "shape"], "6"),
        "normalizer_processor config: features['observation.state'].shape must be a list",
    ),
    (
        PRE,
        lambda p: put(step(p, NORMALIZER), ["config", "normalize_observation_keys"], STATE),
        "normalize_observation_keys must be a list of strings",
    ),
    (
        PRE,
        lambda p: put(step(p, "tokenizer_processor"), ["config", "max_length"], "200"),
        "tokenizer_processor config: max_length must be a positive integer, got '200'",
    ),
    (
        PRE,
        lambda p: put(step(p, "tokenizer_processor"), ["config", "max_length"], 2.5),
        "tokenizer_processor config: max_length must be a positive integer, got 2.5",
    ),
    (
        PRE,
        lambda p: p["steps"].insert(
            2, {"registry_name": "relative_actions_processor", "config": {"enabled": "yes"}}
        ),
        "relative_actions_processor config: enabled must be true or false, got 'yes'",
    ),
    (
        PRE,
        lambda p: p["steps"].insert(
            2,
            {
                "registry_name": "relative_actions_processor",
                "config": {"enabled": True, "exclude_joints": "gripper"},
            },
        ),
        "relative_actions_processor config: exclude_joints must be a list of strings",
    ),
    (PRE, lambda p: p["steps"].append(step(p, NORMALIZER)), "2 'normalizer_processor' steps"),
]


@pytest.mark.parametrize(
    "filename,edit,says",
    PROCESSOR_LIES,
    ids=[f"{i}-{c[2][:40]}" for i, c in enumerate(PROCESSOR_LIES)],
)
def test_processor_lies_are_refused_naming_the_field_and_file(folder, filename, edit, says):
    edit_json(folder / filename, edit)
    refused(folder, str(folder / filename), says)


@pytest.mark.parametrize("filename", [PRE, POST])
def test_a_processor_file_that_is_not_an_object_is_refused(folder, filename):
    wrap_in_list(folder / filename)
    refused(folder, f"{folder / filename} must hold a JSON object {{'steps': [...]}}")


# -- statistics ----------------------------------------------------------------------------------


def _set(name: str, value: Callable[[torch.Tensor], torch.Tensor | None]):
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        new = value(tensors[name])
        if new is None:
            del tensors[name]
        else:
            tensors[name] = new

    return edit


STATS_LIES = [
    (PRE_STATS, _set(f"{STATE}.q01", lambda t: t[:5].clone()), "widths [5, 6] but the feature"),
    (POST_STATS, _set(f"{ACTION}.q99", lambda t: t[:4].clone()), "widths [4, 6] but the feature"),
    (PRE_STATS, _set(f"{STATE}.q99", lambda t: None), "statistics lack ['q99']"),
    (PRE_STATS, _set(f"{STATE}.q01", lambda t: t[None].clone()), "q01 must be one vector, got"),
    (
        POST_STATS,
        _set(f"{ACTION}.q01", lambda t: torch.full_like(t, float("nan"))),
        "action.q01 holds non-finite values",
    ),
    (
        PRE_STATS,
        _set(f"{STATE}.q01", lambda t: t + 100.0),
        "observation.state.q01 lies above observation.state.q99 at dims [0, 1, 2, 3, 4, 5]",
    ),
]


@pytest.mark.parametrize("filename,edit,says", STATS_LIES, ids=[c[2][:40] for c in STATS_LIES])
def test_statistics_that_lie_are_refused_naming_the_file(folder, filename, edit, says):
    edit_stats(folder / filename, edit)
    processor = PRE if filename == PRE_STATS else POST
    refused(folder, says, processor if "non-finite" not in says else filename)


def test_a_negative_std_is_refused_under_mean_std(folder):
    mean_std = {"VISUAL": "IDENTITY", "STATE": "MEAN_STD", "ACTION": "MEAN_STD"}
    edit_json(folder / PRE, lambda p: put(step(p, NORMALIZER), ["config", "norm_map"], mean_std))
    edit_json(
        folder / POST,
        lambda p: put(step(p, "unnormalizer_processor"), ["config", "norm_map"], mean_std),
    )
    edit_stats(folder / POST_STATS, _set(f"{ACTION}.std", lambda t: -t))
    refused(folder, f"{folder / POST} unnormalizer_processor: action.std is negative")


def test_images_normalised_by_statistics_are_refused(folder):
    """pi0.5 here takes images in [0, 1] -> [-1, 1]; a folder normalising them with LeRobot's
    image statistics would see other pixels than it was trained on."""
    edit_json(
        folder / PRE,
        lambda p: put(step(p, NORMALIZER), ["config", "norm_map", "VISUAL"], "MEAN_STD"),
    )
    edit_stats(
        folder / PRE_STATS,
        lambda t: t.update(
            {f"{FRONT}.mean": torch.zeros(3, 1, 1), f"{FRONT}.std": torch.ones(3, 1, 1)}
        ),
    )
    refused(folder, f"{folder / PRE} normalizer_processor", f"{FRONT} is normalised with MEAN_STD")


def test_image_statistics_under_identity_are_ignored(made, tmp_path):
    folder = Path(shutil.copytree(made, tmp_path / "lerobot"))
    edit_stats(folder / PRE_STATS, lambda t: t.update({f"{FRONT}.mean": torch.zeros(3, 1, 1)}))
    assert load_checkpoint(folder).lerobot.state_norm.mode == "QUANTILES"


def test_weights_named_but_absent_are_refused(made, tmp_path):
    folder = Path(shutil.copytree(made, tmp_path / "lerobot"))
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="weights file not found.*model.safe"):
        load_checkpoint(folder)


def test_a_state_exactly_max_state_dim_wide_loads_and_pads_to_it(made, tmp_path):
    folder = Path(shutil.copytree(made, tmp_path / "lerobot"))
    edit_json(folder / CONFIG, lambda c: c.update(max_state_dim=6))
    spec = load_checkpoint(folder).lerobot
    assert spec.max_state_dim == 6 and spec.conventions.prompt_state_dim == 6
    normalized = spec.state_norm.normalize(np.zeros(6, dtype=np.float32))
    assert normalized.shape == (6,)
