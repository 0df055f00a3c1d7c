"""LeRobot's input and output conventions, each difference from openpi asserted on its own against a
hand-computed example: normaliser epsilons, the state in the prompt, image borders, resampling,
flow times; plus cameras, relative actions, the Hugging Face tokenizer folder, and the same
actions from the same weights, inputs, times and noise in both layouts.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from oxygen_ros.checkpoints.conventions import OPENPI_CONVENTIONS, lerobot_conventions
from oxygen_ros.checkpoints.core import build_model, init_random_weights
from oxygen_ros.checkpoints.lerobot import FeatureNorm
from oxygen_ros.checkpoints.lerobot_writer import lerobot_stats, write_lerobot_folder
from oxygen_ros.checkpoints.loader import load_checkpoint
from oxygen_ros.checkpoints.norm_stats import NormStats
from oxygen_ros.checkpoints.openpi import save_checkpoint
from oxygen_ros.engine import EngineConfig, OxygenEngine
from oxygen_ros.engine.types import Observation
from oxygen_ros.model.config import get_preset
from oxygen_ros.model.pi05 import flow_schedule, lerobot_flow_schedule
from oxygen_ros.policy_io.policy import Pi05Policy, load_policy
from oxygen_ros.policy_io.robots import DELTA_POSITION
from oxygen_ros.policy_io.tokenizer import Pi05Tokenizer
from oxygen_ros.tools.make_checkpoint import synthetic_norm_stats

TINY = get_preset("tiny")
BASE, WRIST = "observation.images.base_0_rgb", "observation.images.wrist"
F32 = np.float32


def tiny_model(seed: int = 5):
    # LeRobot's tokenizer_max_length 200: room for 32 padded state bins in the prompt
    return init_random_weights(build_model(dataclasses.replace(TINY, max_token_len=200)), seed)


def unit_stats(dim: int) -> dict[str, np.ndarray]:
    """q01 = -1, q99 = 1: QUANTILES normalisation is then the identity up to float32 rounding."""
    return {
        "mean": np.zeros(dim),
        "std": np.ones(dim),
        "q01": -np.ones(dim),
        "q99": np.ones(dim),
        "min": -np.ones(dim),
        "max": np.ones(dim),
    }


def lerobot_folder(path: Path, tokenizer: Path, model=None, state_dim=4, action_dim=7, **kw):
    stats = kw.pop("stats", None) or {
        "observation.state": unit_stats(state_dim),
        "action": lerobot_stats(synthetic_norm_stats(action_dim, 2)["actions"]),
    }
    write_lerobot_folder(
        path,
        model if model is not None else tiny_model(),
        stats,
        cameras=kw.pop("cameras", (BASE, WRIST)),
        state_dim=state_dim,
        action_dim=action_dim,
        **kw,
    )
    shutil.copy(tokenizer, path / "tokenizer.model")
    return path


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    from oxygen_ros.tools.tiny_tokenizer import train_tiny_tokenizer

    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.model", 512)


@pytest.fixture(scope="module")
def v04(tmp_path_factory, tokenizer_file) -> Path:
    return lerobot_folder(tmp_path_factory.mktemp("v04") / "f", tokenizer_file)


@pytest.fixture(scope="module")
def main_folder(tmp_path_factory, tokenizer_file) -> Path:
    return lerobot_folder(tmp_path_factory.mktemp("main") / "f", tokenizer_file, version="main")


# -- normalisation: LeRobot's epsilons, not openpi's ------------------------------------------


def test_quantiles_divide_by_eps_only_where_the_range_is_zero():
    norm = FeatureNorm(
        "observation.state",
        "QUANTILES",
        1e-8,
        {"q01": np.array([0.0, 1.0], F32), "q99": np.array([2.0, 1.0], F32)},
        2,
    )
    y = norm.normalize(np.array([1.5, 1.0], F32))
    # by hand: 2 * (1.5 - 0) / 2 - 1 = 0.5 exactly; 2 * 0 / 1e-8 - 1 = -1
    assert y.dtype == F32 and y.tolist() == [0.5, -1.0]
    # openpi adds 1e-6 to every range: 1.5 / (2 + 1e-6) * 2 - 1 = 0.49999925
    openpi = NormStats(
        mean=np.zeros(2), std=np.ones(2), q01=np.array([0.0, 1.0]), q99=np.array([2.0, 1.0])
    ).normalize(np.array([1.5, 1.0]))
    assert openpi[0] == pytest.approx(0.49999925, abs=1e-9) and openpi[0] != y[0]
    # inverse by hand: (0.5 + 1) * 2 / 2 + 0 = 1.5; the zero range: (-1 + 1) * 1e-8 / 2 + 1 = 1
    assert norm.unnormalize(np.array([0.5, -1.0], F32)).tolist() == [1.5, 1.0]


def test_mean_std_adds_eps_to_std_one_way_only():
    norm = FeatureNorm(
        "action",
        "MEAN_STD",
        1e-8,
        {"mean": np.array([1.0, 0.0], F32), "std": np.array([0.5, 0.0], F32)},
        2,
    )
    y = norm.normalize(np.array([2.0, 3e-8], F32))
    # by hand: (2 - 1) / (0.5 + 1e-8) = 2 in float32 (1e-8 is below half an ulp of 0.5);
    # (3e-8 - 0) / (0 + 1e-8) = 3
    assert y[0] == 2.0 and y[1] == pytest.approx(3.0, rel=1e-6)
    # inverse by hand: y * std + mean
    assert norm.unnormalize(np.array([2.0, 5.0], F32)).tolist() == [2.0, 0.0]


def test_min_max_and_quantile10_round_trips():
    stats = {
        "min": np.array([-2.0, 0.0], F32),
        "max": np.array([2.0, 4.0], F32),
        "q10": np.array([-1.0, 1.0], F32),
        "q90": np.array([1.0, 3.0], F32),
    }
    x = np.array([1.0, 1.0], F32)
    min_max = FeatureNorm("s", "MIN_MAX", 1e-8, stats, 2)
    assert min_max.normalize(x).tolist() == [0.5, -0.5]  # 2 * (x - min) / (max - min) - 1
    q10 = FeatureNorm("s", "QUANTILE10", 1e-8, stats, 2)
    assert q10.normalize(x).tolist() == [1.0, -1.0]
    for norm in (min_max, q10):
        assert norm.unnormalize(norm.normalize(x)).tolist() == [1.0, 1.0]


def test_a_state_of_the_wrong_width_is_refused(v04):
    norm = FeatureNorm("observation.state", "QUANTILES", 1e-8, unit_stats_f32(3), 3)
    with pytest.raises(ValueError, match="expected at most width 3"):
        norm.normalize(np.zeros(4, F32))
    # the policy wants exactly the checkpoint's state width, as LeRobot does
    with pytest.raises(ValueError, match="the checkpoint's state has 4 dims, got 3"):
        load_policy(v04).prompt_tokens(np.zeros(3), "go")


def test_a_robot_may_drive_the_first_action_dims_only(v04):
    full, first = load_policy(v04), load_policy(v04, action_dim=5)
    y = np.random.default_rng(4).uniform(-1, 1, (TINY.action_horizon, TINY.action_dim))
    y = y.astype(F32)
    assert np.array_equal(
        first.robot_actions(y, np.zeros(4)), full.robot_actions(y, np.zeros(4))[:, :5]
    )
    with pytest.raises(ValueError, match="has 7 action dims, asked for 8"):
        load_policy(v04, action_dim=8)


def unit_stats_f32(dim):
    return {k: v.astype(F32) for k, v in unit_stats(dim).items() if k in ("q01", "q99")}


# -- the state in the prompt ------------------------------------------------------------------

# normalised values and their bins by hand: digitize(x, linspace(-1, 1, 257)[:-1]) - 1
STATE = np.array([0.0, 0.5, -1.0, 0.999])  # -> 128 192 0 255 (q01 = -1, q99 = 1)


def test_lerobot_04_pads_the_prompt_state_and_main_does_not(v04, main_folder, tokenizer_file):
    sp = Pi05Tokenizer(tokenizer_file)
    unpadded = "Task: pick up the cube, State: 128 192 0 255;\nAction: "
    padded = (
        "Task: pick up the cube, State: 128 192 0 255" + " 128" * 28 + ";\nAction: "
    )  # 0.4.x pads the normalised state with zeros to max_state_dim 32: bin 128
    expected = {
        v04: [sp.bos_id, *sp.encode_text(padded)],
        main_folder: [sp.bos_id, *sp.encode_text(unpadded)],
    }
    for folder, ids in expected.items():
        policy = load_policy(folder)
        tokens, mask = policy.prompt_tokens(STATE, "pick_up the cube\n")
        assert tokens[: mask.sum()].tolist() == ids
    assert len(expected[v04]) > len(expected[main_folder])


def test_prompt_state_dim_follows_max_state_dim(tmp_path, tokenizer_file):
    folder = lerobot_folder(tmp_path / "f", tokenizer_file, config_overrides={"max_state_dim": 6})
    policy = load_policy(folder)
    tokens, mask = policy.prompt_tokens(STATE, "go")
    text = policy.tokenizer.decode(tokens[: mask.sum()])
    assert text == "Task: go, State: 128 192 0 255 128 128;\nAction: "


# -- images: borders and resampling -----------------------------------------------------------


def with_conventions(policy: Pi05Policy, **changes) -> Pi05Policy:
    policy.conventions = dataclasses.replace(policy.conventions, **changes)
    return policy


def test_image_borders_04_end_at_minus_three_main_at_minus_one(v04, main_folder):
    image = np.full((2, 4, 3), 255, np.uint8)  # 2x4 -> 112x224 content, 56 rows of bars each side
    for folder, border in ((v04, -3.0), (main_folder, -1.0)):
        out = load_policy(folder).model_image(image)
        assert out.shape == (3, 224, 224) and out.dtype == F32
        assert (out[:, :56] == border).all() and (out[:, 168:] == border).all()
        # bilinear weights of a constant sum to 1 up to float32 rounding (thread-count dependent)
        np.testing.assert_allclose(out[:, 56:168], 1.0, rtol=0, atol=1e-6)


def test_resampling_is_float_bilinear_without_antialiasing(v04):
    # columns 255 where j % 4 in (1, 2): a 4x downscale without antialiasing samples exactly the
    # two middle columns of every group of four (source x = 4i + 1.5), so every pixel is 255 -> 1.0;
    # openpi's antialiased PIL filter averages over 8 columns, about half -> about 0.0
    row = np.where(np.arange(896) % 4 % 3 != 0, 255, 0).astype(np.uint8)
    assert row[:8].tolist() == [0, 255, 255, 0, 0, 255, 255, 0]
    image = np.broadcast_to(row[None, :, None], (896, 896, 3)).copy()
    policy = load_policy(v04)
    # 1.0 up to float32 rounding of the bilinear weights (as in the border test)
    np.testing.assert_allclose(policy.model_image(image), 1.0, rtol=0, atol=1e-6)
    openpi = with_conventions(load_policy(v04), resample=OPENPI_CONVENTIONS.resample)
    inner = openpi.model_image(image)[:, 4:-4, 4:-4]
    assert np.abs(inner).max() < 0.02


def test_224_images_are_identical_in_both_frameworks(v04):
    image = np.random.default_rng(0).integers(0, 256, (224, 224, 3), dtype=np.uint8)
    lerobot = load_policy(v04).model_image(image)
    openpi = with_conventions(load_policy(v04), resample=OPENPI_CONVENTIONS.resample)
    assert np.array_equal(lerobot, openpi.model_image(image))


def test_device_side_preprocessing_matches_the_host_path(v04, main_folder):
    rng = np.random.default_rng(1)
    for folder in (v04, main_folder):
        policy = load_policy(folder)
        for shape in ((240, 320), (300, 200), (224, 224)):
            image = rng.integers(0, 256, (*shape, 3), dtype=np.uint8)
            host = policy.model_image(image)
            device = policy.model_image_torch(torch.from_numpy(image)[None])[0].numpy()
            # the same float arithmetic here; a GPU stays within one uint8 level
            assert np.abs(host - device).max() <= 2 / 255 + 1e-6


def test_static_path_with_device_preprocessing_gives_the_host_paths_actions(v04):
    policy = load_policy(v04)
    rng = np.random.default_rng(2)
    observation = Observation(
        images={
            BASE: rng.integers(0, 256, (240, 320, 3), dtype=np.uint8),
            WRIST: rng.integers(0, 256, (300, 200, 3), dtype=np.uint8),
        },
        state=np.array([0.1, 0.2, -0.3, 0.4], F32),
        prompt="stack the cups",
    )
    chunks = {}
    for name, config in {
        "eager": EngineConfig(seed=1),
        "static": EngineConfig(seed=1, static_shapes=True),
        "static+device": EngineConfig(seed=1, static_shapes=True, gpu_preprocess=True),
    }.items():
        engine = OxygenEngine(policy, config)
        chunks[name] = engine.step(observation).action.actions
        engine.close()
    np.testing.assert_allclose(chunks["static"], chunks["eager"], atol=1e-5)
    assert np.array_equal(chunks["static+device"], chunks["static"])


# -- flow times -------------------------------------------------------------------------------


def test_lerobot_times_are_one_plus_step_dt_not_accumulated():
    lerobot = [t.item() for t in lerobot_flow_schedule(10)]
    openpi = [t.item() for t in flow_schedule(10)]
    assert len(lerobot) == len(openpi) == 10
    # by hand: float32(1 - 2/10) = 0.800000011920929; openpi's 1 - 0.1 - 0.1 in float32
    assert lerobot[2] == float(F32(0.8)) == pytest.approx(0.800000011920929, abs=1e-15)
    assert openpi[2] == pytest.approx(0.7999999523162842, abs=1e-15)
    assert lerobot[0] == openpi[0] == 1.0
    assert max(abs(a - b) for a, b in zip(lerobot, openpi, strict=True)) < 2e-7


def test_the_policy_sets_the_models_schedule(v04, tiny_checkpoint):
    assert load_policy(v04).model.flow_times == "lerobot"
    assert load_policy(tiny_checkpoint).model.flow_times == "openpi"


# -- the same weights in both layouts ----------------------------------------------------------


def test_same_weights_inputs_times_and_noise_give_bit_identical_actions(tmp_path, tokenizer_file):
    model = tiny_model(7)
    folder = lerobot_folder(tmp_path / "lerobot", tokenizer_file, model=model)
    openpi = save_checkpoint(model, tmp_path / "openpi", synthetic_norm_stats(8, 1))
    a = load_checkpoint(folder).model
    b = load_checkpoint(openpi).model
    gen = torch.Generator().manual_seed(0)
    images = torch.rand(1, 2, 3, 224, 224, generator=gen) * 2 - 1
    masks = torch.tensor([[True, True]])
    tokens = torch.randint(0, 512, (1, 20), generator=gen)
    token_masks = torch.ones(1, 20, dtype=torch.bool)
    noise = torch.randn(1, TINY.action_horizon, TINY.action_dim, generator=gen)
    times = torch.stack(lerobot_flow_schedule(10))
    dt = torch.tensor(-0.1)
    out = []
    for model in (a, b):
        prefix = model.prefill(images, masks, tokens, token_masks)
        out.append(model.denoise(prefix.context, prefix.num_valid, noise, times, dt))
    assert torch.equal(out[0], out[1])


def test_lerobot_actions_are_sliced_then_unnormalised_in_float32(v04):
    policy = load_policy(v04)
    y = np.random.default_rng(3).uniform(-1, 1, (TINY.action_horizon, TINY.action_dim))
    y = y.astype(F32)
    stats = lerobot_stats(synthetic_norm_stats(7, 2)["actions"])
    q01, q99 = stats["q01"].astype(F32), stats["q99"].astype(F32)
    expected = (y[:, :7] + F32(1.0)) * (q99 - q01) / F32(2.0) + q01  # LeRobot's inverse, by hand
    got = policy.robot_actions(y, np.zeros(4))
    assert got.shape == (TINY.action_horizon, 7) and np.array_equal(got, expected)
    assert policy.published_horizon == TINY.action_horizon and policy.num_steps == 10


# -- cameras --------------------------------------------------------------------------------


def test_cameras_follow_input_features_and_empty_cameras_are_masked(tmp_path, tokenizer_file):
    folder = lerobot_folder(tmp_path / "f", tokenizer_file, empty_cameras=1)
    policy = load_policy(folder)
    assert policy.image_slots == (BASE, WRIST, "observation.images.empty_camera_0")
    assert policy.config.num_image_slots == 3
    image = np.zeros((224, 224, 3), np.uint8)
    # a camera key by its full name or by its name after "observation.images."
    inputs = policy.encode({"wrist": image, BASE: image}, np.zeros(4), "go")
    assert inputs.image_masks.tolist() == [[True, True, False]]
    inputs = policy.encode({"wrist": image}, np.zeros(4), "go")
    assert inputs.image_masks.tolist() == [[False, True, False]]
    with pytest.raises(ValueError, match="unknown image slots.*base_0_rgb"):
        policy.encode({"top": image}, np.zeros(4), "go")


def test_an_empty_camera_already_in_input_features_is_not_added_twice(tmp_path, tokenizer_file):
    empty = "observation.images.empty_camera_0"
    folder = lerobot_folder(tmp_path / "f", tokenizer_file, cameras=(BASE, empty), empty_cameras=1)
    assert load_policy(folder).image_slots == (BASE, empty)


# -- relative actions (LeRobot main) ----------------------------------------------------------


def test_relative_actions_map_onto_delta_position(tmp_path, tokenizer_file):
    names = [f"joint_{i}" for i in range(6)] + ["gripper"]
    folder = lerobot_folder(
        tmp_path / "f",
        tokenizer_file,
        state_dim=8,
        version="main",
        relative_actions=True,
        exclude_joints=("gripper",),
        action_names=names,
    )
    policy = load_policy(folder)
    assert policy.robot.action_space == DELTA_POSITION and policy.robot.gripper_dims == (6,)
    state = np.linspace(0.5, 1.2, 8).astype(F32)
    y = np.zeros((TINY.action_horizon, TINY.action_dim), F32)
    deltas = policy.robot_actions(y, state)
    # LeRobot's postprocessor: unnormalise, then add the raw state on the relative dims
    stats = lerobot_stats(synthetic_norm_stats(7, 2)["actions"])
    mid = ((F32(1.0) * (stats["q99"] - stats["q01"]).astype(F32)) / F32(2.0)) + stats["q01"].astype(
        F32
    )
    mask = np.array([True] * 6 + [False])
    lerobot_absolute = mid + state[:7] * mask
    # the node's delta_position space adds the state on every dim but the gripper dims
    published = np.where(mask, state[:7] + deltas, deltas)
    np.testing.assert_allclose(
        published, np.broadcast_to(lerobot_absolute, published.shape), atol=1e-6
    )


def test_main_without_relative_actions_stays_absolute(main_folder):
    robot = load_policy(main_folder).robot
    assert robot.action_space == "position" and robot.gripper_dims == ()


def test_an_openpi_robot_transform_is_refused_for_a_lerobot_folder(v04):
    with pytest.raises(ValueError, match="robot 'droid'.*use robot generic"):
        load_policy(v04, robot="droid")


# -- tokenizer -------------------------------------------------------------------------------


def test_a_hugging_face_tokenizer_folder_gives_the_same_ids(tmp_path, tokenizer_file):
    folder = tmp_path / "paligemma-3b-pt-224"
    folder.mkdir()
    shutil.copy(tokenizer_file, folder / "tokenizer.model")
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    (folder / "special_tokens_map.json").write_text("{}")
    from_folder, from_file = Pi05Tokenizer(folder), Pi05Tokenizer(tokenizer_file)
    text = "Task: pick up the cube, State: 1 2 3;\nAction: "
    assert (
        from_folder.encode_prompt(text, None, 64)[0].tolist()
        == from_file.encode_prompt(text, None, 64)[0].tolist()
    )
    (folder / "tokenizer.model").unlink()
    with pytest.raises(FileNotFoundError, match="has no tokenizer.model"):
        Pi05Tokenizer(folder)


# -- conventions -----------------------------------------------------------------------------


def test_version_parameter_overrides_the_folder(v04):
    assert load_checkpoint(v04).conventions.prompt_state_dim == 32
    main = load_checkpoint(v04, lerobot_version="main").conventions
    assert main.prompt_state_dim == 0 and main.border == -1.0
    assert "lerobot_version parameter" in main.reason
    with pytest.raises(ValueError, match="lerobot_version must be one of"):
        lerobot_conventions("0.3", [], 32)


# -- the node's parameters against a LeRobot folder ---------------------------------------------


def shipped_settings(**overrides):
    import yaml

    from oxygen_ros.ros.params import PARAMETERS, NodeSettings

    text = (Path(__file__).resolve().parents[1] / "config" / "lerobot_pi05.yaml").read_text()
    values = yaml.safe_load(text)["/**"]["ros__parameters"]
    defaults = {spec.name: spec.default for spec in PARAMETERS}
    return NodeSettings.from_values({**defaults, **values, **overrides})


def test_shipped_params_fit_the_random_lerobot_folder(tmp_path):
    from oxygen_ros.ros.engine_setup import check_fits_model
    from oxygen_ros.tools.make_checkpoint import LEROBOT_CAMERAS, main

    assert main(["--preset", "tiny", "--format", "lerobot", "--out", str(tmp_path / "f")]) == 0
    settings = shipped_settings(checkpoint_dir=str(tmp_path / "f"), device="cpu")
    assert [c.slot for c in settings.cameras] == list(LEROBOT_CAMERAS)
    assert (settings.robot, settings.action_horizon, settings.command_space) == (
        "generic",
        0,
        "position",
    )
    policy = load_policy(tmp_path / "f")
    check_fits_model(settings, policy)  # nothing to refuse
    assert policy.published_horizon == TINY.action_horizon


def test_configure_says_what_a_relative_checkpoint_needs(tmp_path, tokenizer_file):
    from oxygen_ros.ros.engine_setup import check_fits_model
    from oxygen_ros.ros.params import SettingsError

    names = ["shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll", "gripper"]
    folder = lerobot_folder(
        tmp_path / "f",
        tokenizer_file,
        cameras=("observation.images.front", "observation.images.wrist"),
        state_dim=6,
        action_dim=6,
        version="main",
        relative_actions=True,
        action_names=names,
    )
    policy = load_policy(folder)
    with pytest.raises(
        SettingsError, match=r"delta_position and gripper_joint_names: \['gripper'\]"
    ):
        check_fits_model(shipped_settings(), policy)
    relative = {"action_space": "delta_position", "gripper_joint_names": ["gripper"]}
    check_fits_model(shipped_settings(**relative, chunk_continuity="none"), policy)
    with pytest.raises(SettingsError, match="relative to each frame's own state"):
        check_fits_model(
            shipped_settings(
                action_space="delta_position",
                gripper_joint_names=["gripper"],
                chunk_continuity="rtc",
            ),
            policy,
        )
    with pytest.raises(SettingsError, match="do not name this LeRobot checkpoint's cameras"):
        check_fits_model(
            shipped_settings(
                camera_slots=["observation.images.top", "observation.images.wrist"],
                action_space="delta_position",
                gripper_joint_names=["gripper"],
            ),
            policy,
        )


def test_bfloat16_keeps_lerobot_mains_vision_path_in_float32(v04, main_folder):
    vision = "paligemma_with_expert.paligemma.model.vision_tower.vision_model.encoder.layers.0"
    projector = "paligemma_with_expert.paligemma.model.multi_modal_projector.linear.weight"
    gemma = "paligemma_with_expert.paligemma.model.language_model.layers.0.mlp.up_proj.weight"
    for folder, kept in ((v04, torch.bfloat16), (main_folder, torch.float32)):
        policy = load_policy(folder, dtype="bfloat16")
        params = dict(policy.model.named_parameters())
        assert params[f"{vision}.self_attn.q_proj.weight"].dtype == kept
        assert params[projector].dtype == kept
        assert params[gemma].dtype == torch.bfloat16
        image = np.zeros((240, 320, 3), np.uint8)
        inputs = policy.encode({BASE: image}, np.zeros(4), "go")
        prefix = policy.model.prefill(
            inputs.images, inputs.image_masks, inputs.tokens, inputs.token_masks
        )
        noise = torch.zeros(1, TINY.action_horizon, TINY.action_dim)
        assert torch.isfinite(policy.model.sample_actions(prefix, noise, 2)).all()
