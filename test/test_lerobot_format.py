"""LeRobot pi05 folders: detection, tensor names, statistics, what is refused; nested openpi assets.

Every folder here is written by the test in LeRobot's layout (real safetensors and JSON) from one
random-weight tiny model, next to the same weights in openpi's layout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from oxygen_ros.checkpoints.core import CheckpointError, build_model, init_random_weights
from oxygen_ros.checkpoints.lerobot import openpi_key
from oxygen_ros.checkpoints.lerobot_writer import lerobot_stats, write_lerobot_folder
from oxygen_ros.checkpoints.loader import detect_format, load_checkpoint
from oxygen_ros.checkpoints.norm_stats import NormStats
from oxygen_ros.checkpoints.openpi import save_checkpoint
from oxygen_ros.model.config import get_preset
from oxygen_ros.tools.make_checkpoint import synthetic_norm_stats

TINY = get_preset("tiny")
STATE_DIM, ACTION_DIM = 8, 7
CAMERAS = ("observation.images.base_0_rgb", "observation.images.wrist")


def tiny_model(seed: int = 5):
    return init_random_weights(build_model(TINY), seed)


def dataset_stats(seed: int = 1) -> dict[str, dict[str, np.ndarray]]:
    stats = synthetic_norm_stats(STATE_DIM, seed)
    action = lerobot_stats(stats["actions"])
    return {
        "observation.state": lerobot_stats(stats["state"]),
        "action": {k: v[:ACTION_DIM] for k, v in action.items()},
        # image stats are in LeRobot's files too; VISUAL is IDENTITY, so they must be ignored
        "observation.images.base_0_rgb": {"mean": np.full((3, 1, 1), 0.5)},
    }


def write(path: Path, model=None, **kwargs) -> Path:
    kwargs.setdefault("cameras", CAMERAS)
    return write_lerobot_folder(
        path,
        model if model is not None else tiny_model(),
        dataset_stats(),
        state_dim=STATE_DIM,
        action_dim=ACTION_DIM,
        **kwargs,
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lerobot")
    model = tiny_model()
    return {
        "lerobot": write(root / "lerobot", model),
        "bare": write(root / "bare", model, prefixed=False, with_processors=False),
        "openpi": save_checkpoint(model, root / "openpi", synthetic_norm_stats(8, 1)),
    }


@pytest.fixture
def folder(folders, tmp_path) -> Path:
    """A private copy of the LeRobot folder that a test may damage."""
    return Path(shutil.copytree(folders["lerobot"], tmp_path / "lerobot"))


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def edit_weights(folder: Path, edit) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


# -- detection --------------------------------------------------------------------------------


def test_format_is_detected_from_the_files(folders):
    lerobot = detect_format(folders["lerobot"])
    assert lerobot.name == "lerobot"
    assert 'config.json "type": "pi05"' in lerobot.reason
    assert "policy_preprocessor.json" in lerobot.reason
    openpi = detect_format(folders["openpi"])
    assert openpi.name == "openpi" and "assets/robot/norm_stats.json" in openpi.reason
    assert detect_format(folders["bare"]).name == "lerobot"


def test_openpis_converter_config_json_has_no_type_and_stays_openpi(folders, tmp_path):
    folder = Path(shutil.copytree(folders["openpi"], tmp_path / "openpi"))
    (folder / "config.json").write_text(json.dumps({"action_horizon": 15, "max_token_len": 180}))
    assert detect_format(folder).name == "openpi"
    assert load_checkpoint(folder).format == "openpi"


@pytest.mark.parametrize("policy_type", ["pi0", "smolvla"])
def test_other_policy_types_are_refused_by_name(folder, policy_type):
    edit_json(folder / "config.json", lambda c: c.update(type=policy_type))
    with pytest.raises(CheckpointError, match=f"policy type '{policy_type}'.*only 'pi05'"):
        load_checkpoint(folder)


def test_a_folder_mixing_formats_is_refused_naming_both(folder, folders):
    shutil.copytree(folders["openpi"] / "assets", folder / "assets")
    with pytest.raises(CheckpointError, match=r"mixes checkpoint formats.*assets/robot/norm_stats"):
        load_checkpoint(folder)


def test_processor_files_without_a_lerobot_config_are_refused(folder):
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="LeRobot processor files.*no config.json"):
        load_checkpoint(folder)


# -- weights ----------------------------------------------------------------------------------


def test_lerobot_and_openpi_folders_load_bit_identical_parameters(folders):
    openpi = load_checkpoint(folders["openpi"]).model.state_dict()
    for name in ("lerobot", "bare"):
        loaded = load_checkpoint(folders[name])
        assert loaded.format == "lerobot"
        got = loaded.model.state_dict()
        assert got.keys() == openpi.keys()
        for key, value in openpi.items():
            assert torch.equal(got[key], value), (name, key)
    config = load_checkpoint(folders["lerobot"]).config
    assert (config.action_horizon, config.max_token_len, config.num_image_slots) == (10, 96, 2)
    assert config.action_dim == TINY.action_dim  # max_action_dim from the tensor shapes


def test_tensor_names_strip_exactly_one_model_prefix():
    inner = "paligemma_with_expert.paligemma.model.language_model.norm.weight"
    assert openpi_key("model." + inner) == inner
    assert openpi_key(inner) == inner
    assert openpi_key("model.model.x") == "model.x"
    assert openpi_key("model.action_time_mlp_in.weight") == "time_mlp_in.weight"
    assert openpi_key("action_time_mlp_out.bias") == "time_mlp_out.bias"
    assert openpi_key("model.state_proj.weight") is None
    assert (
        openpi_key("paligemma_with_expert.gemma_expert.model.layers.0.input_layernorm.weight")
        is None
    )


def test_renamed_time_mlp_dropped_state_proj_and_embed_tokens_name_load(folder, folders):
    def edit(t):
        for part in ("in", "out"):
            for kind in ("weight", "bias"):
                t[f"model.action_time_mlp_{part}.{kind}"] = t.pop(f"model.time_mlp_{part}.{kind}")
        t["model.state_proj.weight"] = torch.ones(TINY.expert.width, 32)
        # LeRobot main writes the tied embedding under embed_tokens
        t["model.paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"] = t.pop(
            "model.paligemma_with_expert.paligemma.lm_head.weight"
        )

    edit_weights(folder, edit)
    got = load_checkpoint(folder).model.state_dict()
    expected = load_checkpoint(folders["openpi"]).model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_max_action_dim_other_than_the_preset_comes_from_the_shapes(tmp_path):
    config = TINY.__class__(**{**TINY.__dict__, "action_dim": 16})
    model = init_random_weights(build_model(config), 2)
    loaded = load_checkpoint(write(tmp_path / "wide", model))
    assert loaded.config.action_dim == 16
    assert torch.equal(loaded.model.action_in_proj.weight, model.action_in_proj.weight)


def test_unknown_tensor_is_a_clear_error(folder):
    edit_weights(folder, lambda t: t.update({"model.mystery_head.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensors:\n  mystery_head.weight"):
        load_checkpoint(folder)


def test_shape_mismatch_is_a_clear_error(folder):
    key = "model.paligemma_with_expert.paligemma.model.language_model.norm.weight"
    edit_weights(folder, lambda t: t.update({key: torch.zeros(3)}))
    with pytest.raises(
        CheckpointError, match=r"language_model.norm.weight: file \[3\], model \[64\]"
    ):
        load_checkpoint(folder)


def test_mem_tensors_are_refused(folder):
    edit_weights(folder, lambda t: t.update({"model.proprio_history_proj.weight": torch.zeros(2)}))
    with pytest.raises(CheckpointError, match="proprio_history_proj.*MEM"):
        load_checkpoint(folder)


def test_mem_config_is_refused(folder):
    edit_json(folder / "config.json", lambda c: c.update(use_proprioceptive_memory=True))
    with pytest.raises(CheckpointError, match="use_proprioceptive_memory.*MEM"):
        load_checkpoint(folder)


# -- statistics -------------------------------------------------------------------------------


def test_stats_are_read_from_the_steps_state_file_not_a_fixed_index(folder):
    # move the normalizer's statistics to another file name: only the JSON says where they are
    pre = folder / "policy_preprocessor.json"
    (folder / "policy_preprocessor_step_2_normalizer_processor.safetensors").rename(
        folder / "moved_stats.safetensors"
    )

    def point(c):
        step = next(s for s in c["steps"] if s["registry_name"] == "normalizer_processor")
        step["state_file"] = "moved_stats.safetensors"
        c["steps"].insert(0, {"registry_name": "to_batch_processor", "config": {}})

    edit_json(pre, point)
    loaded = load_checkpoint(folder)
    state = loaded.norm_stats["state"]
    assert state.mode == "QUANTILES" and state.dim == STATE_DIM
    np.testing.assert_array_equal(
        state.stats["q01"], dataset_stats()["observation.state"]["q01"].astype(np.float32)
    )


def test_a_state_the_normalizer_step_does_not_list_passes_through(folder):
    def drop(c):
        step = next(s for s in c["steps"] if s["registry_name"] == "normalizer_processor")
        step["config"]["normalize_observation_keys"] = ["observation.images.base_0_rgb"]

    edit_json(folder / "policy_preprocessor.json", drop)
    loaded = load_checkpoint(folder)
    assert loaded.norm_stats["state"].passthrough
    assert loaded.norm_stats["actions"].mode == "QUANTILES"


def test_a_missing_stats_file_is_a_clear_error(folder):
    (folder / "policy_postprocessor_step_0_unnormalizer_processor.safetensors").unlink()
    with pytest.raises(CheckpointError, match="policy_postprocessor.json.*statistics file.*not in"):
        load_checkpoint(folder)


def test_no_processors_means_state_and_actions_pass_through(folders):
    loaded = load_checkpoint(folders["bare"])
    state = loaded.norm_stats["state"]
    x = np.array([0.25, -3.0, 7.0], dtype=np.float32)
    assert state.passthrough and (state.normalize(x) == x).all()
    assert (loaded.norm_stats["actions"].unnormalize(x) == x).all()


def test_images_are_identity_and_their_stats_ignored(folders):
    notes = " ".join(load_checkpoint(folders["lerobot"]).lerobot.notes)
    assert "observation.state: QUANTILES (eps 1e-08) over 8 dims" in notes
    assert "action: QUANTILES (eps 1e-08) over 7 dims" in notes


# -- openpi norm stats one folder deeper (issue 18) -------------------------------------------


def test_nested_openpi_asset_ids_are_found(tmp_path):
    model = tiny_model()
    stats = synthetic_norm_stats(8, 4)
    ckpt = save_checkpoint(
        model, tmp_path / "libero", stats, asset_id="physical-intelligence/libero"
    )
    assert (ckpt / "assets/physical-intelligence/libero/norm_stats.json").is_file()
    loaded = load_checkpoint(ckpt)
    assert loaded.asset_id == "physical-intelligence/libero"
    assert (loaded.norm_stats["state"].q99 == stats["state"].q99).all()


def test_among_several_assets_the_robots_id_is_picked(tmp_path):
    ckpt = save_checkpoint(tiny_model(), tmp_path / "two", synthetic_norm_stats(8, 4), "droid")
    other = NormStats(**{f: np.zeros(8) for f in ("mean", "std", "q01")}, q99=np.ones(8))
    save_checkpoint(tiny_model(), ckpt, {"state": other, "actions": other}, "org/other")
    with pytest.raises(CheckpointError, match=r"several assets.*\['droid', 'org/other'\]"):
        load_checkpoint(ckpt)
    assert load_checkpoint(ckpt, preferred_asset_id="org/other").asset_id == "org/other"
    assert load_checkpoint(ckpt, preferred_asset_id="droid").asset_id == "droid"


@pytest.mark.parametrize("bad", ["../x", "/abs", "a//b", "a/./b", ""])
def test_asset_ids_stay_below_assets(tmp_path, bad):
    with pytest.raises(ValueError, match="asset_id must be a relative path"):
        save_checkpoint(tiny_model(), tmp_path / "x", synthetic_norm_stats(8, 0), bad)


# -- oxygen-model-info ------------------------------------------------------------------------


def test_model_info_says_which_format_and_why(folders, tiny_checkpoint, tmp_path, capsys):
    from oxygen_ros.tools import model_info

    folder = Path(shutil.copytree(folders["lerobot"], tmp_path / "lr"))
    shutil.copy(tiny_checkpoint / "tokenizer.model", folder / "tokenizer.model")
    assert model_info.main(["--checkpoint", str(folder)]) == 0
    out = capsys.readouterr().out
    assert 'OK    format: LeRobot pi05 folder: config.json "type": "pi05"' in out
    assert "QUANTILES (eps 1e-08)" in out and "LeRobot 0.4 conventions" in out
    assert "6 of 6 checks passed" in out
    edit_json(folder / "config.json", lambda c: c.update(type="pi0"))
    assert model_info.main(["--checkpoint", str(folder)]) == 1
    assert "FAIL  format:" in capsys.readouterr().out
