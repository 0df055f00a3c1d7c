"""The delay RTC freezes is the one the robot sees, and RTC follows what was actually published:
the engine's continuity fed by the tick (observation stamp -> published, on the node's clock),
the published (safety-limited) chunk as the next guidance, an ``action_dt`` change reaching the
engine. Every clock here is deterministic."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from tick_helpers import KeptOutputs, tick_loop

from oxygen_ros.engine import EngineConfig, OxygenEngine
from oxygen_ros.engine.continuity import ChunkContinuity, resample_previous
from oxygen_ros.engine.types import ActionChunk
from oxygen_ros.ros.observation import NS_PER_S
from oxygen_ros.ros.params import PARAMETERS, NodeSettings
from oxygen_ros.tools.benches.continuity_workload import moving_scene
from oxygen_ros.tools.make_checkpoint import random_policy

ROBOT_DIM = 7
DEFAULTS = {spec.name: spec.default for spec in PARAMETERS}


@pytest.fixture(scope="module")
def policy():
    return random_policy("tiny", "cpu", "float32", 0, action_dim=ROBOT_DIM)


class SteppingClock:
    """A clock that advances ``step`` seconds every time it is read."""

    def __init__(self, step: float) -> None:
        self.ticks = itertools.count()
        self.step = step

    def __call__(self) -> float:
        return next(self.ticks) * self.step


def _chunk(frame_id: int, stamp: float, horizon: int, offset: float = 0.0) -> ActionChunk:
    actions = offset + np.arange(horizon * ROBOT_DIM, dtype=np.float32).reshape(horizon, -1) * 1e-2
    return ActionChunk(frame_id, stamp, actions, 4.0, 6.0)


def test_engine_delay_is_its_own_time_until_the_node_reports_the_robot_seen_one(policy):
    # every clock read advances 4 ms: prefill 4 ms + action 4 ms -> 8 ms -> d = 1 at 20 ms steps
    engine = OxygenEngine(
        policy, EngineConfig(chunk_continuity="rtc", action_dt=0.02), clock=SteppingClock(0.004)
    )
    first = engine.act(moving_scene(0.0, 2))
    assert (first.prefill_ms, first.action_ms) == pytest.approx((4.0, 4.0))
    assert engine.continuity.frozen_steps() == 1
    engine.chunk_published(first.frame_id, first.actions, 0.045)  # stamp -> published: 45 ms
    assert engine.continuity.frozen_steps() == 3  # ceil(45 / 20)
    engine.chunk_published(first.frame_id, first.actions, 0.095)  # EMA: 45 + 0.2 * 50 = 55 ms
    assert engine.continuity.delay_s == pytest.approx(0.055)
    # it varies: deviation 0.25 * |95 - 45| = 12.5 ms; the bound 55 + 2 * 12.5 = 80 ms = 4 steps
    assert engine.continuity.delay_deviation_s == pytest.approx(0.0125)
    assert engine.continuity.frozen_steps() == 4
    engine.set_action_dt(0.01)  # the node's runtime action_dt reaches RTC: 80 ms = 8 steps
    assert engine.continuity.frozen_steps() == 8
    for _ in range(40):  # steady at 55 ms: the deviation decays, the bound is the EMA
        engine.chunk_published(first.frame_id, first.actions, 0.055)
    assert engine.continuity.frozen_steps() == 6
    with pytest.raises(ValueError, match="action_dt"):
        engine.set_action_dt(0.0)
    engine.close()


def test_guidance_follows_the_published_chunk_and_keeps_it_when_nothing_is_published(policy):
    continuity = ChunkContinuity(policy, action_dt=0.02)
    horizon = policy.config.action_horizon
    obs = moving_scene(1.0, 1)
    continuity.record(obs, _chunk(1, 1.0, horizon))
    assert continuity.previous.frame_id == 1  # no report yet: every computed chunk counts
    limited = np.clip(_chunk(1, 1.0, horizon).actions[:6], -0.1, 0.1)  # 6 published, clipped
    continuity.published(1, limited, 0.03)
    np.testing.assert_array_equal(continuity.previous.actions, limited)
    # the next chunk is not published (unsafe): the controller keeps executing frame 1's
    continuity.record(moving_scene(1.05, 1), _chunk(2, 1.05, horizon, offset=5.0))
    continuity.published(2, None, 0.03)
    assert continuity.previous.frame_id == 1
    guidance = continuity.guidance(moving_scene(1.04, 1))  # 2 steps after frame 1
    expected = policy.model_actions(
        np.concatenate([limited[2:], np.repeat(limited[-1:], horizon - 4, 0)]),
        moving_scene(1.04, 1).state,
    )
    np.testing.assert_allclose(guidance.target[0, :4].numpy(), expected[:4], atol=1e-6)
    assert guidance.weights[4:].abs().max() == 0  # covered: the 4 published steps left
    with pytest.raises(ValueError, match="newest recorded"):
        continuity.published(1, limited, 0.03)


def test_a_chunk_published_at_another_action_dt_is_resampled_at_its_own():
    previous = np.arange(10, dtype=np.float64)[:, None]  # step i due at stamp + (i + 1) * 0.02
    # new chunk 0.04 s later at 0.01 s steps: new step j due at 0.04 + (j + 1) 0.01 since the
    # previous stamp -> previous step (0.05 + 0.01 j) / 0.02 - 1 = 1.5 + 0.5 j
    grid, covered = resample_previous(previous, 2.0, 30, step=0.5)
    assert covered == 16  # 1.5 + 0.5 j <= 9: j = 0 .. 15
    np.testing.assert_allclose(grid[:4, 0], [1.5, 2.0, 2.5, 3.0])
    np.testing.assert_allclose(grid[covered - 1, 0], 9.0)
    with pytest.raises(ValueError, match="step"):
        resample_previous(previous, 2.0, 30, step=0.0)


def test_tick_reports_the_limited_chunk_and_the_stamp_to_publish_delay(policy):
    """One tick through the node's action path with a deterministic node clock: the robot-seen
    delay (observation stamp 1.000 s, published at 1.047 s: 47 ms = 3 steps of 20 ms) and the
    limited chunk reach the engine's RTC; a new action_dt reaches it on the next tick."""
    now = {"ns": 0}
    loop = tick_loop(20.0, lambda: now["ns"])
    loop.outputs = KeptOutputs()
    values = {**DEFAULTS, "chunk_continuity": "rtc", "max_joint_velocity": [0.5] * ROBOT_DIM}
    settings = NodeSettings.from_values(values)
    engine = OxygenEngine(policy, EngineConfig(chunk_continuity="rtc", action_dt=0.02))
    scene = moving_scene(1.0, 2)
    stamp_ns = 1 * NS_PER_S
    now["ns"] = stamp_ns + 47_000_000
    assert loop._act(engine, settings, scene, stamp_ns, 0.0)
    command = loop.outputs.commands[-1]
    assert command.clipped > 0  # the limits changed the chunk
    continuity = engine.continuity
    np.testing.assert_allclose(continuity.previous.actions, command.actions, atol=1e-6)
    assert continuity.delay_s == pytest.approx(0.047)
    assert continuity.frozen_steps() == 3
    faster = NodeSettings.from_values({**values, "action_dt": 0.01})
    now["ns"] = stamp_ns + 60_000_000 + 47_000_000
    assert loop._act(engine, faster, moving_scene(1.06, 2), stamp_ns + 60_000_000, 0.0)
    assert continuity.action_dt == 0.01
    assert continuity.previous.action_dt == 0.01
    engine.close()
