"""Several robots' frames in one batch (`scheduler.act_together`): each engine's chunk equals
the one its frame gets alone, and one engine's bad frame never fails the others'."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from engine_checks import check_engine_memory, scaled_policy  # noqa: F401  (autouse: KV invariants after every test)

from oxygen_ros.engine.frames import frame_noise
from oxygen_ros.engine.requests import SamplingParams
from oxygen_ros.engine.scheduler import OxygenEngine, PoolShare, act_together, decode_together
from oxygen_ros.engine.settings import EngineConfig
from oxygen_ros.engine.types import ActionChunk, Observation
from oxygen_ros.policy_io.policy import load_policy


@pytest.fixture(scope="module")
def policy(tiny_checkpoint):
    return load_policy(tiny_checkpoint, robot="droid")


def observation(seed: int, prompt: str, slots=("base_0_rgb", "left_wrist_0_rgb")) -> Observation:
    rng = np.random.default_rng(seed)
    images = {slot: rng.integers(0, 256, (96, 128, 3), dtype=np.uint8) for slot in slots}
    return Observation(images, rng.uniform(-1, 1, 8), prompt)


def alone(policy, obs: Observation, seed: int, frame_id: int) -> np.ndarray:
    """The frame's chunk from plain policy calls: batch of one, the engine's noise."""
    inputs = policy.encode(obs.images, obs.state, obs.prompt)
    prefix = policy.model.prefill(
        inputs.images, inputs.image_masks, inputs.tokens, inputs.token_masks
    )
    noise = frame_noise(policy.config, seed, frame_id, policy.device)
    with torch.no_grad():
        chunk = policy.model.sample_actions(prefix, noise, 10)
    return policy.decode_batch(chunk, [obs.state])[0]


def test_batched_frames_equal_separate_calls_and_keep_their_own_history(policy):
    engines = [OxygenEngine(policy, EngineConfig(seed=seed)) for seed in (0, 7, 3)]
    # different prompts (so different prompt lengths: padded in the batch), images, states and
    # camera sets (the third robot has no wrist camera)
    frames = [
        observation(1, "pick up the red cup"),
        observation(2, "open the drawer slowly and carefully please"),
        observation(3, "stack", slots=("base_0_rgb",)),
    ]
    for frame_id in (1, 2):
        chunks = act_together(engines, frames)
        for engine, obs, chunk in zip(engines, frames, chunks, strict=True):
            assert isinstance(chunk, ActionChunk)
            assert chunk.frame_id == frame_id  # each engine counts its own frames
            expected = alone(policy, obs, engine.config.seed, frame_id)
            np.testing.assert_allclose(chunk.actions, expected, rtol=0, atol=1e-4)
        frames = frames[::-1]  # the next batch mixes the rows differently
    assert not np.allclose(chunks[0].actions, chunks[2].actions)
    for engine in engines:
        engine.close()


def test_a_bad_frame_fails_alone(policy):
    engines = [OxygenEngine(policy, EngineConfig(seed=seed)) for seed in (0, 1, 2)]
    good = observation(1, "pick up the cup")
    short_state = Observation(good.images, np.zeros(3), "pick")  # refused by its prompt
    unknown_slot = observation(2, "wave", slots=("base_0_rgb", "top_camera"))  # by the encoder
    results = act_together(engines, [short_state, good, unknown_slot])
    assert isinstance(results[0], ValueError)
    assert isinstance(results[2], ValueError) and "top_camera" in str(results[2])
    np.testing.assert_allclose(results[1].actions, alone(policy, good, 1, 1), rtol=0, atol=1e-4)
    assert engines[0].faults_by_stage and engines[2].faults_by_stage
    assert not engines[1].faults_by_stage
    # the failed engines act normally on their next frame
    again = act_together(engines, [good, good, good])
    assert all(isinstance(chunk, ActionChunk) for chunk in again)
    for engine in engines:
        engine.close()


def test_act_together_refuses_engines_over_different_policies(policy, tiny_checkpoint):
    other = load_policy(tiny_checkpoint, robot="droid")
    engines = [OxygenEngine(policy), OxygenEngine(other)]
    with pytest.raises(ValueError, match="share one policy"):
        act_together(engines, [observation(1, "a"), observation(2, "b")])
    for engine in engines:
        engine.close()


def test_guided_rows_continue_their_own_previous_chunk(policy):
    """With RTC each engine's second chunk is guided by its own first one: batched (guided rows
    denoised on their own over the batch's prefix) as alone (each engine's `act`)."""
    config = EngineConfig(chunk_continuity="rtc", action_dt=0.05)
    together = [OxygenEngine(policy, dataclasses.replace(config, seed=s)) for s in (0, 1)]
    apart = [OxygenEngine(policy, dataclasses.replace(config, seed=s)) for s in (0, 1)]
    for frame in range(3):
        frames = [observation(10 + frame, "pick up the cup"), observation(20 + frame, "wave")]
        batched = act_together(together, frames)
        for engine_b, single, obs, chunk in zip(apart, together, frames, batched, strict=True):
            solo = engine_b.act(obs)
            np.testing.assert_allclose(chunk.actions, solo.actions, rtol=0, atol=1e-4)
            for engine, made in ((single, chunk), (engine_b, solo)):
                engine.chunk_published(made.frame_id, made.actions, 0.1)
    assert together[0].continuity.frozen_steps() > 0  # the later chunks were guided
    for engine in together + apart:
        engine.close()


def test_language_of_several_engines_decodes_together_as_alone(tiny_checkpoint):
    """Two robots in one PoolShare: each asks its own question about its own frame; their
    requests advance in the same batched steps, and each answer is the one it gets alone."""
    text_policy = scaled_policy(tiny_checkpoint)  # greedy text that depends on its context
    config = EngineConfig(decode_mode="fixed", decode_steps_per_frame=3)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    frames = [observation(5, "pick up the cup"), observation(6, "open the drawer")]
    questions = ["what do you see?", "where is the handle?"]

    def answers(engines, decode) -> tuple[list[str], list[int]]:
        texts = ["", ""]
        asked = zip(engines, questions, strict=True)
        ids = [engine.submit("answer", question, greedy) for engine, question in asked]
        finished = set()
        for _ in range(20):
            for index, deltas in enumerate(decode()):
                for delta in deltas:
                    assert delta.request_id == ids[index]
                    texts[index] += delta.text
                    if delta.final:
                        finished.add(index)
            if finished == {0, 1}:
                return texts, ids
        raise AssertionError(f"not finished: {texts}")

    share = PoolShare(text_policy, config, engines=2)
    together = [OxygenEngine(text_policy, config, share=share) for _ in range(2)]
    act_together(together, frames)
    batched, ids = answers(together, lambda: decode_together(together))
    assert ids[0] != ids[1]  # one id space across the pool: deltas name their request

    apart = [OxygenEngine(text_policy, config) for _ in range(2)]
    for engine, obs in zip(apart, frames, strict=True):
        engine.act(obs)
    alone, _ = answers(apart, lambda: [engine.decode() for engine in apart])
    assert batched == alone and all(batched)
    assert together[0].decode_steps == together[1].decode_steps  # the same steps, shared
    for engine in together:
        share.close_engine(engine)
    assert not share.engines and share.pool.live_segments == 0
    for engine in apart:
        engine.close()
