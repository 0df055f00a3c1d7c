"""OxyGen engine and baselines: same actions everywhere, batching-invariant text, no leaks,
admission control, deadline-bound decoding, one prefill per frame."""

from __future__ import annotations

import numpy as np
import pytest
from engine_checks import check_engine_memory, scaled_policy  # noqa: F401  (autouse: KV invariants after every test)

from oxygen_ros.engine import ENGINES, EngineConfig, OxygenEngine, make_engine
from oxygen_ros.engine.metrics import StepTimer
from oxygen_ros.engine.requests import SamplingParams
from oxygen_ros.engine.types import Observation, TextDelta


@pytest.fixture(scope="module")
def policy(tiny_checkpoint):
    return scaled_policy(tiny_checkpoint)


def observation(i: int) -> Observation:
    rng = np.random.default_rng(i)
    images = {
        "base_0_rgb": rng.integers(0, 256, (240, 320, 3), dtype=np.uint8),
        "left_wrist_0_rgb": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
    }
    return Observation(images, rng.uniform(-1, 1, 7), "pick up the red cup", stamp=float(i))


def collect(deltas: list[TextDelta], texts: dict[int, list[TextDelta]]) -> None:
    for d in deltas:
        texts.setdefault(d.request_id, []).append(d)


FIXED = EngineConfig(decode_mode="fixed", decode_steps_per_frame=5, seed=3)


def test_same_frame_and_noise_give_the_same_action_in_every_engine(policy):
    chunks = {}
    for name in ENGINES:
        engine = make_engine(name, policy, FIXED)
        try:
            engine.submit("narration", sampling=SamplingParams(max_tokens=3))
            engine.step(observation(0))
            chunks[name] = engine.step(observation(1)).action.actions
        finally:
            engine.close()
    reference = chunks["oxygen"]
    assert reference.shape == (policy.config.action_horizon, 7)
    for name, actions in chunks.items():
        np.testing.assert_allclose(actions, reference, atol=1e-5, err_msg=name)


def run_requests(
    policy, submissions: dict[int, list[tuple]], frames: int
) -> dict[int, list[TextDelta]]:
    """Drive OxyGen in fixed-k mode; ``submissions[frame]`` = [(kind, text, max_tokens)] submitted
    before that frame. Returns every request's deltas by request id."""
    engine = OxygenEngine(policy, FIXED)
    texts: dict[int, list[TextDelta]] = {}
    try:
        for f in range(frames):
            for kind, text, max_tokens in submissions.get(f, []):
                engine.submit(kind, text, SamplingParams(max_tokens=max_tokens))
            collect(engine.step(observation(f)).deltas, texts)
        collect(engine.decode(max_steps=200), texts)
    finally:
        engine.close()
    return texts


def tokens_of(deltas: list[TextDelta]) -> str:
    assert deltas[-1].final and sum(d.final for d in deltas) == 1
    return "".join(d.text for d in deltas)


def test_request_text_is_identical_alone_or_batched_across_frames(policy):
    alone = run_requests(policy, {1: [("answer", "where is the cup?", 12)]}, frames=6)
    assert list(alone) == [1]
    crowd = run_requests(
        policy,
        {
            0: [("narration", "", 20), ("memory", "", 4)],  # older frame, different lengths
            1: [
                ("narration", "", 9),
                ("answer", "where is the cup?", 12),
                ("answer", "what next?", 30),
            ],
            2: [("memory", "", 7)],
        },
        frames=6,
    )
    target = crowd[4]  # request ids count from 1 in submission order: the 4th is our answer
    assert target[0].kind == "answer"
    text = tokens_of(alone[1])
    assert len(set(text)) > 2, f"degenerate text {text!r}: the test would prove nothing"
    assert tokens_of(target) == text
    assert target[-1].token_count == alone[1][-1].token_count
    assert tokens_of(crowd[1]) != tokens_of(crowd[3])  # other requests really differ


@pytest.mark.timeout(1200)  # ~40 s idle on 2 cores; generous for a loaded CI host
def test_thousand_frames_leave_no_leaked_kv(policy):
    config = EngineConfig(
        decode_mode="fixed", decode_steps_per_frame=2, default_max_tokens=6, max_active_requests=8
    )
    engine = OxygenEngine(policy, config)
    obs = observation(0)
    in_use = []
    finals = 0
    for f in range(1000):
        if f % 2 == 0:
            engine.submit("narration")
        result = engine.step(obs)
        finals += sum(d.final for d in result.deltas)
        in_use.append(engine.memory()["bytes_in_use"])
    finals += sum(d.final for d in engine.decode(max_steps=100))
    assert finals == 500  # every request finished (none refused: 3 live at a time fit easily)
    assert max(in_use[500:]) <= max(in_use[:500])  # steady state, no creep
    engine.close()
    memory = engine.memory()
    assert memory["bytes_in_use"] == 0 and memory["live_segments"] == 0


def test_admission_control_refuses_cleanly_and_actions_continue(policy):
    prefix_tokens = 3 * policy.config.image_tokens + policy.config.max_token_len
    # Room for two prefixes (the action path's reserve) and very little else.
    config = EngineConfig(
        decode_mode="fixed", kv_capacity_tokens=2 * prefix_tokens + 16, kv_block_size=16
    )
    engine = OxygenEngine(policy, config)
    engine.submit("narration", sampling=SamplingParams(max_tokens=30))
    result = engine.step(observation(0))
    refused = [d for d in result.deltas if d.final]
    assert len(refused) == 1 and refused[0].finish_reason == "refused"
    assert "KV tokens" in refused[0].detail
    for f in range(1, 4):
        assert engine.step(observation(f)).action is not None
    engine.close()


def test_requests_wait_for_a_decode_slot_then_run(policy):
    config = EngineConfig(decode_mode="fixed", decode_steps_per_frame=5, max_active_requests=1)
    engine = OxygenEngine(policy, config)
    first = engine.submit("narration", sampling=SamplingParams(max_tokens=4))
    second = engine.submit("memory", sampling=SamplingParams(max_tokens=4))
    texts: dict[int, list[TextDelta]] = {}
    collect(engine.step(observation(0)).deltas, texts)
    assert engine.queued_requests == 1 and second not in texts  # waiting, not refused
    collect(engine.step(observation(1)).deltas, texts)
    collect(engine.step(observation(2)).deltas, texts)
    assert texts[first][-1].finish_reason in ("length", "eos")
    assert texts[second][-1].final and texts[second][-1].finish_reason != "refused"
    engine.close()


class TickingClock:
    """Deterministic clock: every reading advances time by ``tick`` seconds."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def test_deadline_mode_stops_decoding_before_the_deadline(policy):
    clock = TickingClock(0.001)
    engine = OxygenEngine(
        policy, EngineConfig(decode_mode="deadline", deadline_margin_ms=1.0), clock=clock
    )
    for _ in range(4):
        engine.submit("narration", sampling=SamplingParams(max_tokens=50))
    steps = []
    for f in range(6):
        start = clock()
        result = engine.step(observation(f), now=start, next_deadline=start + 0.040)
        assert result.stats.deadline_met, result.stats
        steps.append(result.stats.decode_steps)
    assert max(steps) >= 2  # the slack was used
    tight = engine.step(observation(9), now=clock(), next_deadline=clock() + 0.001)
    assert tight.stats.decode_steps == 0  # no slack: language waits, the action still came out
    assert tight.action is not None
    engine.close()


class ManualClock:
    """A clock that only moves when the test moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_deadline_mode_steps_the_oldest_requests_that_fit_when_all_do_not(policy, monkeypatch):
    clock = ManualClock()
    engine = OxygenEngine(
        policy,
        EngineConfig(decode_mode="deadline", deadline_margin_ms=1.0, max_active_requests=4),
        clock=clock,
    )
    real_step = engine.decoder.step

    def step_costing(requests):  # a decode step takes 1 ms + 1 ms per request
        clock.now += 0.001 * (1 + len(requests))
        return real_step(requests)

    monkeypatch.setattr(engine.decoder, "step", step_costing)
    engine.warm_up(observation(0))  # times batch 1, 2 and 4 before any frame
    assert engine.timer.measured_sizes() == [1, 2, 4]
    assert engine.timer.estimate(2) == pytest.approx(0.003) and engine.timer.estimate(
        4
    ) == pytest.approx(0.005)
    # warm-up leaves no trace
    assert engine.memory()["bytes_in_use"] == 0 and engine.memory()["peak_bytes"] == 0
    ids = [engine.submit("narration", sampling=SamplingParams(max_tokens=50)) for _ in range(4)]
    engine.step(observation(1))  # no deadline: all four admitted
    assert engine.active_requests == 4

    # 4.5 ms of slack with a 1 ms margin: batch 4 (5 ms) does not fit, batch 2 (3 ms) does.
    result = engine.step(observation(2), now=clock(), next_deadline=clock() + 0.0045)
    assert result.stats.decode_steps == 1 and result.stats.tokens == 2
    assert sorted(d.request_id for d in result.deltas) == ids[:2]  # the oldest two
    assert result.stats.deadline_met
    # With no slack at all nothing runs, and the requests left behind are not lost.
    starved = engine.step(observation(3), now=clock(), next_deadline=clock() + 0.0015)
    assert starved.stats.decode_steps == 0 and engine.active_requests == 4
    engine.close()


def test_step_cost_is_keyed_by_batch_and_context_and_unmeasured_keys_are_bounded_from_above():
    timer = StepTimer(context_step=128)
    assert timer.estimate(4, 100) == 0.0  # nothing measured yet
    timer.record(4, 0.002, context=100)  # key (4, 128)
    timer.record(4, 0.004, context=1000)  # key (4, 1024)
    assert timer.measured_sizes() == [4] and timer.measured_keys() == [(4, 128), (4, 1024)]
    assert timer.estimate(4, 1000) == pytest.approx(0.004) and timer.estimate(
        4, 100
    ) == pytest.approx(0.002)
    assert timer.estimate(4, 1000) > timer.estimate(4, 100)  # same batch, longer contexts: dearer
    # (4, 512): (4, 128) scaled x4 in context = 8 ms, (4, 1024) as it is = 4 ms -> 4 ms
    assert timer.estimate(4, 500) == pytest.approx(0.004)
    # (8, 128): (4, 128) x2 in batch = 4 ms; (4, 1024) x2 = 8 ms -> 4 ms
    assert timer.estimate(8, 10) == pytest.approx(0.004)
    # (2, 2048): (4, 128) x16 in context = 32 ms; (4, 1024) x2 = 8 ms -> 8 ms
    assert timer.estimate(2, 2000) == pytest.approx(0.008)
    timer.record(4, 0.006, context=1000)  # EMA, alpha 0.2: 4 + 0.2 * (6 - 4) = 4.4 ms
    assert timer.estimate(4, 1024) == pytest.approx(0.0044)


def test_fixed_mode_with_a_deadline_skips_the_steps_that_do_not_fit(policy, monkeypatch):
    clock = ManualClock()
    engine = OxygenEngine(
        policy,
        EngineConfig(decode_mode="fixed", decode_steps_per_frame=5, deadline_margin_ms=1.0),
        clock=clock,
    )
    real_step = engine.decoder.step

    def step_costing(requests):  # every decode step takes 2 ms
        clock.now += 0.002
        return real_step(requests)

    monkeypatch.setattr(engine.decoder, "step", step_costing)
    engine.warm_up(observation(0))
    engine.submit("narration", sampling=SamplingParams(max_tokens=50))
    engine.step(observation(1))  # no deadline: admitted, then exactly k = 5 steps
    assert engine.decode_steps == 1 + 5 and engine.fixed_steps_skipped == 0
    # 5.5 ms of slack, 1 ms margin: steps end at 2 and 4 ms; a third would end at 6 + 1 > 5.5
    result = engine.step(observation(2), now=clock(), next_deadline=clock() + 0.0055)
    assert (
        result.stats.decode_steps == 2
        and engine.fixed_steps_skipped == 3
        and result.stats.deadline_met
    )
    # without a deadline: the paper's exact k
    assert engine.step(observation(3)).stats.decode_steps == 5
    engine.close()


def test_admission_is_estimated_by_its_own_cost_not_by_a_decode_step(policy, monkeypatch):
    clock = ManualClock()
    engine = OxygenEngine(
        policy, EngineConfig(decode_mode="deadline", deadline_margin_ms=1.0), clock=clock
    )
    real_attach, real_step = engine.decoder.attach, engine.decoder.step

    def attach_costing(requests, frame):  # an admission prefill takes 10 ms
        clock.now += 0.010
        return real_attach(requests, frame)

    def step_costing(requests):  # a decode step 1 ms
        clock.now += 0.001
        return real_step(requests)

    monkeypatch.setattr(engine.decoder, "attach", attach_costing)
    monkeypatch.setattr(engine.decoder, "step", step_costing)
    engine.warm_up(observation(0))
    prompt = len(policy.tokenizer.encode_text("\nNarrate: "))
    assert engine.admission_timer.estimate(1, prompt) == pytest.approx(0.010)
    assert engine.timer.estimate(1, 1) == pytest.approx(0.001)
    engine.submit("narration", sampling=SamplingParams(max_tokens=50))
    # 10 + 1 ms do not fit in 5
    engine.step(observation(1), now=clock(), next_deadline=clock() + 0.005)
    assert engine.queued_requests == 1 and engine.active_requests == 0
    engine.step(observation(2), now=clock(), next_deadline=clock() + 0.020)
    assert engine.queued_requests == 0 and engine.active_requests == 1
    engine.close()


def count_prefills(policy, monkeypatch) -> list[int]:
    calls: list[int] = []
    real = policy.model.prefill

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(policy.model, "prefill", counting)
    return calls


@pytest.mark.parametrize(
    "name, expected", [("oxygen", 1), ("shared-kv", 1), ("isolated-sequential", 4)]
)
def test_prefills_per_frame(policy, monkeypatch, name, expected):
    engine = make_engine(name, policy, FIXED)
    for _ in range(3):
        engine.submit("narration", sampling=SamplingParams(max_tokens=2))
    calls = count_prefills(policy, monkeypatch)
    engine.step(observation(0))
    engine.close()
    assert len(calls) == expected


def test_requests_share_the_frame_prefix_without_copies(policy):
    engine = OxygenEngine(policy, FIXED)
    engine.step(observation(0))
    prefix_bytes = engine.memory()["bytes_in_use"]
    for _ in range(3):
        engine.submit("narration", sampling=SamplingParams(max_tokens=8))
    engine.decode(max_steps=1)
    frame_segment = engine._frame.segment
    assert all(r.prefix is frame_segment for r in engine._active)
    assert frame_segment.ref_count == 4  # engine + three requests, one copy of the bytes
    own = sum(engine.pool.segment_bytes(r.own) for r in engine._active)
    assert engine.memory()["bytes_in_use"] == prefix_bytes + own
    engine.close()
    assert engine.memory()["bytes_in_use"] == 0


def test_stop_strings_cut_the_text(policy):
    engine = OxygenEngine(policy, FIXED)
    engine.step(observation(0))
    free_run = {}
    request = engine.submit("narration", sampling=SamplingParams(max_tokens=12))
    collect(engine.decode(max_steps=20), free_run)
    full = tokens_of(free_run[request])
    stop = full.strip()[:2]
    assert stop, f"need some text to stop on, got {full!r}"
    stopped = {}
    request = engine.submit("narration", sampling=SamplingParams(max_tokens=12, stop=(stop,)))
    collect(engine.decode(max_steps=20), stopped)
    text = tokens_of(stopped[request])
    assert text.endswith(stop) and stop not in text[: -len(stop)]
    assert stopped[request][-1].finish_reason == "stop"
    engine.close()


def test_temperature_sampling_is_reproducible_per_seed(policy):
    def sample(seed: int) -> str:
        engine = OxygenEngine(policy, FIXED)
        engine.step(observation(0))
        out: dict[int, list[TextDelta]] = {}
        rid = engine.submit(
            "narration", sampling=SamplingParams(max_tokens=10, temperature=1.0, seed=seed)
        )
        collect(engine.decode(max_steps=20), out)
        engine.close()
        return tokens_of(out[rid])

    assert sample(1) == sample(1)
    assert len({sample(s) for s in range(4)}) > 1


def test_requests_without_any_decode_slack_are_finished_as_stalled(policy):
    clock = TickingClock(0.001)
    config = EngineConfig(decode_mode="deadline", max_stall_frames=3)
    engine = OxygenEngine(policy, config, clock=clock)
    engine.submit("narration", sampling=SamplingParams(max_tokens=50))
    engine.step(observation(0))  # no deadline: admitted, first token sampled
    assert engine.active_requests == 1
    finals = []
    for f in range(1, 6):  # every tick already past its deadline
        start = clock()
        result = engine.step(observation(f), now=start, next_deadline=start)
        assert result.action is not None
        finals += [d for d in result.deltas if d.final]
    assert [d.finish_reason for d in finals] == ["stalled"]
    assert finals[0].frame_id == 1 and "no decode slack" in finals[0].detail
    assert engine.active_requests == 0
    engine.close()
    assert engine.memory()["bytes_in_use"] == 0


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"decode_mode": "eager"}, "decode_mode must be"),
        ({"max_active_requests": 0}, "max_active_requests must be >= 1"),
        ({"num_steps": 0}, "num_steps must be >= 1"),
        ({"kv_capacity_tokens": -1}, "must be >= 0"),
        ({"kind_prompts": {}}, "at least one language kind"),
        ({"kind_prompts": {"narration": "  "}}, "must not be empty"),
    ],
)
def test_engine_config_rejects_bad_values_with_a_reason(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)
