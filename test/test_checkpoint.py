"""Checkpoints: openpi's layout and names, validation before loading, precision policy, tools."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from oxygen_ros.checkpoints.core import (
    IGNORED_FILE_KEYS,
    CheckpointError,
    apply_openpi_precision,
    build_model,
    expected_file_tensors,
    find_tensor_problems,
    infer_config,
    init_random_weights,
)
from oxygen_ros.checkpoints.loader import load_checkpoint
from oxygen_ros.checkpoints.openpi import save_checkpoint
from oxygen_ros.engine import OxygenEngine
from oxygen_ros.engine.types import Observation
from oxygen_ros.model.config import get_preset
from oxygen_ros.model.pi05 import Pi05Model
from oxygen_ros.policy_io.policy import load_policy
from oxygen_ros.tools import make_checkpoint as make_checkpoint_tool
from oxygen_ros.tools import model_info
from oxygen_ros.tools.make_checkpoint import make_checkpoint

TINY = get_preset("tiny")
WEIGHTS = "model.safetensors"
EMBED = "paligemma_with_expert.paligemma.model.language_model.embed_tokens.weight"
LM_HEAD = "paligemma_with_expert.paligemma.lm_head.weight"


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=3)


@pytest.fixture
def ckpt(tiny_ckpt, tmp_path) -> Path:
    """A private copy of the tiny checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_ckpt, tmp_path / "ckpt"))


def rewrite_weights(ckpt: Path, edit) -> None:
    tensors = load_file(str(ckpt / WEIGHTS))
    edit(tensors)
    save_file(tensors, str(ckpt / WEIGHTS))


def reference_tiny(seed: int = 3) -> Pi05Model:
    return init_random_weights(build_model(TINY), seed)


# -- round trip -------------------------------------------------------------------------------


def test_round_trip_gives_identical_state(tiny_ckpt):
    loaded = load_checkpoint(tiny_ckpt)
    expected = reference_tiny().state_dict()
    got = loaded.model.state_dict()
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key].dtype == torch.float32
        assert torch.equal(got[key], value), key
    assert loaded.config == TINY and loaded.asset_id == "robot"
    assert loaded.tokenizer_path == tiny_ckpt / "tokenizer.model"
    assert (
        set(loaded.norm_stats) == {"state", "actions"}
        and loaded.norm_stats["actions"].dim == TINY.action_dim
    )
    assert not loaded.model.training and not any(p.requires_grad for p in loaded.model.parameters())


def test_file_uses_openpi_names(tiny_ckpt):
    tensors = load_file(str(tiny_ckpt / WEIGHTS))
    assert LM_HEAD in tensors and EMBED not in tensors
    assert torch.equal(tensors[LM_HEAD], reference_tiny().state_dict()[EMBED])


def test_save_load_save_is_stable(tiny_ckpt, tmp_path):
    loaded = load_checkpoint(tiny_ckpt)
    save_checkpoint(loaded.model, tmp_path / "again", loaded.norm_stats, loaded.asset_id)
    first, second = (
        load_file(str(tiny_ckpt / WEIGHTS)),
        load_file(str(tmp_path / "again" / WEIGHTS)),
    )
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    assert (tmp_path / "again" / "oxygen_config.json").read_text() == (
        tiny_ckpt / "oxygen_config.json"
    ).read_text()


def test_unused_expert_lm_head_is_accepted_and_dropped(ckpt):
    rewrite_weights(
        ckpt,
        lambda t: t.update(
            {next(iter(IGNORED_FILE_KEYS)): torch.zeros(TINY.vocab_size, TINY.expert.width)}
        ),
    )
    loaded = load_checkpoint(ckpt)
    assert "paligemma_with_expert.gemma_expert.lm_head.weight" not in loaded.model.state_dict()


def test_config_is_inferred_from_shapes_without_oxygen_config(ckpt):
    (ckpt / "oxygen_config.json").unlink()
    assert load_checkpoint(ckpt).config == TINY


def test_explicit_config_wins(ckpt, caplog):
    config = TINY.__class__(**{**TINY.__dict__, "action_horizon": 4})
    loaded = load_checkpoint(ckpt, config=config)
    assert loaded.config.action_horizon == 4
    assert "holds a different one" in caplog.text


def test_loaded_model_runs_in_fp32_and_openpi_bf16(tiny_ckpt):
    """bf16 with openpi's mixed policy (fp32 norms, adaRMS, projections) must run and agree."""
    g = torch.Generator().manual_seed(0)
    images = torch.rand(1, 3, 3, 224, 224, generator=g) * 2 - 1
    tokens = torch.randint(0, TINY.vocab_size, (1, 8), generator=g)
    noise = torch.randn(1, TINY.action_horizon, TINY.action_dim, generator=g)
    actions = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load_checkpoint(tiny_ckpt, dtype=dtype).model
        prefix = model.prefill(
            images, torch.tensor([[True, False, True]]), tokens, torch.ones(1, 8, dtype=torch.bool)
        )
        actions[dtype] = model.sample_actions(prefix, noise, num_steps=2)
        assert actions[dtype].shape == noise.shape and torch.isfinite(actions[dtype]).all()
    torch.testing.assert_close(
        actions[torch.bfloat16], actions[torch.float32], atol=0.05, rtol=0.05
    )


# -- openpi's pi05 layout, built independently from openpi's naming rules ------------------------


def openpi_pi05_file_layout() -> dict:
    """Every tensor of openpi's pi0.5 model.safetensors, with its shape."""
    vocab, width, expert, vision, depth = 257152, 2048, 1024, 1152, 18
    heads, head_dim = 8, 256
    layout = {}
    vt = "paligemma_with_expert.paligemma.model.vision_tower.vision_model."
    layout[vt + "embeddings.patch_embedding.weight"] = (vision, 3, 14, 14)
    layout[vt + "embeddings.patch_embedding.bias"] = (vision,)
    layout[vt + "embeddings.position_embedding.weight"] = (256, vision)
    for i in range(27):
        p = f"{vt}encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            layout[f"{p}self_attn.{proj}.weight"] = (vision, vision)
            layout[f"{p}self_attn.{proj}.bias"] = (vision,)
        for norm in ("layer_norm1", "layer_norm2"):
            layout[f"{p}{norm}.weight"] = layout[f"{p}{norm}.bias"] = (vision,)
        layout[f"{p}mlp.fc1.weight"], layout[f"{p}mlp.fc1.bias"] = (4304, vision), (4304,)
        layout[f"{p}mlp.fc2.weight"], layout[f"{p}mlp.fc2.bias"] = (vision, 4304), (vision,)
    layout[vt + "post_layernorm.weight"] = layout[vt + "post_layernorm.bias"] = (vision,)
    mm = "paligemma_with_expert.paligemma.model.multi_modal_projector.linear."
    layout[mm + "weight"], layout[mm + "bias"] = (width, vision), (width,)
    layout[LM_HEAD] = (vocab, width)  # the tied token embedding, under the LM head's name

    def gemma_layers(prefix: str, w: int, mlp: int, adaptive: bool) -> None:
        for i in range(depth):
            p = f"{prefix}layers.{i}."
            layout[p + "self_attn.q_proj.weight"] = (heads * head_dim, w)
            layout[p + "self_attn.k_proj.weight"] = (head_dim, w)
            layout[p + "self_attn.v_proj.weight"] = (head_dim, w)
            layout[p + "self_attn.o_proj.weight"] = (w, heads * head_dim)
            layout[p + "mlp.gate_proj.weight"] = layout[p + "mlp.up_proj.weight"] = (mlp, w)
            layout[p + "mlp.down_proj.weight"] = (w, mlp)
            for norm in ("input_layernorm", "post_attention_layernorm"):
                if adaptive:
                    layout[f"{p}{norm}.dense.weight"], layout[f"{p}{norm}.dense.bias"] = (
                        (3 * w, w),
                        (3 * w,),
                    )
                else:
                    layout[f"{p}{norm}.weight"] = (w,)
        if adaptive:
            layout[prefix + "norm.dense.weight"], layout[prefix + "norm.dense.bias"] = (
                (3 * w, w),
                (3 * w,),
            )
        else:
            layout[prefix + "norm.weight"] = (w,)

    gemma_layers(
        "paligemma_with_expert.paligemma.model.language_model.", width, 16384, adaptive=False
    )
    gemma_layers("paligemma_with_expert.gemma_expert.model.", expert, 4096, adaptive=True)
    layout["paligemma_with_expert.gemma_expert.lm_head.weight"] = (vocab, expert)
    for name, shape in {
        "action_in_proj": (expert, 32),
        "action_out_proj": (32, expert),
        "time_mlp_in": (expert, expert),
        "time_mlp_out": (expert, expert),
    }.items():
        layout[name + ".weight"], layout[name + ".bias"] = shape, (shape[0],)
    return layout


def test_pi05_matches_openpi_layout():
    layout = openpi_pi05_file_layout()
    counts = {
        "vision_tower": 3 + 27 * 16 + 2,
        "multi_modal_projector": 2,
        "lm_head": 2,  # paligemma's (the embedding) and the expert's unused one
        "language_model": 18 * 9 + 1,
        "gemma_expert.model": 18 * 11 + 2,
    }
    for part, n in counts.items():
        assert sum(f".{part}." in k for k in layout) == n, part
    assert len(layout) == 812
    # 3.617B parameters in openpi's file, about 3.35B of them used by pi0.5.
    assert sum(int(np.prod(s)) for s in layout.values()) == 3_616_757_520

    with torch.device("meta"):
        model = Pi05Model(get_preset("pi05"))
    expected = expected_file_tensors(model)
    assert expected == {k: v for k, v in layout.items() if k not in IGNORED_FILE_KEYS}
    header = {k: ("F32", shape) for k, shape in layout.items()}
    assert find_tensor_problems(header, expected) == []
    assert infer_config(header).name == "pi05"


def test_bf16_policy_on_pi05_follows_openpi():
    with torch.device("meta"):
        model = Pi05Model(get_preset("pi05"))
    apply_openpi_precision(model, torch.bfloat16)
    fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    bf16 = {n for n, p in model.named_parameters() if p.dtype == torch.bfloat16}
    assert len(fp32) + len(bf16) == len(list(model.parameters()))
    vt = "paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings."
    kept = {
        vt + "patch_embedding.weight",
        vt + "patch_embedding.bias",
        vt + "position_embedding.weight",
    }
    kept |= {n for n in fp32 if "layernorm" in n and "vision" not in n}
    kept |= {"paligemma_with_expert.paligemma.model.language_model.norm.weight"}
    kept |= {f"paligemma_with_expert.gemma_expert.model.norm.dense.{s}" for s in ("weight", "bias")}
    kept |= {
        f"{m}.{s}"
        for m in ("action_in_proj", "action_out_proj", "time_mlp_in", "time_mlp_out")
        for s in ("weight", "bias")
    }
    assert fp32 == kept
    # backbone w + expert dense w/b
    assert sum("layernorm" in n and "vision" not in n for n in fp32) == 2 * 18 + 4 * 18
    assert EMBED in bf16 and not any("vision_model.encoder" in n for n in fp32)


def test_bf16_load_keeps_openpi_fp32_params(tiny_ckpt):
    loaded = load_checkpoint(tiny_ckpt, dtype="bfloat16")
    reference = reference_tiny().state_dict()
    for name, param in loaded.model.named_parameters():
        keep = not name.startswith("paligemma_with_expert.") or any(
            s in name
            for s in (
                "patch_embedding",
                "position_embedding",
                "input_layernorm",
                "post_attention_layernorm",
                "model.norm",
            )
        )
        assert param.dtype == (torch.float32 if keep else torch.bfloat16), name
        assert torch.equal(param, reference[name].to(param.dtype)), name


# -- errors -----------------------------------------------------------------------------------


def test_missing_directory_and_file(ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint directory not found"):
        load_checkpoint(tmp_path / "nowhere")
    (ckpt / WEIGHTS).unlink()
    with pytest.raises(CheckpointError, match="weights file not found"):
        load_checkpoint(ckpt)


def test_missing_key(ckpt):
    rewrite_weights(ckpt, lambda t: t.pop("time_mlp_in.bias"))
    with pytest.raises(CheckpointError, match=r"1 missing tensors:\n  time_mlp_in.bias"):
        load_checkpoint(ckpt)


def test_unexpected_key(ckpt):
    rewrite_weights(ckpt, lambda t: t.update({"state_proj.weight": torch.zeros(32, 32)}))
    with pytest.raises(CheckpointError, match=r"1 unexpected tensors:\n  state_proj.weight"):
        load_checkpoint(ckpt)


def test_wrong_shape(ckpt):
    rewrite_weights(
        ckpt, lambda t: t.update({"action_out_proj.weight": torch.zeros(32, TINY.expert.width)})
    )
    with pytest.raises(
        CheckpointError, match=r"action_out_proj.weight: file \[32, 32\], model \[8, 32\]"
    ):
        load_checkpoint(ckpt)


def test_non_float_dtype(ckpt):
    rewrite_weights(
        ckpt,
        lambda t: t.update({"time_mlp_in.bias": torch.zeros(TINY.expert.width, dtype=torch.int64)}),
    )
    with pytest.raises(CheckpointError, match=r"non-float dtypes:\n  time_mlp_in.bias: I64"):
        load_checkpoint(ckpt)


def test_all_problems_in_one_error_with_capped_lists(ckpt):
    def edit(t):
        for key in [k for k in t if ".encoder.layers.0." in k]:
            del t[key]  # 16 missing
        for i in range(25):
            t[f"extra.{i:02d}"] = torch.zeros(1)  # 25 unexpected: listed up to 20
        t["time_mlp_out.weight"] = torch.zeros(3, 3)

    rewrite_weights(ckpt, edit)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt)
    message = str(info.value)
    assert (
        "16 missing tensors" in message
        and "25 unexpected tensors" in message
        and "1 wrong shapes" in message
    )
    assert "extra.19" in message and "extra.20" not in message and "... and 5 more" in message


@pytest.mark.parametrize("cut", [100, 5])
def test_truncated_file(ckpt, cut):
    data = (ckpt / WEIGHTS).read_bytes()
    (ckpt / WEIGHTS).write_bytes(data[: len(data) - cut] if cut > 50 else data[:cut])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(ckpt)


def test_garbage_file(ckpt):
    (ckpt / WEIGHTS).write_bytes(b"\xff" * 8 + b"not a header" * 10)
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_checkpoint(ckpt)


def test_no_config_and_no_matching_preset(ckpt):
    (ckpt / "oxygen_config.json").unlink()
    rewrite_weights(ckpt, lambda t: t.pop("time_mlp_in.bias"))
    with pytest.raises(
        CheckpointError, match="match no preset; pass config=. Closest preset 'tiny'"
    ):
        load_checkpoint(ckpt)


def test_bad_oxygen_config(ckpt):
    (ckpt / "oxygen_config.json").write_text(json.dumps({"format_version": 1, "name": "x"}))
    with pytest.raises(CheckpointError, match="oxygen_config.json"):
        load_checkpoint(ckpt)


def norm_stats_path(ckpt: Path) -> Path:
    return ckpt / "assets" / "robot" / "norm_stats.json"


def test_nan_in_norm_stats(ckpt):
    path = norm_stats_path(ckpt)
    path.write_text(path.read_text().replace(",", ", NaN,", 1))
    with pytest.raises(CheckpointError, match="NaN"):
        load_checkpoint(ckpt)


def test_inverted_quantiles_in_norm_stats(ckpt):
    path = norm_stats_path(ckpt)
    data = json.loads(path.read_text())
    data["norm_stats"]["state"]["q99"][2] = data["norm_stats"]["state"]["q01"][2] - 1
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"'state'.*q99 < q01 at indices \[2\]"):
        load_checkpoint(ckpt)


def test_norm_stats_wider_than_model(ckpt):
    path = norm_stats_path(ckpt)
    data = json.loads(path.read_text())
    data["norm_stats"]["actions"] = {k: v * 2 for k, v in data["norm_stats"]["actions"].items()}
    path.write_text(json.dumps(data))
    with pytest.raises(
        CheckpointError, match="actions stats have 16 dims but the model's action_dim is 8"
    ):
        load_checkpoint(ckpt)


def test_missing_or_ambiguous_assets(ckpt):
    shutil.copytree(ckpt / "assets" / "robot", ckpt / "assets" / "other")
    with pytest.raises(
        CheckpointError, match=r"several assets .*\['other', 'robot'\]; pass asset_id="
    ):
        load_checkpoint(ckpt)
    assert load_checkpoint(ckpt, asset_id="other").asset_id == "other"
    shutil.rmtree(ckpt / "assets")
    with pytest.raises(CheckpointError, match="no norm stats"):
        load_checkpoint(ckpt)


# -- random init ------------------------------------------------------------------------------


def test_init_is_deterministic_and_keeps_every_path_on():
    a, b = reference_tiny(seed=1).state_dict(), reference_tiny(seed=1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a[EMBED], reference_tiny(seed=2).state_dict()[EMBED])
    width = TINY.expert.width
    gate = a["paligemma_with_expert.gemma_expert.model.layers.0.input_layernorm.dense.bias"][
        2 * width :
    ]
    scale_shift = a["paligemma_with_expert.gemma_expert.model.layers.0.input_layernorm.dense.bias"][
        : 2 * width
    ]
    assert (gate - 1).abs().max() < 0.2 and scale_shift.abs().max() < 0.2
    ln = a["paligemma_with_expert.paligemma.model.vision_tower.vision_model.post_layernorm.weight"]
    assert (ln - 1).abs().max() < 0.2
    rms = a["paligemma_with_expert.paligemma.model.language_model.norm.weight"]
    assert rms.abs().max() < 0.2 and rms.abs().max() > 0  # applied as 1 + w


# -- tools ------------------------------------------------------------------------------------


def test_make_checkpoint_refuses_pi05_without_force(tmp_path):
    with pytest.raises(ValueError, match="13.4 GB.*force"):
        make_checkpoint(tmp_path / "big", "pi05")
    assert make_checkpoint_tool.main(["--preset", "pi05", "--out", str(tmp_path / "big")]) == 2
    assert not (tmp_path / "big").exists()


def test_make_checkpoint_cli_bf16_with_tokenizer_elsewhere(tmp_path, capsys):
    tok = tmp_path / "tok" / "t.model"
    rc = make_checkpoint_tool.main(
        [
            "--preset",
            "tiny",
            "--out",
            str(tmp_path / "c"),
            "--seed",
            "5",
            "--dtype",
            "bfloat16",
            "--tokenizer-out",
            str(tok),
        ]
    )
    assert rc == 0 and "wrote tiny checkpoint" in capsys.readouterr().out
    assert tok.is_file() and not (tmp_path / "c" / "tokenizer.model").exists()
    tensors = load_file(str(tmp_path / "c" / WEIGHTS))
    assert (
        tensors[LM_HEAD].dtype == torch.bfloat16
        and tensors["action_in_proj.weight"].dtype == torch.float32
    )


def test_model_info_pi05_counts(capsys):
    info = model_info.model_info(get_preset("pi05"))
    params = info["parameters"]
    assert params["total"] == 3_353_433_872 == sum(v for k, v in params.items() if k != "total")
    assert info["openpi_file_parameters"] == 3_616_757_520
    assert params["backbone_embeddings"] == 257152 * 2048
    assert info["kv_bytes_per_token"]["bfloat16"] == 2 * 18 * 1 * 256 * 2
    assert info["prefix_tokens"] == {"1": 456, "2": 712, "3": 968}
    assert model_info.main(["--preset", "tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"]["total"] == sum(
        p.numel() for p in Pi05Model(TINY).parameters()
    )


# -- config resolution: the horizon tensor shapes do not fix
# ------------------------------------------


def test_without_any_config_file_the_preset_horizon_is_used(ckpt, caplog):
    (ckpt / "oxygen_config.json").unlink()
    with caplog.at_level("INFO", logger="oxygen_ros.checkpoints.openpi"):
        loaded = load_checkpoint(ckpt)
    assert loaded.config == TINY  # tiny preset: horizon 10, max_token_len 96
    assert "action_horizon 10 from the preset" in loaded.config_source
    assert loaded.config_source in caplog.text


def test_openpi_config_json_sets_horizon_and_token_length(ckpt):
    (ckpt / "oxygen_config.json").unlink()
    (ckpt / "config.json").write_text(
        json.dumps({"action_dim": 8, "action_horizon": 12, "max_token_len": 64})
    )
    loaded = load_checkpoint(ckpt, robot_horizon=15)  # config.json wins over the robot
    assert (loaded.config.action_horizon, loaded.config.max_token_len) == (12, 64)
    assert loaded.config.vision == TINY.vision and loaded.config.backbone == TINY.backbone
    assert "action_horizon 12 from openpi's config.json" in loaded.config_source
    assert "max_token_len 64 from openpi's config.json" in loaded.config_source


def test_oxygen_config_wins_over_openpi_config_json(ckpt):
    (ckpt / "config.json").write_text(json.dumps({"action_horizon": 12}))
    loaded = load_checkpoint(ckpt, robot_horizon=15)
    assert loaded.config == TINY and loaded.config_source == "from oxygen_config.json"


def test_a_robot_decides_the_horizon_when_no_file_does(ckpt):
    (ckpt / "oxygen_config.json").unlink()
    policy = load_policy(ckpt, robot="droid")  # DROID fine-tunes are trained with 15 steps
    assert policy.config.action_horizon == 15 and policy.config.max_token_len == TINY.max_token_len
    engine = OxygenEngine(policy)
    image = np.zeros((224, 224, 3), dtype=np.uint8)
    chunk = engine.act(Observation({"base_0_rgb": image}, np.zeros(8), "pick up the cup"))
    engine.close()
    assert chunk.actions.shape == (15, 8)  # the model denoised 15 action tokens


@pytest.mark.parametrize(
    "written, message",
    [
        ("{not json", "not readable JSON"),
        ("[15]", "must hold a JSON object"),
        ('{"action_horizon": 0}', "action_horizon must be a positive integer, got 0"),
        ('{"max_token_len": "200"}', "max_token_len must be a positive integer, got '200'"),
    ],
)
def test_a_bad_openpi_config_json_is_a_clear_error(ckpt, written, message):
    (ckpt / "oxygen_config.json").unlink()
    (ckpt / "config.json").write_text(written)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(ckpt)
