"""Real-time chunking: the soft mask, the guidance weight, the guided sampler (inpainting, the VJP,
the read-only prefix KV), the unguided path left bit-identical, and the engine carrying the previous
chunk across frames. Expected numbers are written out from the paper's formulas (module docstring
of oxygen_ros/model/rtc.py), not taken from the code's output."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from oxygen_ros.engine import EngineConfig, OxygenEngine
from oxygen_ros.engine.continuity import ChunkContinuity, resample_previous
from oxygen_ros.engine.frames import act_on_frame, frame_noise, prefill_frame
from oxygen_ros.engine.types import ActionChunk
from oxygen_ros.model.mot import attention_tables, condition_rows, override_tokens, split_rows
from oxygen_ros.model.pi05 import flow_schedule
from oxygen_ros.model.rtc import (
    RTCGuidance,
    TrainedPrefix,
    guidance_weight,
    guidance_weights,
    prefix_weights,
)
from oxygen_ros.ros.params import NodeSettings, SettingsError, check_value
from oxygen_ros.tools.benches.continuity_workload import (
    TimedChunk,
    continuity_metrics,
    moving_scene,
    sample_chunk,
)
from oxygen_ros.tools.benches.workloads import synthetic_observations
from oxygen_ros.tools.make_checkpoint import random_policy

ROBOT_DIM = 7


@pytest.fixture(scope="module")
def policy():
    return random_policy("tiny", "cpu", "float32", 0, action_dim=ROBOT_DIM)


@pytest.fixture(scope="module")
def prefix(policy):
    obs = synthetic_observations(2)[0]
    inputs = policy.encode(obs.images, obs.state, obs.prompt)
    return policy.model.prefill(
        inputs.images, inputs.image_masks, inputs.tokens, inputs.token_masks
    )


def _noise(policy, seed: int) -> torch.Tensor:
    cfg = policy.config
    return torch.randn(
        1, cfg.action_horizon, cfg.action_dim, generator=torch.Generator().manual_seed(seed)
    )


# -- the soft mask and the guidance weight
# ----------------------------------------------------------
def test_linear_schedule_by_hand():
    # d = 2 frozen, overlap end = 6 of 8 steps: c_i = (6 - i) / 5 for i = 2..5, then zeros.
    expected = [1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.0, 0.0]
    assert prefix_weights(8, 2, 6, "linear").tolist() == pytest.approx(expected, abs=1e-7)


def test_exp_schedule_by_hand():
    # c * (e^c - 1) / (e - 1) with c = 0.8, 0.6, 0.4, 0.2 (e = 2.718282): 0.570589, 0.287072,
    # 0.114492, 0.025770.
    expected = [1.0, 1.0, 0.5705890, 0.2870724, 0.1144922, 0.0257702, 0.0, 0.0]
    assert prefix_weights(8, 2, 6, "exp").tolist() == pytest.approx(expected, abs=1e-6)


def test_schedule_edges():
    assert prefix_weights(5, 0, 0, "exp").tolist() == [0.0] * 5  # no overlap: nothing guided
    assert prefix_weights(5, 4, 2, "exp").tolist() == [
        1.0,
        1.0,
        0.0,
        0.0,
        0.0,
    ]  # frozen cut at the overlap
    assert prefix_weights(4, 3, 3, "linear").tolist() == [1.0, 1.0, 1.0, 0.0]  # a hard mask
    # end 9 clamped to the horizon 4, d = 0: c_i = (4 - i) / 5
    assert prefix_weights(4, 0, 9, "linear").tolist() == pytest.approx([0.8, 0.6, 0.4, 0.2])
    with pytest.raises(ValueError, match="schedule"):
        prefix_weights(4, 1, 2, "cosine")


def test_guidance_weight_by_hand():
    # (t^2 + (1-t)^2) / (t (1-t)): t=0.5 -> 0.5/0.25 = 2; t=0.8 -> 0.68/0.16 = 4.25; t=0.9 ->
    # 0.82/0.09 = 9.11.
    assert guidance_weight(0.5, 5.0) == pytest.approx(2.0)
    assert guidance_weight(0.8, 5.0) == pytest.approx(4.25)
    assert guidance_weight(0.9, 5.0) == 5.0  # clipped at beta
    assert guidance_weight(0.9, 100.0) == pytest.approx(0.82 / 0.09)
    assert guidance_weight(1.0, 3.0) == 3.0  # infinite at the first step: beta
    assert guidance_weight(0.0, 3.0) == 3.0


# -- the guided sampler
# ---------------------------------------------------------------------------------
@pytest.mark.parametrize("jacobian", ["vjp", "identity"])
def test_guided_chunk_keeps_the_frozen_steps_and_is_pulled_towards_the_overlap(
    policy, prefix, jacobian
):
    model, cfg = policy.model, policy.config
    previous = model.sample_actions(prefix, _noise(policy, 1))
    noise = _noise(policy, 2)
    free = model.sample_actions(prefix, noise)
    frozen, end = 3, 6
    soft = prefix_weights(cfg.action_horizon, frozen, end, "linear")[:, None]
    guided = model.sample_actions(
        prefix,
        noise,
        guidance=RTCGuidance(previous, soft.expand(-1, cfg.action_dim), 5.0, jacobian),
    )
    assert (free - previous)[0, :frozen].abs().max().item() > 0.5  # fresh noise: another chunk
    torch.testing.assert_close(guided[0, :frozen], previous[0, :frozen], rtol=0, atol=0)
    overlap = slice(frozen, end)  # guided (weights 3/4, 2/4, 1/4), not settled
    assert (
        0
        < (guided - previous)[0, overlap].abs().mean()
        < (free - previous)[0, overlap].abs().mean()
    )
    # a hard mask: the guidance alone brings the frozen steps onto the previous chunk
    frozen = 4
    weights = prefix_weights(cfg.action_horizon, frozen, frozen, "linear")[:, None].expand(
        -1, cfg.action_dim
    )
    unsettled = RTCGuidance(previous, weights * 0.999, 10.0, jacobian)  # below 1: not settled
    guided = model.sample_actions(prefix, noise, guidance=unsettled)
    frozen_error = (guided - previous)[0, :frozen].abs().max().item()
    free_error = (free - previous)[0, :frozen].abs().max().item()
    assert frozen_error < 0.02 * free_error
    # the unguided steps are not pulled onto the previous chunk
    assert (guided - previous)[0, frozen:].abs().mean().item() > 0.3 * (free - previous)[
        0, frozen:
    ].abs().mean().item()
    # with nothing to guide, identity guidance is the plain loop bit for bit (no host check)
    nothing = RTCGuidance(previous, torch.zeros_like(weights), 10.0, jacobian)
    assert torch.equal(model.sample_actions(prefix, noise, guidance=nothing), free)


def test_vjp_guidance_matches_finite_differences(policy, prefix):
    model, cfg = policy.model, policy.config
    t = 0.6
    t_tensor = torch.tensor(t)

    def velocity(x: torch.Tensor) -> torch.Tensor:
        return model.denoise_step(prefix, x, t_tensor)

    x = _noise(policy, 3) * 0.7
    target = _noise(policy, 4)
    weights = torch.rand(
        cfg.action_horizon, cfg.action_dim, generator=torch.Generator().manual_seed(5)
    )
    beta = 5.0
    guided = RTCGuidance(target, weights, beta).velocity(velocity, x, t)

    # By hand: v - w * (e - t * J_v^T e), e = W (Y - (x - t v)), J_v = dv/dx by central differences.
    with torch.no_grad():
        v = velocity(x)
        error = weights * (target - (x - t * v))
        eps = 1e-2
        flat = x.flatten()
        columns = []
        for i in range(flat.numel()):
            step = torch.zeros_like(flat)
            step[i] = eps
            columns.append(
                (
                    (velocity((flat + step).view_as(x)) - velocity((flat - step).view_as(x)))
                    / (2 * eps)
                ).flatten()
            )
        jacobian = torch.stack(columns, dim=1)  # [out, in]
        vjp = (jacobian.T @ error.flatten()).view_as(x)
    weight = (t * t + (1 - t) ** 2) / (t * (1 - t))  # 0.52 / 0.24 = 2.1667 < beta
    expected = v - weight * (error - t * vjp)
    assert torch.allclose(guided, expected, atol=2e-3 * expected.abs().max().item())
    assert (vjp.abs().max() > 1e-3).item()  # the model's Jacobian term is really exercised


def test_unguided_path_is_bit_identical(policy, prefix):
    """continuity none (guidance None, or nothing to guide) runs the Euler loop as it always was."""
    model = policy.model
    noise = _noise(policy, 6)
    # The loop written out: float32 openpi schedule, per-step modulations, shared tables.
    b, horizon = noise.shape[:2]
    conditionings = condition_rows(model.action_conditioning(torch.stack(flow_schedule(10))))
    positions, allowed = model._action_layout(prefix.context, prefix.num_valid, b, horizon)
    tables = attention_tables(
        model.expert.cfg, positions, allowed, model.config.rope_base, model.compute_dtype
    )
    x = noise.float()
    with torch.no_grad():
        for conditioning in conditionings:
            x = x + torch.tensor(-0.1, dtype=torch.float32) * model._velocity(
                prefix.context, x, conditioning, positions, allowed, tables
            )
    assert torch.equal(model.sample_actions(prefix, noise), x)
    assert torch.equal(model.sample_actions(prefix, noise, guidance=None), x)
    nothing = RTCGuidance(torch.zeros_like(noise), torch.zeros(horizon, noise.shape[2]), 5.0)
    assert not nothing.active
    assert torch.equal(model.sample_actions(prefix, noise, guidance=nothing), x)


def test_engine_without_continuity_matches_the_plain_sampler(policy):
    engine = OxygenEngine(policy, EngineConfig())
    assert engine.continuity is None
    obs = synthetic_observations(2)
    first = engine.act(obs[0])
    second = engine.act(obs[1])
    inputs = policy.encode(obs[1].images, obs[1].state, obs[1].prompt)
    prefix = policy.model.prefill(
        inputs.images, inputs.image_masks, inputs.tokens, inputs.token_masks
    )
    expected = policy.robot_actions(
        policy.model.sample_actions(
            prefix, frame_noise(policy.config, 0, second.frame_id, policy.device)
        )[0],
        obs[1].state,
    )
    np.testing.assert_array_equal(second.actions, expected)
    assert not np.array_equal(first.actions, second.actions)
    engine.close()


def test_guided_sampling_leaves_prefix_kv_untouched(policy):
    engine = OxygenEngine(policy, EngineConfig(chunk_continuity="rtc"))
    pool = engine.pool
    frame = prefill_frame(policy, pool, synthetic_observations(2)[0], 1)
    keys, values = pool.keys.clone(), pool.values.clone()
    cfg = policy.config
    target = _noise(policy, 7)
    weights = prefix_weights(cfg.action_horizon, 3, 8, "exp")[:, None].expand(-1, cfg.action_dim)
    noise = frame_noise(cfg, 0, 1, policy.device)
    guided = act_on_frame(
        policy, pool, frame, noise, 10, guidance=RTCGuidance(target, weights, 5.0)
    )
    plain = act_on_frame(policy, pool, frame, noise, 10)
    assert not torch.equal(guided, plain)  # guidance did act
    assert torch.equal(pool.keys, keys) and torch.equal(pool.values, values)
    assert not pool.keys.requires_grad and pool.keys.grad is None and pool.values.grad is None
    assert all(p.grad is None for p in policy.model.parameters())
    pool.release(frame.segment)
    engine.close()


# -- the engine feeds the previous chunk across frames
# ----------------------------------------------
def test_resample_previous_by_hand():
    # row i = (i, -2i)
    previous = np.arange(10, dtype=np.float64)[:, None] * np.array([[1.0, -2.0]])
    grid, covered = resample_previous(previous, 2.5, 10)
    # rows j = 0..6 sit at steps 2.5 .. 8.5 (the last step is 9): (2.5, -5), (3.5, -7), ...
    assert covered == 7
    np.testing.assert_allclose(grid[:7, 0], [2.5, 3.5, 4.5, 5.5, 6.5, 7.5, 8.5])
    np.testing.assert_allclose(grid[:7, 1], [-5.0, -7.0, -9.0, -11.0, -13.0, -15.0, -17.0])
    assert resample_previous(previous, 3.0, 10)[1] == 7  # steps 3..9
    assert resample_previous(previous, 9.5, 10)[1] == 0  # beyond the previous chunk
    assert resample_previous(previous, -1.0, 10)[1] == 0  # stamps going backwards


def test_engine_guides_with_the_previous_chunk_on_the_new_grid(policy):
    engine = OxygenEngine(policy, EngineConfig(chunk_continuity="rtc", action_dt=0.02))
    scene = [moving_scene(0.0, 2), moving_scene(0.05, 2)]
    first = engine.act(scene[0])
    continuity = engine.continuity
    assert continuity.previous.stamp == 0.0
    np.testing.assert_array_equal(continuity.previous.actions, first.actions)
    continuity.latency_s = 0.03  # 1.5 controller steps -> d = 2 frozen steps
    guidance = continuity.guidance(scene[1])
    # offset 0.05 / 0.02 = 2.5 steps: new step j is previous step 2.5 + j, covered for j = 0..6
    prev = first.actions.astype(np.float64)
    by_hand = 0.5 * (prev[2:9] + prev[3:10])
    expected_target = policy.model_actions(
        np.concatenate([by_hand, np.repeat(prev[-1:], 3, axis=0)]), scene[1].state
    )
    np.testing.assert_allclose(guidance.target[0, :7].numpy(), expected_target[:7], atol=1e-5)
    # exp schedule, d = 2, end = 7: c_i = (7 - i) / 6 for i = 2..6
    c = np.array([(7 - i) / 6 for i in range(2, 7)])
    steps = np.concatenate([[1.0, 1.0], c * np.expm1(c) / (math.e - 1), [0.0] * 3])
    np.testing.assert_allclose(guidance.weights[:, 0].numpy(), steps, atol=1e-6)
    assert (guidance.weights[:, ROBOT_DIM:] == 0).all()  # the model's padding dims are free

    # The chunk the engine computes follows the interpolated previous chunk on the frozen steps.
    second = engine.act(scene[1])
    free = OxygenEngine(policy, EngineConfig())
    free.frame_count = 1  # the same frame id, hence the same noise, as the engine's second frame
    unguided = free.act(scene[1])
    free.close()
    assert (
        np.abs(second.actions[:2] - by_hand[:2]).max()
        < 0.1 * np.abs(unguided.actions[:2] - by_hand[:2]).max()
    )
    np.testing.assert_array_equal(continuity.previous.actions, second.actions)
    engine.close()


def test_no_guidance_without_overlap(policy):
    continuity = ChunkContinuity(policy, action_dt=0.02)
    obs = moving_scene(1.0, 1)
    assert continuity.guidance(obs) is None  # no previous chunk yet
    horizon = policy.config.action_horizon
    continuity.record(
        obs, ActionChunk(1, 1.0, np.zeros((horizon, ROBOT_DIM), np.float32), 1.0, 2.0)
    )
    assert continuity.latency_s == pytest.approx(0.003)
    assert continuity.frozen_steps() == 1
    assert continuity.guidance(moving_scene(0.5, 1)) is None  # stamps went backwards
    # the previous chunk has ended
    assert continuity.guidance(moving_scene(1.0 + horizon * 0.02, 1)) is None
    assert continuity.guidance(moving_scene(1.02, 1)) is not None
    continuity.record(
        obs, ActionChunk(2, 1.0, np.zeros((horizon, ROBOT_DIM), np.float32), 5.0, 7.0)
    )
    assert continuity.latency_s == pytest.approx(0.003 + 0.2 * (0.012 - 0.003))  # the EMA
    broken = np.zeros((horizon, ROBOT_DIM), np.float32)
    broken[3, 2] = np.nan
    continuity.record(obs, ActionChunk(3, 1.0, broken, 1.0, 2.0))
    assert continuity.previous is None and continuity.non_finite_chunks == 1  # never a NaN target
    assert continuity.guidance(moving_scene(1.02, 1)) is None


def test_vjp_rtc_on_the_static_path_runs_the_eager_guided_sampler(policy):
    """static_shapes: the first frame uses the static chunk, a vjp-guided frame the eager one."""
    vjp = dict(chunk_continuity="rtc", rtc_guidance="vjp")
    engine = OxygenEngine(policy, EngineConfig(**vjp, static_shapes=True))
    eager = OxygenEngine(policy, EngineConfig(**vjp))
    for stamp in (0.0, 0.05):
        a, b = engine.act(moving_scene(stamp, 2)), eager.act(moving_scene(stamp, 2))
        engine.continuity.latency_s = eager.continuity.latency_s = 0.03
        np.testing.assert_allclose(a.actions, b.actions, atol=1e-4)
    engine.close()
    eager.close()


# -- configuration
# ----------------------------------------------------------------------------------
def test_config_and_parameter_checks():
    with pytest.raises(ValueError, match="chunk_continuity"):
        EngineConfig(chunk_continuity="smooth")
    with pytest.raises(ValueError, match="rtc_schedule"):
        EngineConfig(rtc_schedule="cosine")
    with pytest.raises(ValueError, match="action_dt"):
        EngineConfig(action_dt=0.0)
    with pytest.raises(SettingsError, match="chunk_continuity"):
        check_value("chunk_continuity", "smooth")
    with pytest.raises(SettingsError, match="rtc_schedule"):
        check_value("rtc_schedule", "cosine")
    with pytest.raises(ValueError, match="rtc_guidance"):
        EngineConfig(rtc_guidance="exact")
    with pytest.raises(ValueError, match="rtc_training_max_delay"):
        EngineConfig(rtc_training_max_delay=-1)
    with pytest.raises(SettingsError, match="rtc_guidance"):
        check_value("rtc_guidance", "exact")
    with pytest.raises(ValueError, match="rtc_mode"):
        EngineConfig(rtc_mode="always")
    with pytest.raises(SettingsError, match="rtc_mode"):
        check_value("rtc_mode", "always")
    assert EngineConfig().continuity_mode == "none"
    assert EngineConfig(chunk_continuity="rtc").continuity_mode == "identity"
    assert EngineConfig(chunk_continuity="rtc", rtc_guidance="vjp").continuity_mode == "vjp"
    with pytest.raises(SettingsError, match="rtc_max_guidance_weight"):
        check_value("rtc_max_guidance_weight", -1.0)
    assert "rtc_schedule" in {f.name for f in NodeSettings.__dataclass_fields__.values()}


# -- the bench's controller model
# -------------------------------------------------------------------
def test_controller_stream_and_switch_discontinuity_by_hand():
    dt = 0.1
    a = np.array([[0.0], [1.0], [2.0], [3.0]])  # step i due at stamp + (i + 1) dt
    assert sample_chunk(a, 0.0, 0.25, dt) == pytest.approx([1.5])  # step 1.5
    assert sample_chunk(a, 0.0, 0.05, dt) == pytest.approx([0.0])  # before the first point: held
    b = a + 10.0
    # b arrives at 0.22 -> takes over at controller step 0.3: b at step 2 (12) vs a at step 2 (2)
    chunks = [TimedChunk(0.0, 0.05, a), TimedChunk(0.0, 0.22, b)]
    metrics = continuity_metrics(chunks, dt)
    assert metrics["switch_discontinuity_p50"] == pytest.approx(10.0)
    assert metrics["switches"] == 1
    assert metrics["switches_past_previous_end"] == 0  # a's last action is due at 0.4 s
    late = continuity_metrics([TimedChunk(0.0, 0.05, a), TimedChunk(0.0, 0.45, b)], dt)
    assert late["switches_past_previous_end"] == 1


def test_bench_continuity_writes_every_mode(tmp_path):
    from oxygen_ros.tools.bench import main

    path = tmp_path / "continuity.json"
    threads = torch.get_num_threads()
    try:
        # a 1 s chunk (10 x 0.1 s): even a loaded CPU's latency stays inside it, so every mode
        # has an overlap to continue
        args = ["continuity", "--preset", "tiny", "--frames", "12", "--warmup", "2"]
        args += ["--action-dt", "0.1"]
        assert main([*args, "--rounds", "2", "--json", str(path)]) == 0
    finally:
        torch.set_num_threads(threads)  # the bench runs single-threaded, as the node does
    modes = json.loads(path.read_text())["modes"]
    assert list(modes) == ["none", "identity", "vjp", "trained"]
    keys = {
        "switch_discontinuity_p50",
        "switch_discontinuity_p99",
        "jerk_rms",
        "action_ms_p50",
        "action_cost_vs_none",
        "switch_cut_vs_none",
    }
    for mode in modes.values():
        assert keys <= set(mode) and mode["switches"] == 11
    assert modes["none"]["action_cost_vs_none"] == 1.0
    for mode in ("identity", "vjp", "trained"):
        p50 = modes[mode]["switch_discontinuity_p50"]
        assert p50 < modes["none"]["switch_discontinuity_p50"], mode


# -- identity guidance and training-time RTC
# -------------------------------------------------------
def test_guidance_weights_on_the_device_match_the_scalar_formula():
    times = torch.tensor([1.0, 0.9, 0.8, 0.5, 0.0])
    # t = 1 and t = 0: beta; 0.9: 0.82 / 0.09 = 9.11 -> 5 (clipped); 0.8: 4.25; 0.5: 2
    assert guidance_weights(times, 5.0).tolist() == pytest.approx([5.0, 5.0, 4.25, 2.0, 5.0])
    assert guidance_weights(times, 100.0)[1].item() == pytest.approx(0.82 / 0.09, rel=1e-6)


def test_identity_guidance_is_the_weighted_error_by_hand(policy, prefix):
    """v - w * W (Y - (x - t v)): the J = I case, no backward pass (LeRobot's guided RTC)."""
    model, cfg = policy.model, policy.config
    t = 0.6
    x = _noise(policy, 3) * 0.7
    target = _noise(policy, 4)
    weights = torch.rand(
        cfg.action_horizon, cfg.action_dim, generator=torch.Generator().manual_seed(5)
    )
    calls = []

    def velocity(x_in: torch.Tensor) -> torch.Tensor:
        calls.append(x_in.requires_grad)
        return model.denoise_step(prefix, x_in, torch.tensor(t))

    guided = RTCGuidance(target, weights, 5.0, "identity").velocity(velocity, x, t)
    with torch.no_grad():
        v = model.denoise_step(prefix, x, torch.tensor(t))
    weight = 0.52 / 0.24  # (t^2 + (1 - t)^2) / (t (1 - t)) < beta
    expected = v - weight * (weights * (target - (x - t * v)))
    torch.testing.assert_close(guided, expected, atol=1e-6, rtol=1e-6)
    assert calls == [False]  # one forward, nothing differentiated
    with pytest.raises(ValueError, match="guidance"):
        RTCGuidance(target, weights, 5.0, "jacobian-free")


def test_trained_prefix_is_the_previous_chunk_at_time_zero(policy, prefix):
    """The frozen steps are the previous chunk exactly; the loop equals the per-token-time loop
    written out (time 0 on the frozen tokens, the prefix overwritten before and after each step);
    nothing frozen is the plain chunk."""
    model, cfg = policy.model, policy.config
    horizon, steps = cfg.action_horizon, 10
    previous = model.sample_actions(prefix, _noise(policy, 1))
    noise = _noise(policy, 2)
    d = 3
    frozen = torch.arange(horizon) < d
    trained = model.sample_actions(prefix, noise, guidance=TrainedPrefix(previous, frozen))
    assert torch.equal(trained[0, :d], previous[0, :d])
    times = torch.stack(flow_schedule(steps))
    token_times = times[:, None].repeat(1, horizon)
    token_times[:, :d] = 0.0
    dt = torch.tensor(-0.1, dtype=torch.float32)
    x = noise.clone()
    x[:, :d] = previous[:, :d]
    for step in range(steps):
        x = model.denoise(prefix.context, prefix.num_valid, x, token_times[step : step + 1], dt)
        x[:, :d] = previous[:, :d]
    torch.testing.assert_close(trained, x, atol=1e-5, rtol=1e-5)
    assert (trained - model.sample_actions(prefix, noise))[0, d:].abs().max() > 1e-3
    nothing = TrainedPrefix(previous, torch.zeros(horizon, dtype=torch.bool))
    torch.testing.assert_close(
        model.sample_actions(prefix, noise, guidance=nothing),
        model.sample_actions(prefix, noise),
        atol=1e-5,
        rtol=1e-5,
    )
    with pytest.raises(ValueError, match="NaN"):
        TrainedPrefix(torch.full_like(previous, float("nan")), frozen)


def test_a_trained_step_selects_time_zero_from_the_step_schedule(policy, prefix):
    """A trained chunk runs no time MLP or adaRMS dense layer: every token selects its step's
    cached modulation or time 0's, bit for bit; the chunk equals one conditioned on the fly with
    time 0 as one more row of the same dense calls (as before the schedule held it) to 1e-6;
    nothing frozen is the plain chunk bit for bit. Identity guidance reuses the schedule's
    guidance weights."""
    model, horizon = policy.model, policy.config.action_horizon
    previous = model.sample_actions(prefix, _noise(policy, 1))
    noise, d = _noise(policy, 2), 3
    frozen = torch.arange(horizon) < d
    schedule = model.step_schedule(10, noise.device)
    for step, conditioning in zip(schedule.steps, schedule.conditionings(frozen), strict=True):
        for norm, modulation in conditioning.items():
            assert torch.equal(
                modulation.scale[0, :d], schedule.at_zero[norm].scale[0].expand(d, -1)
            )
            assert torch.equal(modulation.gate[0, d:], step[norm].gate[0].expand(horizon - d, -1))
    dense_calls = []
    hook = model.time_mlp_in.register_forward_hook(lambda *_: dense_calls.append(1))
    try:
        trained = model.sample_actions(prefix, noise, guidance=TrainedPrefix(previous, frozen))
        nothing = TrainedPrefix(previous, torch.zeros(horizon, dtype=torch.bool))
        assert torch.equal(
            model.sample_actions(prefix, noise, guidance=nothing),
            model.sample_actions(prefix, noise),
        )
    finally:
        hook.remove()
    assert dense_calls == []
    # the former per-chunk conditioning: time 0 as row ``steps`` of one dense call per norm
    with_zero = model.action_conditioning(torch.cat([schedule.times, torch.zeros(1)]))
    per_step, at_zero = split_rows(with_zero, 10)
    conditionings = condition_rows(override_tokens(per_step, frozen[None, :], at_zero))
    positions, allowed = model._action_layout(prefix.context, prefix.num_valid, 1, horizon)
    dt = torch.tensor(-0.1, dtype=torch.float32)
    x = torch.where(frozen[:, None], previous, noise)
    with torch.no_grad():
        for conditioning in conditionings:
            v = model._velocity(prefix.context, x, conditioning, positions, allowed, None)
            x = torch.where(frozen[:, None], previous, x + dt * v)
    torch.testing.assert_close(trained, x, atol=1e-6, rtol=1e-6)
    assert schedule.guidance_weights(5.0) is schedule.guidance_weights(5.0)
    assert torch.equal(schedule.guidance_weights(5.0), guidance_weights(schedule.times, 5.0))


def test_a_frozen_masks_selection_is_made_once_and_follows_the_schedules_values(policy):
    """The selection for a frozen mask is reused (a delay takes a few values), a new mask gets
    its own, and overwriting the schedule in place (a fixed-shape path's copy) drops them."""
    model, horizon = policy.model, policy.config.action_horizon
    schedule = model.step_schedule(10, torch.device("cpu")).clone()
    three, four = torch.arange(horizon) < 3, torch.arange(horizon) < 4
    first = schedule.conditionings(three)
    assert schedule.conditionings(three.clone()) is first
    assert schedule.conditionings(four) is not first
    changed = schedule.clone()
    for modulation in changed.at_zero.values():
        modulation.scale.add_(1.0)
    schedule.copy_(changed)
    again = schedule.conditionings(three)
    assert again is not first
    norm = next(iter(again[0]))
    assert torch.equal(again[0][norm].scale[0, 0], changed.at_zero[norm].scale[0, 0])


def test_trained_continuity_freezes_the_delay_and_falls_back_to_guidance_beyond_it(policy):
    continuity = ChunkContinuity(policy, action_dt=0.02, guidance="identity", training_max_delay=2)
    assert continuity.mode == "trained"
    horizon = policy.config.action_horizon
    obs = moving_scene(1.0, 1)
    actions = np.arange(horizon * ROBOT_DIM, dtype=np.float32).reshape(horizon, ROBOT_DIM) * 1e-2
    continuity.record(obs, ActionChunk(1, 1.0, actions, 10.0, 20.0))  # 30 ms: d = 2
    assert continuity.frozen_steps() == 2
    later = moving_scene(1.04, 1)  # two steps on: new step j is previous step j + 2
    prefix = continuity.guidance(later)
    assert isinstance(prefix, TrainedPrefix)
    assert prefix.frozen.tolist() == [True, True] + [False] * (horizon - 2)
    expected = policy.model_actions(actions[2:4].astype(np.float64), later.state)
    np.testing.assert_allclose(prefix.target[0, :2].numpy(), expected, atol=1e-6)
    assert (prefix.target[0, :2, ROBOT_DIM:] == 0).all()  # padding dims 0, as LeRobot pads
    continuity.latency_s = 0.05  # d = 3 > 2: refused, guided instead (counted)
    fallback = continuity.guidance(later)
    assert isinstance(fallback, RTCGuidance) and fallback.jacobian == "identity"
    assert fallback.weights[:3, 0].tolist() == [1.0, 1.0, 1.0]
    assert continuity.trained_fallbacks == 1
    continuity.latency_s = 0.0  # nothing due before the chunk arrives: the plain chunk
    assert continuity.guidance(later) is None
    with pytest.raises(ValueError, match="rtc_training_max_delay"):
        ChunkContinuity(policy, action_dt=0.02, training_max_delay=horizon)


def test_engine_runs_trained_rtc_and_the_frozen_steps_are_the_previous_chunk(policy):
    config = EngineConfig(chunk_continuity="rtc", action_dt=0.02, rtc_training_max_delay=3)
    assert config.continuity_mode == "trained"
    engine = OxygenEngine(policy, config)
    first = engine.act(moving_scene(0.0, 2))
    engine.continuity.latency_s = 0.03  # d = 2
    second = engine.act(moving_scene(0.04, 2))  # offset 2 steps
    np.testing.assert_allclose(second.actions[:2], first.actions[2:4], atol=1e-4)
    assert np.abs(second.actions[2:8] - first.actions[4:]).max() > 1e-3  # the rest is free
    engine.close()


def test_checkpoint_declared_max_delay_selects_trained_rtc(tiny_checkpoint, tmp_path):
    import shutil

    from oxygen_ros.checkpoints.core import CheckpointError
    from oxygen_ros.engine.runtime import ModelSpec, build_engine, load_policy

    plain = load_policy(ModelSpec(str(tiny_checkpoint)))
    assert plain.rtc_training_max_delay == 0
    assert build_engine(plain, EngineConfig(chunk_continuity="rtc")).config.continuity_mode == (
        "identity"
    )
    declared = tmp_path / "trained"
    shutil.copytree(tiny_checkpoint, declared)
    config_json = declared / "config.json"
    written = json.loads(config_json.read_text()) if config_json.is_file() else {}
    config_json.write_text(json.dumps(written | {"rtc_training_max_delay": 4}))
    policy = load_policy(ModelSpec(str(declared)))
    assert policy.rtc_training_max_delay == 4
    engine = build_engine(policy, EngineConfig(chunk_continuity="rtc"))
    assert engine.config.continuity_mode == "trained"
    assert engine.continuity.training_max_delay == 4
    engine.close()
    # rtc_mode guided: guided RTC on the checkpoint trained for RTC; trained: refused without it
    guided = build_engine(policy, EngineConfig(chunk_continuity="rtc", rtc_mode="guided"))
    assert guided.config.continuity_mode == "identity"
    assert guided.continuity.training_max_delay == 0 and guided.continuity.mode == "identity"
    guided.close()
    with pytest.raises(ValueError, match="rtc_mode trained needs a checkpoint"):
        build_engine(plain, EngineConfig(chunk_continuity="rtc", rtc_mode="trained"))
    for bad in (-1, 2.5, True, policy.config.action_horizon):
        config_json.write_text(json.dumps(written | {"rtc_training_max_delay": bad}))
        with pytest.raises(CheckpointError, match="rtc_training_max_delay"):
            load_policy(ModelSpec(str(declared)))


def test_a_lerobot_folder_declares_its_max_delay_in_its_config_json(tmp_path):
    """LeRobot main writes ``rtc_training_max_delay`` into the policy's config.json (0: not
    trained for it); that is the field the loader reads."""
    from oxygen_ros.checkpoints.core import build_model, init_random_weights
    from oxygen_ros.checkpoints.lerobot_writer import lerobot_stats, write_lerobot_folder
    from oxygen_ros.checkpoints.rtc_metadata import declared_rtc_training_max_delay
    from oxygen_ros.model.config import get_preset
    from oxygen_ros.tools.make_checkpoint import synthetic_norm_stats

    model = init_random_weights(build_model(get_preset("tiny")), 5)
    stats = synthetic_norm_stats(8, 1)
    folder_stats = {
        "observation.state": lerobot_stats(stats["state"]),
        "action": {k: v[:ROBOT_DIM] for k, v in lerobot_stats(stats["actions"]).items()},
    }
    horizon = model.config.action_horizon
    for declared in (0, 4):
        folder = write_lerobot_folder(
            tmp_path / f"delay{declared}",
            model,
            folder_stats,
            action_dim=ROBOT_DIM,
            version="main",
            config_overrides={"rtc_training_max_delay": declared},
        )
        assert json.loads((folder / "config.json").read_text())["type"] == "pi05"
        assert declared_rtc_training_max_delay(folder, horizon) == declared
