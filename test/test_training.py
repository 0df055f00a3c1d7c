"""Training pi0.5's objectives on a tiny LeRobotDataset written here: the losses fall, the flow
loss is openpi's formula, the training-time RTC prefix is conditioned at time 0 and left out of
the loss, the checkpoint loads through load_policy unchanged, and the augmentation is openpi's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from oxygen_ros.checkpoints.conventions import lerobot_conventions
from oxygen_ros.data.lerobot_dataset import (
    LeRobotDatasetWriter,
    image_feature,
    string_feature,
    vector_feature,
)
from oxygen_ros.model.objectives import (
    FlowSample,
    action_conditioning,
    action_velocity,
    backbone_pass,
    flow_matching_loss,
    noisy_actions,
    sample_clean_prefix,
    sample_flow,
    sample_flow_time,
    slowed_prefix,
    training_losses,
)
from oxygen_ros.model.rtc import TrainedPrefix
from oxygen_ros.policy_io.policy import load_policy
from oxygen_ros.policy_io.prompts import preset
from oxygen_ros.policy_io.tokenizer import Pi05Tokenizer
from oxygen_ros.tools.benches.subtask_modes import joint_targets
from oxygen_ros.tools.train import dataset_tokenizer
from oxygen_ros.tools.train import main as train_main
from oxygen_ros.training.augment import augment_camera, color_jitter
from oxygen_ros.training.batches import BatchError, BatchMaker
from oxygen_ros.training.dataset import (
    TrainingDataError,
    action_chunk,
    concatenate_frames,
    episodes_with_task,
    held_narrations,
    load_training_frames,
)
from oxygen_ros.training.normalization import checkpoint_norms, dataset_norms
from oxygen_ros.training.trainer import (
    TrainSettings,
    load_weights,
    model_config,
    new_model,
    train,
)
from oxygen_ros.training.weight_average import WeightAverage

JOINTS = ["shoulder_pan", "shoulder_lift", "elbow_flex", "wrist_flex", "wrist_roll", "gripper"]
CAMERAS = ("observation.images.scene", "observation.images.wrist")
SIZE = 32
EPISODE_LENGTH = 16


def write_dataset(root: Path, episodes: int = 3, with_action: bool = True, width: int = 6) -> Path:
    """Episodes where a coloured square slides across the scene while the joints move to a goal;
    subtask reach then grasp; a narration on the first frame of each phase."""
    rng = np.random.default_rng(0)
    names = [f"j{i}" for i in range(width)] if width != 6 else JOINTS
    features = {
        CAMERAS[0]: image_feature(SIZE, SIZE),
        CAMERAS[1]: image_feature(SIZE, SIZE),
        "observation.state": vector_feature(names),
        "subtask": string_feature(),
        "narration": string_feature(),
    }
    if with_action:
        features["action"] = vector_feature(names)
    writer = LeRobotDatasetWriter(root, 10, features, robot_type="so101_sim")
    for e in range(episodes):
        colour = ("red", "green", "blue")[e % 3]
        t = np.linspace(0.0, 1.0, EPISODE_LENGTH)[:, None]
        states = (t * rng.uniform(-1, 1, width)).astype(np.float32)
        actions = np.concatenate([states[1:], states[-1:]]).astype(np.float32)
        scene = np.zeros((EPISODE_LENGTH, SIZE, SIZE, 3), np.uint8)
        for i in range(EPISODE_LENGTH):
            x = int(t[i, 0] * (SIZE - 8))
            scene[i, 4:12, x : x + 8, e % 3] = 255
        half = EPISODE_LENGTH // 2
        subtasks = [f"reach the {colour} cube"] * half + [f"grasp the {colour} cube"] * half
        narrations = [""] * EPISODE_LENGTH
        narrations[0] = f"reaching for the {colour} cube"
        narrations[half] = f"grasping the {colour} cube"
        frames = {
            CAMERAS[0]: scene,
            CAMERAS[1]: scene[:, ::-1].copy(),
            "observation.state": states,
            "subtask": subtasks,
            "narration": narrations,
        }
        if with_action:
            frames["action"] = actions
        writer.add_episode(frames, [f"put the {colour} cube on the blue pad"] * EPISODE_LENGTH)
    writer.finish()
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data") / "sim")


@pytest.fixture(scope="module")
def tokenizer_path(dataset, tmp_path_factory) -> Path:
    return dataset_tokenizer([dataset], tmp_path_factory.mktemp("tok"), 512)


@pytest.fixture(scope="module")
def trained(dataset, tokenizer_path, tmp_path_factory):
    settings = TrainSettings(
        datasets=(dataset,),
        out=tmp_path_factory.mktemp("ckpt") / "tiny",
        tokenizer=tokenizer_path,
        task_filters=((dataset, "red|green"),),  # the blue cube's episode left out
        steps=48,
        batch_size=4,
        lr=2e-3,
        warmup_steps=4,
        seed=3,
        rtc_training_max_delay=3,
        log_every=8,
        command="oxygen-train (test)",
    )
    return settings, train(settings, log=lambda line: None)


@pytest.fixture(scope="module")
def maker(dataset, tokenizer_path):
    frames = load_training_frames(dataset)
    settings = TrainSettings(datasets=(dataset,), out=Path("unused"), tokenizer=tokenizer_path)
    return BatchMaker(
        frames,
        dataset_norms(frames),
        model_config(settings, frames),
        Pi05Tokenizer(tokenizer_path),
        preset("openpi_subtask"),
        lerobot_conventions("main", ["test"], 32),
        augment=False,
        flat_fraction=0.0,
    )


def test_losses_fall_from_a_fixed_seed(trained):
    _, result = trained
    flow = [h.flow for h in result.history]
    text = [h.text for h in result.history]
    k = 8
    assert len(flow) == 48
    assert np.mean(flow[-k:]) < 0.8 * np.mean(flow[:k]), flow
    assert np.mean(text[-k:]) < 0.6 * np.mean(text[:k]), text
    assert all(h.text_tokens > 0 for h in result.history)


def test_flow_loss_is_openpis_formula(maker):
    model = new_model(maker.config, seed=1).eval()
    batch = maker.batch([0, 5, 20, 47], np.random.default_rng(0))
    generator = torch.Generator().manual_seed(0)
    sample = FlowSample(
        noise=torch.randn(batch.actions.shape, generator=generator),
        time=sample_flow_time(4, generator),
        clean=torch.zeros(4, maker.config.action_horizon, dtype=torch.bool),
    )
    with torch.no_grad():
        losses = training_losses(model, batch, sample)
        # independently: the cached inference path's velocity at x_t over the action prompt
        prefix = model.prefill(
            batch.images,
            batch.image_masks,
            batch.tokens,
            batch.token_masks & batch.action_reads,
            batch.token_causal,
        )
        t = sample.time[:, None, None]
        x_t = t * sample.noise + (1 - t) * batch.actions
        velocity = model.denoise_step(prefix, x_t, sample.time)
    expected = ((velocity - (sample.noise - batch.actions)) ** 2).mean()
    assert torch.allclose(losses.flow, expected, rtol=1e-5, atol=1e-6)
    assert losses.text_tokens > 0 and float(losses.text) > 0


def test_time_distribution_and_prefix_sampling():
    generator = torch.Generator().manual_seed(0)
    times = sample_flow_time(20000, generator)
    assert float(times.min()) >= 0.001 and float(times.max()) <= 1.0
    # Beta(1.5, 1) * 0.999 + 0.001 has mean 0.6 * 0.999 + 0.001
    assert abs(float(times.mean()) - (0.6 * 0.999 + 0.001)) < 0.01
    clean = sample_clean_prefix(5000, 10, 3, generator)
    delays = clean.sum(dim=1)
    assert set(delays.tolist()) == {0, 1, 2, 3}
    assert bool((clean == (torch.arange(10)[None] < delays[:, None])).all())
    with pytest.raises(ValueError, match="rtc_training_max_delay"):
        sample_clean_prefix(2, 10, 10, generator)


def test_rtc_prefix_is_clean_at_time_zero_and_out_of_the_loss(maker):
    model = new_model(maker.config, seed=2).eval()
    batch = maker.batch([3], np.random.default_rng(0))
    horizon = maker.config.action_horizon
    delay = 3
    clean = (torch.arange(horizon) < delay)[None]
    generator = torch.Generator().manual_seed(1)
    sample = FlowSample(torch.randn(batch.actions.shape, generator=generator), torch.ones(1), clean)
    x_t, token_time = noisy_actions(batch.actions, sample)
    assert torch.equal(x_t[:, :delay], batch.actions[:, :delay])
    assert bool((token_time[:, :delay] == 0).all()) and bool((token_time[:, delay:] == 1).all())

    # the loss ignores the prefix's velocity entirely
    velocity = torch.randn(batch.actions.shape, generator=generator)
    target = sample.noise - batch.actions
    changed = velocity.clone()
    changed[:, :delay] += 100.0
    assert torch.equal(
        flow_matching_loss(velocity, target, clean), flow_matching_loss(changed, target, clean)
    )
    kept = ~clean[..., None].expand_as(velocity)
    assert torch.allclose(
        flow_matching_loss(velocity, target, clean), ((velocity - target)[kept] ** 2).mean()
    )

    # conditioned as inference conditions a TrainedPrefix's frozen steps: one Euler step from
    # t = 1 with the frozen prefix = the clean actions gives the training velocity elsewhere
    with torch.no_grad():
        out, valid = backbone_pass(model, batch)
        trained_v = action_velocity(model, out, valid, batch.action_reads, x_t, sample.time, clean)
        prefix = model.prefill(
            batch.images,
            batch.image_masks,
            batch.tokens,
            batch.token_masks & batch.action_reads,
            batch.token_causal,
        )
        frozen = TrainedPrefix(batch.actions, clean[0])
        dt = torch.tensor(-1.0)
        stepped = model.denoise(
            prefix.context, prefix.num_valid, sample.noise, torch.ones(1), dt, frozen
        )
        inference_v = (stepped - sample.noise) / dt
    assert torch.allclose(trained_v[:, delay:], inference_v[:, delay:], atol=1e-5)
    # the prefix tokens are modulated as time 0, the others as the example's time
    with torch.no_grad():
        per_token = action_conditioning(model, torch.full((1,), 0.7), clean)
        at_zero = model.action_conditioning(torch.zeros(1))
        at_time = model.action_conditioning(torch.full((1,), 0.7))
    for norm, modulation in per_token.items():
        assert modulation.scale.shape[:2] == (1, horizon)
        assert torch.allclose(modulation.scale[:, :delay], at_zero[norm].scale.expand(1, delay, -1))
        assert torch.allclose(
            modulation.shift[:, delay:], at_time[norm].shift.expand(1, horizon - delay, -1)
        )
        assert not torch.allclose(at_zero[norm].scale, at_time[norm].scale, atol=1e-7)


def test_knowledge_insulation_keeps_the_flow_loss_out_of_the_backbone(maker):
    model = new_model(maker.config, seed=4)
    batch = maker.batch([1, 30], np.random.default_rng(0))
    generator = torch.Generator().manual_seed(2)
    sample = FlowSample(
        torch.randn(batch.actions.shape, generator=generator),
        sample_flow_time(2, generator),
        torch.zeros(2, maker.config.action_horizon, dtype=torch.bool),
    )
    backbone = model.backbone.layers[0].self_attn.k_proj.weight
    expert = model.expert.layers[0].self_attn.q_proj.weight
    for insulate, reaches_backbone in ((True, False), (False, True)):
        model.zero_grad(set_to_none=True)
        training_losses(model, batch, sample, insulate=insulate).flow.backward()
        assert (backbone.grad is not None and bool(backbone.grad.abs().sum() > 0)) == (
            reaches_backbone
        )
        assert expert.grad is not None and bool(expert.grad.abs().sum() > 0)


def test_batches_supervise_subtask_and_narration(maker):
    tok = maker.tokenizer
    layout = maker.text_layout(8, conditioned=True)  # "grasp the red cube", a narration frame
    supervised = [i for i, s in zip(layout.ids, layout.supervised, strict=True) if s]
    subtask = tok.encode_text("grasp the red cube")
    narration = tok.encode_text("grasping the red cube")
    assert supervised == subtask + [tok.eos_id] + narration + [tok.eos_id]
    assert (
        sum(layout.action_reads)
        == len(layout.ids)
        - len(preset("openpi_subtask").kind_ids(tok, "narration"))
        - len(narration)
        - 1
    )
    flat = maker.text_layout(9, conditioned=False)  # held narration, plain action prompt
    assert [i for i, s in zip(flat.ids, flat.supervised, strict=True) if s] == narration + [
        tok.eos_id
    ]
    batch = maker.batch([8], np.random.default_rng(0))
    assert torch.equal(batch.text_targets[batch.text_loss_mask], torch.tensor(supervised))


def test_chunks_stay_in_their_episode_and_narrations_are_held():
    actions = np.arange(10, dtype=np.float32)[:, None]
    assert action_chunk(actions, 7, 9, 4)[:, 0].tolist() == [7, 8, 8, 8]
    ends = np.array([3, 3, 3, 6, 6, 6])
    said = ["a", "", "b", "", "c", ""]
    assert held_narrations(said, ends) == ["a", "a", "b", "", "c", "c"]


def test_checkpoint_loads_through_load_policy_unchanged(trained):
    settings, result = trained
    policy = load_policy(result.out)
    assert policy.rtc_training_max_delay == settings.rtc_training_max_delay
    assert policy.image_slots == CAMERAS
    assert policy.action_dim == 6 and policy.state_dim == 6
    image = np.zeros((SIZE, SIZE, 3), np.uint8)
    inputs = policy.encode({"scene": image, "wrist": image}, np.zeros(6), "put the red cube")
    prefix = policy.model.prefill(
        inputs.images, inputs.image_masks, inputs.tokens, inputs.token_masks
    )
    noise = torch.randn(1, policy.config.action_horizon, policy.config.action_dim)
    chunk = policy.model.sample_actions(prefix, noise, policy.num_steps or 10)
    actions = policy.robot_actions(chunk[0], np.zeros(6))
    assert actions.shape == (policy.config.action_horizon, 6)
    assert np.isfinite(actions).all()
    assert (result.out / "training.json").is_file() and (result.out / "README.md").is_file()


def test_dataset_errors_name_the_feature(tmp_path, tokenizer_path):
    with pytest.raises(TrainingDataError, match="'action'"):
        load_training_frames(write_dataset(tmp_path / "no_action", 1, with_action=False))
    wide = load_training_frames(write_dataset(tmp_path / "wide", 1, width=9))
    settings = TrainSettings(datasets=(tmp_path,), out=tmp_path, tokenizer=tokenizer_path)
    with pytest.raises(BatchError, match="'action' has 9 dims"):
        BatchMaker(
            wide,
            dataset_norms(wide),
            model_config(settings, wide),
            Pi05Tokenizer(tokenizer_path),
            preset("openpi_subtask"),
            lerobot_conventions("main", ["test"], 32),
        )


def test_datasets_concatenate_with_their_episodes_apart(tmp_path, dataset):
    one = load_training_frames(dataset)
    two = load_training_frames(write_dataset(tmp_path / "two", 2))
    both = concatenate_frames([one, two])
    assert len(both) == len(one) + len(two)
    assert both.num_episodes == one.num_episodes + two.num_episodes
    np.testing.assert_array_equal(both.episode_end[len(one) :], two.episode_end + len(one))
    np.testing.assert_array_equal(both.actions[len(one) :], two.actions)
    assert both.tasks[len(one) :] == two.tasks
    # an action chunk never crosses from one dataset into the next
    last = len(one) - 1
    chunk = action_chunk(both.actions, last, int(both.episode_end[last]), 4)
    np.testing.assert_array_equal(chunk, np.repeat(one.actions[-1:], 4, axis=0))
    wide = load_training_frames(write_dataset(tmp_path / "wide", 1, width=9))
    with pytest.raises(TrainingDataError, match="differ in state names"):
        concatenate_frames([one, wide])
    with pytest.raises(TrainingDataError, match="no dataset"):
        concatenate_frames([])


def test_a_task_filter_keeps_whole_episodes_whose_task_matches(dataset):
    frames = load_training_frames(dataset)  # episodes 0, 1, 2: red, green, blue cube
    kept = episodes_with_task(frames, "(red|blue) cube")
    assert len(kept) == 2 * EPISODE_LENGTH and kept.num_episodes == 2
    assert set(kept.tasks) == {frames.tasks[0], frames.tasks[2 * EPISODE_LENGTH]}
    np.testing.assert_array_equal(
        kept.episode_end, [EPISODE_LENGTH] * EPISODE_LENGTH + [2 * EPISODE_LENGTH] * EPISODE_LENGTH
    )
    blue = slice(2 * EPISODE_LENGTH, 3 * EPISODE_LENGTH)
    np.testing.assert_array_equal(kept.actions[EPISODE_LENGTH:], frames.actions[blue])
    np.testing.assert_array_equal(kept.states[EPISODE_LENGTH:], frames.states[blue])
    for camera in frames.cameras:
        np.testing.assert_array_equal(
            kept.images[camera][EPISODE_LENGTH:], frames.images[camera][blue]
        )
    assert kept.subtasks[EPISODE_LENGTH:] == frames.subtasks[blue]
    assert kept.narrations[EPISODE_LENGTH:] == frames.narrations[blue]
    # a chunk at the red episode's last frame stays in it
    last = EPISODE_LENGTH - 1
    chunk = action_chunk(kept.actions, last, int(kept.episode_end[last]), 4)
    np.testing.assert_array_equal(chunk, np.repeat(frames.actions[last : last + 1], 4, axis=0))
    assert episodes_with_task(frames, "^put ") is frames
    with pytest.raises(TrainingDataError, match="no episode's task matches 'touch'"):
        episodes_with_task(frames, "touch")
    with pytest.raises(TrainingDataError, match="not a regular expression"):
        episodes_with_task(frames, "(red")


def test_augmentation_is_seeded_and_spares_wrist_cameras():
    images = torch.rand(2, 3, 64, 64) * 2 - 1

    def run(camera: str, seed: int) -> torch.Tensor:
        return augment_camera(images, camera, torch.Generator().manual_seed(seed))

    scene = run("observation.images.scene", 0)
    assert scene.shape == images.shape and scene.dtype == images.dtype
    assert float(scene.min()) >= -1.0 and float(scene.max()) <= 1.0
    assert torch.equal(scene, run("observation.images.scene", 0))
    assert not torch.equal(scene, run("observation.images.scene", 1))
    wrist = run("observation.images.wrist", 0)
    jitter_only = color_jitter(images / 2 + 0.5, torch.Generator().manual_seed(0)) * 2 - 1
    assert torch.allclose(wrist, jitter_only)
    assert not torch.allclose(scene, jitter_only)


def test_settings_record_the_command_and_seeds(trained):
    settings, result = trained
    import json

    record = json.loads((result.out / "training.json").read_text())
    assert record["command"] == settings.command
    assert record["seed"] == 3 and record["data_seed"] == 3
    assert record["prompt_format"] == "openpi_subtask"
    assert record["task_filters"] == [f"{settings.datasets[0]}=red|green"]
    assert record["frames"] == 2 * EPISODE_LENGTH and record["episodes"] == 2
    config = json.loads((result.out / "config.json").read_text())
    assert config["rtc_training_max_delay"] == 3
    assert dataclasses.asdict(settings)["steps"] == record["steps_done"]


def test_state_noise_and_dropout_change_only_the_prompts_state(maker):
    frame = 5
    plain = maker.text_layout(frame, conditioned=False).ids
    rng = np.random.default_rng(0)
    maker.state_noise, maker.state_dropout = 0.3, 0.0
    try:
        shown = maker._state(frame, rng)
        assert shown is not None and not np.allclose(shown, maker.normalized_states[frame])
        assert np.abs(shown - maker.normalized_states[frame]).max() < 2.0
        maker.state_noise, maker.state_dropout = 0.0, 1.0
        dropped = maker._state(frame, rng)
        assert dropped is not None and (np.abs(dropped) <= 1.0).all()
        changed = maker.text_layout(frame, conditioned=False, state=dropped).ids
        assert changed != plain  # the state's bins differ, after the same task text
        first_difference = next(
            i for i, (a, b) in enumerate(zip(changed, plain, strict=False)) if a != b
        )
        assert first_difference >= len(maker.tokenizer.encode_text("touch"))
        maker.state_dropout = 0.0
        assert maker._state(frame, rng) is None  # neither: the frame's own state
    finally:
        maker.state_noise, maker.state_dropout = 0.0, 0.0
    frames, norms = maker.frames, maker.norms
    for bad in ({"state_noise": -0.1}, {"state_dropout": 1.5}):
        with pytest.raises(BatchError, match=next(iter(bad))):
            BatchMaker(frames, norms, maker.config, maker.tokenizer, maker.format,
                       maker.conventions, **bad)  # fmt: skip


def test_start_share_draws_from_where_episodes_begin(maker):
    ends = maker.frames.episode_end
    starts = {int(e) - EPISODE_LENGTH for e in np.unique(ends)}
    assert starts == {0, EPISODE_LENGTH, 2 * EPISODE_LENGTH}  # the fixture's episodes
    within = {s + k for s in starts for k in range(5)}
    np.testing.assert_array_equal(maker.start_indices, sorted(within))
    rng = np.random.default_rng(1)
    maker.start_share = 1.0
    try:
        assert set(maker.sample_indices(200, rng).tolist()) <= within
        maker.start_share = 0.5
        drawn = maker.sample_indices(2000, rng)
        share = np.isin(drawn, list(within)).mean()  # half from the starts + their uniform share
        assert 0.5 < share < 0.5 + 0.5 * len(within) / len(maker.frames) + 0.05
    finally:
        maker.start_share = 0.0
    assert not set(maker.sample_indices(400, rng).tolist()) <= within  # uniform again


def test_train_cli_takes_several_datasets_and_refuses_negative_threads(capsys):
    from oxygen_ros.tools.train import _parse_args

    args = _parse_args(["--dataset", "a", "--dataset", "b", "--out", "o", "--threads", "1"])
    assert [str(d) for d in args.dataset] == ["a", "b"] and args.threads == 1
    with pytest.raises(SystemExit):
        _parse_args(["--dataset", "a", "--out", "o", "--threads", "-1"])
    assert "--threads must be >= 0" in capsys.readouterr().err
    args = _parse_args(
        ["--dataset", "a", "--dataset", "b", "--out", "o", "--task-filter", "b=^put "]
    )
    assert args.task_filter == ((Path("b"), "^put "),)
    with pytest.raises(SystemExit):
        _parse_args(["--dataset", "a", "--out", "o", "--task-filter", "c=^put "])
    assert "not one of the --dataset folders: a" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse_args(["--dataset", "a", "--out", "o", "--task-filter", "a"])
    assert "a task filter is DATASET=PATTERN" in capsys.readouterr().err


def test_relative_actions_round_trip_through_the_lerobot_folder(dataset, tokenizer_path, tmp_path):
    """Trained relative to the chunk's start state (the gripper absolute), the folder says so, and
    the loader's inverse turns the chunk the model learned back into the dataset's actions."""
    settings = TrainSettings(
        datasets=(dataset,),
        out=tmp_path / "relative",
        tokenizer=tokenizer_path,
        steps=2,
        batch_size=2,
        relative_actions=True,
        command="oxygen-train (test)",
    )
    train(settings, log=lambda line: None)
    config = json.loads((settings.out / "config.json").read_text())
    assert config["use_relative_actions"] is True
    assert config["relative_exclude_joints"] == ["gripper"]
    policy = load_policy(settings.out)
    assert policy.lerobot.relative_actions == (True,) * 5 + (False,)

    frames = load_training_frames(dataset)
    relative = (True,) * 5 + (False,)
    norms = dataset_norms(frames, relative, policy.config.action_horizon)
    maker = BatchMaker(
        frames,
        norms,
        policy.config,
        Pi05Tokenizer(tokenizer_path),
        preset("openpi_subtask"),
        lerobot_conventions("main", ["test"], 32),
        augment=False,
    )
    index = 5  # mid-episode: the state is far from zero
    end = int(frames.episode_end[index])
    learned = maker.action_chunk(index)
    absolute = action_chunk(frames.actions, index, end, policy.config.action_horizon)
    assert not np.allclose(learned[:, :6], norms.action.normalize(absolute), atol=1e-3)
    # the robot-unit chunk is in the node's delta_position space: the state added back on the
    # relative dims (ros/commands.py) gives the dataset's absolute actions
    assert policy.robot.action_space == "delta_position" and policy.robot.gripper_dims == (5,)
    deltas = policy.robot_actions(learned, frames.states[index])
    np.testing.assert_allclose(
        joint_targets(policy, deltas, frames.states[index]), absolute, atol=1e-5
    )
    with pytest.raises(ValueError, match="one flag per action dim"):
        dataset_norms(frames, (True,) * 3, 4)


def test_a_slowed_prefix_starts_where_the_chunk_does_and_moves_less(maker):
    batch = maker.batch([3, 10, 20, 30], np.random.default_rng(0))
    actions = batch.actions.float()
    generator = torch.Generator().manual_seed(4)
    assert torch.equal(slowed_prefix(actions, 0.0, generator), actions)
    slowed = slowed_prefix(actions, 1.0, generator)
    assert torch.equal(slowed[:, 0], actions[:, 0])  # every prefix starts at the chunk's start
    travel = (actions - actions[:, :1]).abs().amax(dim=(1, 2))
    slowed_travel = (slowed - actions[:, :1]).abs().amax(dim=(1, 2))
    moving = travel > 0
    assert bool(moving.any()) and bool((slowed_travel[moving] < travel[moving]).all())
    assert bool((slowed_travel <= travel).all()), (slowed_travel, travel)
    with pytest.raises(ValueError, match="share"):
        slowed_prefix(actions, 1.5, generator)


def test_the_clean_prefix_shows_the_slowed_start_and_the_target_stays_the_demonstration(maker):
    batch = maker.batch([3], np.random.default_rng(0))
    horizon, delay = maker.config.action_horizon, 3
    clean = (torch.arange(horizon) < delay)[None]
    generator = torch.Generator().manual_seed(1)
    prefix = slowed_prefix(batch.actions.float(), 1.0, generator)
    noise = torch.randn(batch.actions.shape, generator=generator)
    sample = FlowSample(noise, torch.full((1,), 0.5), clean, prefix)
    x_t, token_time = noisy_actions(batch.actions, sample)
    assert torch.equal(x_t[:, :delay], prefix[:, :delay])
    assert torch.allclose(x_t[:, delay:], 0.5 * noise[:, delay:] + 0.5 * batch.actions[:, delay:])
    assert bool((token_time[:, :delay] == 0).all())
    # sample_flow draws it per example: a share of 1 slows every prefix, 0 none
    drawn = sample_flow(batch.actions, 3, torch.Generator().manual_seed(2), slowed_share=1.0)
    assert drawn.prefix is not None and not torch.equal(drawn.prefix, batch.actions)
    assert sample_flow(batch.actions, 3, torch.Generator().manual_seed(2)).prefix is None


def test_a_run_starts_from_a_checkpoints_weights(trained, dataset, tokenizer_path, tmp_path):
    settings, result = trained
    source = load_policy(result.out).model
    model = new_model(source.config, seed=99)
    assert not torch.equal(model.state_dict()["action_out_proj.weight"],
                           source.state_dict()["action_out_proj.weight"])  # fmt: skip
    load_weights(model, result.out)
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    # and normalises as it did: the statistics the checkpoint was written with
    ((root, pattern),) = settings.task_filters
    written = dataset_norms(episodes_with_task(load_training_frames(root), pattern))
    norms = checkpoint_norms(result.out)
    for mine, theirs in ((norms.state, written.state), (norms.action, written.action)):
        for q in ("q01", "q99"):
            assert np.array_equal(mine.stats[q], theirs.stats[q])
    with pytest.raises(ValueError, match="normaliser file"):
        checkpoint_norms(tmp_path)
    other = new_model(
        dataclasses.replace(source.config, action_dim=source.config.action_dim + 2), 0
    )
    with pytest.raises(ValueError, match="does not fit"):
        load_weights(other, result.out)


def test_the_weight_average_moves_by_one_minus_decay_and_is_put_back():
    layer = torch.nn.Linear(2, 1, bias=False)
    frozen = torch.nn.Parameter(torch.ones(1), requires_grad=False)
    layer.register_parameter("frozen", frozen)
    with torch.no_grad():
        layer.weight.fill_(0.0)
    average = WeightAverage(layer, decay=0.9)
    assert set(average.state_dict()) == {"weight"}  # only what the optimizer trains
    with torch.no_grad():
        layer.weight.fill_(1.0)
    average.update(layer)
    average.update(layer)
    expected = 1.0 - 0.9**2  # two steps towards 1 from 0
    assert torch.allclose(average.state_dict()["weight"], torch.full((1, 2), expected))
    with average.applied(layer):
        assert torch.allclose(layer.weight, torch.full((1, 2), expected))
    assert torch.equal(layer.weight, torch.ones(1, 2))  # its own weights again
    with pytest.raises(ValueError, match="decay"):
        WeightAverage(layer, decay=1.0)
    with pytest.raises(ValueError, match="other parameters"):
        average.load_state_dict({"bias": torch.zeros(1)})


def test_a_run_with_a_weight_average_writes_the_average(trained, dataset, tokenizer_path, tmp_path):
    settings, result = trained
    out = tmp_path / "averaged"
    averaged = dataclasses.replace(
        settings, out=out, init_from=result.out, steps=6, ema_decay=0.5, probe_every=0
    )
    train(averaged, log=lambda line: None)
    state = torch.load(out / "resume.pt", weights_only=False)
    written = load_policy(out).model.state_dict()
    name = "action_out_proj.weight"
    assert torch.equal(written[name], state["weight_average"][name])
    assert not torch.equal(written[name], state["model"][name])  # not the last step's weights
    start = load_policy(result.out).model.state_dict()[name]
    assert not torch.equal(written[name], start)  # and it did move from where it began
    with pytest.raises(SystemExit):
        train_main(["--dataset", str(dataset), "--out", str(tmp_path / "x"), "--ema-decay", "1"])
