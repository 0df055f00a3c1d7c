"""``oxygen-model-info --checkpoint DIR``: checks of a checkpoint directory without its weights.

The tiny random checkpoint passes every check; copies broken on purpose (a renamed tensor, a wrong
shape, missing or too wide norm stats, a nested asset directory, a missing or too large tokenizer)
fail exactly the check concerned, with the reason, and make the command exit 1.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from oxygen_ros.tools import model_info
from oxygen_ros.tools.model_info import check_checkpoint

CHECK_NAMES = ["format", "weights", "config", "tensors", "norm stats", "tokenizer"]
# tiny preset (model/config.py): action_dim 8, vocabulary 512.
TINY_ACTION_DIM = 8
TINY_VOCAB = 512


@pytest.fixture
def broken(tiny_checkpoint, tmp_path):
    """A fresh copy of the tiny checkpoint, to break."""
    return shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")


def _by_name(checks):
    assert [c.name for c in checks] == CHECK_NAMES
    return {c.name: c for c in checks}


def _failed(checks):
    return sorted(c.name for c in checks if not c.ok)


def _rewrite_weights(ckpt, change):
    tensors = load_file(str(ckpt / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})


def test_the_tiny_checkpoint_passes_every_check(tiny_checkpoint, capsys):
    checks = _by_name(check_checkpoint(tiny_checkpoint))
    assert _failed(checks.values()) == []
    assert "preset 'tiny' (from oxygen_config.json)" in checks["config"].detail
    assert (
        f"state {TINY_ACTION_DIM} dims, actions {TINY_ACTION_DIM} dims"
        in checks["norm stats"].detail
    )
    assert f"{TINY_VOCAB} pieces = model vocabulary {TINY_VOCAB}" in checks["tokenizer"].detail

    assert model_info.main(["--checkpoint", str(tiny_checkpoint)]) == 0
    out = capsys.readouterr().out
    assert out.count("\nOK    ") == 6 and "FAIL" not in out
    assert "6 of 6 checks passed" in out


def test_without_its_config_file_the_tensor_shapes_pick_the_preset(broken):
    (broken / "oxygen_config.json").unlink()
    checks = _by_name(check_checkpoint(broken))
    assert _failed(checks.values()) == []
    assert (
        "preset 'tiny' (no oxygen_config.json: the tensor shapes match it; action_horizon 10 from "
        "the preset)" in checks["config"].detail
    )


def test_openpi_config_json_decides_the_horizon_the_loader_uses(broken):
    (broken / "oxygen_config.json").unlink()
    (broken / "config.json").write_text(json.dumps({"action_dim": 32, "action_horizon": 15}))
    detail = _by_name(check_checkpoint(broken))["config"].detail
    # the preset's 10 replaced
    assert "preset 'tiny' with action_horizon 15, max_token_len 96" in detail
    assert "action_horizon 15 from openpi's config.json" in detail


def test_a_renamed_tensor_fails_the_tensor_check_naming_both_names(broken):
    old = "action_out_proj.bias"
    new = "action_out_proj.bias_renamed"
    _rewrite_weights(broken, lambda t: t.__setitem__(new, t.pop(old)))
    checks = _by_name(check_checkpoint(broken))
    assert _failed(checks.values()) == ["tensors"]
    detail = checks["tensors"].detail
    assert f"1 missing tensors:\n  {old}" in detail
    assert f"1 unexpected tensors:\n  {new}" in detail


def test_a_renamed_tensor_without_config_file_matches_no_preset(broken):
    (broken / "oxygen_config.json").unlink()
    _rewrite_weights(broken, lambda t: t.__setitem__("renamed", t.pop("action_out_proj.bias")))
    checks = _by_name(check_checkpoint(broken))
    # Without a config the tensors are not compared, and the dimension checks say so.
    assert _failed(checks.values()) == ["config", "tensors"]
    assert "match no preset" in checks["config"].detail
    assert "Closest preset 'tiny'" in checks["config"].detail
    assert checks["tensors"].detail.startswith("not compared")
    assert "model unknown: not compared" in checks["norm stats"].detail


def test_a_wrong_shape_fails_with_file_and_model_shapes(broken):
    # tiny: action_out_proj maps the expert width 32 to action_dim 8, so its bias has 8 values.
    import torch

    _rewrite_weights(broken, lambda t: t.__setitem__("action_out_proj.bias", torch.zeros(9)))
    checks = _by_name(check_checkpoint(broken))
    assert _failed(checks.values()) == ["tensors"]
    assert "action_out_proj.bias: file [9], model [8]" in checks["tensors"].detail


def test_missing_norm_stats_fail(broken):
    (broken / "assets" / "robot" / "norm_stats.json").unlink()
    checks = _by_name(check_checkpoint(broken))
    assert _failed(checks.values()) == ["norm stats"]
    assert "no norm stats in" in checks["norm stats"].detail


def test_norm_stats_wider_than_the_model_fail(broken):
    path = broken / "assets" / "robot" / "norm_stats.json"
    data = json.loads(path.read_text())
    for field in ("mean", "std", "q01", "q99"):
        data["norm_stats"]["state"][field] = data["norm_stats"]["state"][field] + [0.5]
    path.write_text(json.dumps(data))
    detail = _by_name(check_checkpoint(broken))["norm stats"].detail
    wider = TINY_ACTION_DIM + 1
    assert (
        f"state stats have {wider} dims but the model's action_dim is {TINY_ACTION_DIM}" in detail
    )


def test_nested_asset_directory_is_found(broken):
    # openpi's LIBERO asset id is "physical-intelligence/libero": two directory levels.
    nested = broken / "assets" / "physical-intelligence" / "libero"
    nested.mkdir(parents=True)
    shutil.move(
        str(broken / "assets" / "robot" / "norm_stats.json"), str(nested / "norm_stats.json")
    )
    check = _by_name(check_checkpoint(broken))["norm stats"]
    assert check.ok and check.detail.startswith("assets/physical-intelligence/libero: state 8")


def test_missing_tokenizer_fails_and_an_explicit_one_is_checked(broken, tiny_checkpoint, tmp_path):
    from oxygen_ros.tools.tiny_tokenizer import train_tiny_tokenizer

    (broken / "tokenizer.model").unlink()
    checks = _by_name(check_checkpoint(broken))
    assert _failed(checks.values()) == ["tokenizer"]
    assert "no tokenizer.model in" in checks["tokenizer"].detail
    assert "--tokenizer" in checks["tokenizer"].detail

    given = _by_name(check_checkpoint(broken, tokenizer=tiny_checkpoint / "tokenizer.model"))
    assert given["tokenizer"].ok

    too_large = train_tiny_tokenizer(tmp_path / "600.model", vocab_size=600)
    large = _by_name(check_checkpoint(broken, tokenizer=too_large))["tokenizer"]
    assert not large.ok
    assert f"600 pieces but the model's vocabulary has {TINY_VOCAB} ids" in large.detail


def test_a_missing_directory_is_one_failed_check(tmp_path):
    checks = check_checkpoint(tmp_path / "nowhere")
    assert [(c.name, c.ok) for c in checks] == [("directory", False)]


def test_cli_exits_1_and_prints_fail_with_the_reason(broken):
    (broken / "tokenizer.model").unlink()
    done = subprocess.run(
        [sys.executable, "-m", "oxygen_ros.tools.model_info", "--checkpoint", str(broken)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "FAIL  tokenizer: no tokenizer.model in" in done.stdout
    assert "5 of 6 checks passed; failed: tokenizer" in done.stdout


def test_cli_json_lists_every_check(tiny_checkpoint, capsys):
    assert model_info.main(["--checkpoint", str(tiny_checkpoint), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(c["name"], c["ok"]) for c in data] == [(name, True) for name in CHECK_NAMES]


def test_cli_needs_a_preset_or_a_checkpoint(capsys):
    with pytest.raises(SystemExit) as exc:
        model_info.main([])
    assert exc.value.code == 2
    assert "give --preset NAME or --checkpoint DIR" in capsys.readouterr().err
