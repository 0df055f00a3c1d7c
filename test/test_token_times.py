"""A flow time per action token in `Pi05Model.denoise` (training-time RTC conditions its frozen
prefix on time 0): a uniform per-token schedule is bit-identical to the per-step one, and a
non-uniform one conditions each token on its own time."""

from __future__ import annotations

import functools

import pytest
import torch

from oxygen_ros.model.layers import Modulation
from oxygen_ros.model.mot import attention_tables
from oxygen_ros.model.pi05 import flow_schedule
from oxygen_ros.tools.benches.workloads import synthetic_observations
from oxygen_ros.tools.make_checkpoint import random_policy


@functools.cache
def _model_and_prefix(preset: str):
    policy = random_policy(preset, "cpu", "float32", 3)
    with torch.no_grad():  # random weights barely depend on time: make it matter
        for layer in (policy.model.time_mlp_in, policy.model.time_mlp_out):
            layer.weight.mul_(30.0)
    obs = synthetic_observations(2)[0]
    inputs = policy.encode(obs.images, obs.state, obs.prompt)
    prefix = policy.model.prefill(
        inputs.images, inputs.image_masks, inputs.tokens, inputs.token_masks
    )
    return policy.model, prefix


def _noise(model, seed: int) -> torch.Tensor:
    cfg = model.config
    return torch.randn(
        1, cfg.action_horizon, cfg.action_dim, generator=torch.Generator().manual_seed(seed)
    )


def _schedule(steps: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack(flow_schedule(steps)), torch.tensor(-1.0 / steps, dtype=torch.float32)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_uniform_per_token_times_are_bit_identical_to_per_step_times(preset):
    model, prefix = _model_and_prefix(preset)
    times, dt = _schedule()
    horizon = model.config.action_horizon
    noise = _noise(model, 1)
    per_step = model.denoise(prefix.context, prefix.num_valid, noise, times, dt)
    per_token = model.denoise(
        prefix.context, prefix.num_valid, noise, times[:, None].expand(-1, horizon), dt
    )
    assert torch.equal(per_step, per_token)
    if preset != "tiny":
        return
    # LeRobot's schedule (1 + step * dt, not accumulated) goes through the same seam
    lerobot = 1.0 + torch.arange(10, dtype=torch.float32) * dt
    assert torch.equal(
        model.denoise(prefix.context, prefix.num_valid, noise, lerobot, dt),
        model.denoise(
            prefix.context, prefix.num_valid, noise, lerobot[:, None].expand(-1, horizon), dt
        ),
    )


def test_each_token_is_conditioned_on_its_own_time():
    """Reference: every token's modulation computed alone from its own time, the Euler loop
    written out; the frozen-prefix pattern (time 0 on the first tokens) and a random one."""
    model, prefix = _model_and_prefix("tiny")
    times, dt = _schedule()
    steps, horizon = times.shape[0], model.config.action_horizon
    frozen = times[:, None].repeat(1, horizon)
    frozen[:, :3] = 0.0
    random = torch.rand(steps, horizon, generator=torch.Generator().manual_seed(2))
    noise = _noise(model, 4)
    positions, allowed = model._action_layout(prefix.context, prefix.num_valid, 1, horizon)
    tables = attention_tables(
        model.expert.cfg, positions, allowed, model.config.rope_base, model.compute_dtype
    )
    for token_times in (frozen, random):
        x = noise.clone()
        with torch.no_grad():
            for step in range(steps):
                alone = [
                    model.action_conditioning(token_times[step, j : j + 1]) for j in range(horizon)
                ]
                conditioning = {
                    norm: Modulation(
                        *(
                            torch.cat([getattr(a[norm], f) for a in alone], dim=1)
                            for f in ("scale", "shift", "gate")
                        )
                    )
                    for norm in alone[0]
                }
                x = x + dt * model._velocity(
                    prefix.context, x, conditioning, positions, allowed, tables
                )
        got = model.denoise(prefix.context, prefix.num_valid, noise, token_times, dt)
        torch.testing.assert_close(got, x, atol=1e-5, rtol=1e-5)
        # the per-token times do act, far beyond the tolerance above
        plain = model.denoise(prefix.context, prefix.num_valid, noise, times, dt)
        assert (got - plain).abs().max() > 1e-3


def test_per_token_times_of_the_wrong_shape_are_refused():
    model, prefix = _model_and_prefix("tiny")
    times, dt = _schedule()
    noise = _noise(model, 5)
    with pytest.raises(ValueError, match="a time per action token"):
        model.denoise(prefix.context, prefix.num_valid, noise, times[:, None].expand(-1, 3), dt)
