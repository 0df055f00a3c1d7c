"""`EngineBase.warm_up`: buckets, decode timings and first-call frames, then no trace of them."""

from __future__ import annotations

import numpy as np
import pytest
from engine_checks import check_engine_memory  # noqa: F401  (autouse: KV invariants after every test)

from oxygen_ros.engine import ENGINES, EngineConfig, OxygenEngine, make_engine
from oxygen_ros.engine.requests import SamplingParams
from oxygen_ros.engine.types import Observation
from oxygen_ros.policy_io.policy import load_policy


@pytest.fixture(scope="module")
def policy(tiny_checkpoint):
    return load_policy(tiny_checkpoint, action_dim=7)


def observation(i: int) -> Observation:
    rng = np.random.default_rng(i)
    images = {"base_0_rgb": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)}
    return Observation(images, rng.uniform(-1, 1, 7), "pick up the red cup", stamp=float(i))


CONFIG = EngineConfig(decode_mode="fixed", decode_steps_per_frame=3, seed=4, max_active_requests=4)


def run(engine, frames: int = 3) -> tuple[list, dict[int, str], list]:
    """Frames with one greedy request each: (action chunks, text per request id, request ids)."""
    chunks, texts, ids = [], {}, []
    for f in range(frames):
        ids.append(engine.submit("narration", sampling=SamplingParams(max_tokens=5)))
        result = engine.step(observation(10 + f))
        chunks.append(result.action.actions)
        for d in result.deltas:
            texts[d.request_id] = texts.get(d.request_id, "") + d.text
    return chunks, texts, ids


def test_warm_up_leaves_the_engine_as_if_nothing_ran(policy):
    warmed = OxygenEngine(policy, CONFIG)
    report = warmed.warm_up(observation(0), frames=4)
    assert report.frames == 4 and report.buckets_created == 0  # eager paths: no buckets
    assert report.action_ms > 0 and report.language_step_ms > 0
    assert report.language_step_ms == pytest.approx(1e3 * warmed.timer.estimate(1))
    assert warmed.timer.measured_sizes() == [1, 2, 4]  # calibrated sizes; the frames used 1 and 2
    memory = warmed.memory()
    assert memory["bytes_in_use"] == memory["peak_bytes"] == memory["live_segments"] == 0
    assert (warmed.frame_count, warmed.tokens_generated, warmed.decode_steps) == (0, 0, 0)
    assert warmed.queued_requests == warmed.active_requests == 0 and warmed.faults_by_stage == {}
    # Same frame ids (so the same noise) and request ids as an engine that never warmed up.
    fresh = OxygenEngine(policy, CONFIG)
    try:
        chunks_w, texts_w, ids_w = run(warmed)
        chunks_f, texts_f, ids_f = run(fresh)
    finally:
        warmed.close()
        fresh.close()
    assert ids_w == ids_f == [1, 2, 3]
    for a, b in zip(chunks_w, chunks_f, strict=True):
        np.testing.assert_array_equal(a, b)
    assert texts_w == texts_f


def test_warm_up_after_the_first_frame_or_request_is_refused(policy):
    engine = OxygenEngine(policy, CONFIG)
    engine.step(observation(0))
    with pytest.raises(RuntimeError, match="before the first frame"):
        engine.warm_up(observation(0))
    engine.close()
    queued = OxygenEngine(policy, CONFIG)
    queued.submit("narration")
    with pytest.raises(RuntimeError, match="first request"):
        queued.warm_up(observation(0))
    queued.close()


def test_warm_up_forgets_the_previous_chunk_of_real_time_chunking(policy):
    engine = OxygenEngine(policy, EngineConfig(chunk_continuity="rtc", seed=4))
    engine.warm_up(observation(0), frames=2)
    assert engine.continuity.previous is None  # the first real chunk is not guided by warm-up
    engine.close()


@pytest.mark.parametrize("name", [n for n in ENGINES if n != "oxygen"])
def test_baselines_warm_up_too_and_keep_no_trace(policy, name):
    engine = make_engine(name, policy, CONFIG)
    try:
        report = engine.warm_up(observation(0), frames=2)
        assert report.frames == 2 and report.action_ms > 0 and report.language_step_ms == 0.0
        assert (engine.frame_count, engine.tokens_generated, engine.decode_steps) == (0, 0, 0)
        assert engine.memory()["peak_bytes"] == 0 and engine.active_requests == 0
        assert engine.submit("narration") == 1
    finally:
        engine.close()
