"""Benchmark workloads over the engines: synthetic observations, the paper's frame loop, a paced
real-time loop, and isolated component timings. Used by ``oxygen-bench`` and the GPU script."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from oxygen_ros.engine import EngineBase, EngineConfig, OxygenEngine
from oxygen_ros.engine.base import new_request
from oxygen_ros.engine.frames import act_on_frame, frame_noise, prefill_frame
from oxygen_ros.engine.language import LanguageDecoder
from oxygen_ros.engine.metrics import percentile
from oxygen_ros.engine.requests import SamplingParams
from oxygen_ros.engine.types import Observation
from oxygen_ros.model.config import IMAGE_SLOTS
from oxygen_ros.policy_io.policy import Pi05Policy


def synthetic_observations(
    cameras: int, count: int = 8, state_dim: int = 7, size: int = 224, seed: int = 0
) -> list[Observation]:
    """A short loop of different frames: a bright square moving over noise, per camera."""
    if not 1 <= cameras <= len(IMAGE_SLOTS):
        raise ValueError(f"cameras must be 1..{len(IMAGE_SLOTS)}, got {cameras}")
    rng = np.random.default_rng(seed)
    frames = []
    for i in range(count):
        images = {}
        for c, slot in enumerate(IMAGE_SLOTS[:cameras]):
            image = rng.integers(0, 64, (size, size, 3), dtype=np.uint8)
            x = (i * 17 + c * 50) % (size - 40)
            image[60:100, x : x + 40] = (255, 40 * c, 0)
            images[slot] = image
        frames.append(
            Observation(
                images, rng.uniform(-1, 1, state_dim), "pick up the red cup", stamp=float(i)
            )
        )
    return frames


@dataclasses.dataclass
class Workload:
    frames: int = 50
    # unmeasured frames after `EngineBase.warm_up`: the request batch reaches steady state
    warmup: int = 10
    requests_per_frame: float = 1.0
    max_tokens: int = 30
    kind: str = "narration"


def submit_due(
    engine: EngineBase, due: float, workload: Workload, submitted: list[int] | None = None
) -> float:
    """Submit this frame's share of ``workload.requests_per_frame``; returns the carried fraction.
    The new request ids are appended to ``submitted`` when given."""
    due += workload.requests_per_frame
    while due >= 1.0:
        request_id = engine.submit(
            workload.kind, sampling=SamplingParams(max_tokens=workload.max_tokens)
        )
        if submitted is not None:
            submitted.append(request_id)
        due -= 1.0
    return due


@dataclasses.dataclass
class FrameSamples:
    """What `measure_frames` saw on one engine; samples of several rounds merge into one."""

    frame_ms: list[float] = dataclasses.field(default_factory=list)
    active: list[int] = dataclasses.field(default_factory=list)  # active requests after each frame
    wall_s: float = 0.0
    tokens: int = 0
    peak_kv_bytes: int = 0

    def merge(self, other: FrameSamples) -> None:
        self.frame_ms += other.frame_ms
        self.active += other.active
        self.wall_s += other.wall_s
        self.tokens += other.tokens
        self.peak_kv_bytes = max(self.peak_kv_bytes, other.peak_kv_bytes)

    def summary(self) -> dict[str, float]:
        """Frames/s, tokens/s, frame latency percentiles, peak KV and batch sizes."""
        fps = len(self.frame_ms) / self.wall_s
        return {
            "frames_per_s": fps,
            "action_hz": fps,  # a fresh observation, prefill and chunk every frame
            "paper_action_hz": 10 * fps,  # the paper's metric: a 10-step chunk executed per frame
            "tokens_per_s": self.tokens / self.wall_s,
            "p50_frame_ms": percentile(self.frame_ms, 50),
            "p99_frame_ms": percentile(self.frame_ms, 99),
            "mean_frame_ms": float(np.mean(self.frame_ms)),
            "peak_kv_bytes": self.peak_kv_bytes,
            "mean_active_requests": float(np.mean(self.active)),
            "max_active_requests": int(max(self.active)),
        }


def measure_frames(
    engine: EngineBase, observations: list[Observation], workload: Workload
) -> FrameSamples:
    """The paper's loop: frames back to back, a new request every 1/rate frames, measured after
    warm-up."""
    engine.warm_up(observations[0])  # as the node does: CUDA graphs captured, decode sizes timed
    due = 0.0
    samples = FrameSamples()
    start = tokens0 = 0.0
    for i in range(workload.warmup + workload.frames):
        if i == workload.warmup:
            gc.collect()
            start, tokens0 = time.perf_counter(), engine.tokens_generated
        due = submit_due(engine, due, workload)
        result = engine.step(observations[i % len(observations)])
        if i >= workload.warmup:
            samples.frame_ms.append(result.stats.frame_ms)
            samples.active.append(result.stats.active_requests)
    samples.wall_s = time.perf_counter() - start
    samples.tokens = engine.tokens_generated - tokens0
    samples.peak_kv_bytes = engine.memory()["peak_bytes"]
    return samples


def run_frames(
    engine: EngineBase, observations: list[Observation], workload: Workload
) -> dict[str, float]:
    """`measure_frames`, summarised."""
    return measure_frames(engine, observations, workload).summary()


AfterPart = Callable[[str, FrameSamples], None]
"""Called after each engine's part of a round with the engine name and that part's samples."""


def compare_engines(
    make: Callable[[str], EngineBase],
    names: Sequence[str],
    observations: list[Observation],
    workload: Workload,
    rounds: int = 1,
    after_part: AfterPart | None = None,
) -> tuple[dict[str, dict[str, float]], dict[str, str]]:
    """Every engine on the same workload, in ``rounds`` interleaved rounds: each round gives each
    engine a fresh instance, its warm-up and its share of the frames, in an order rotated per
    round. A machine whose speed drifts (shared CPUs) then slows every engine alike, so the ratios
    hold even when absolute numbers move. Returns (summary per engine, error per failed engine).
    """
    # frames rounded up
    per_round = dataclasses.replace(workload, frames=-(-workload.frames // rounds))
    samples: dict[str, FrameSamples] = {name: FrameSamples() for name in names}
    errors: dict[str, str] = {}
    for r in range(rounds):
        for name in [*names[r % len(names) :], *names[: r % len(names)]]:
            if name in errors:
                continue
            try:  # one engine failing (e.g. on a new GPU) must not cost the others' numbers
                engine = make(name)
                try:
                    part = measure_frames(engine, observations, per_round)
                finally:
                    engine.close()
            except Exception as exc:  # noqa: BLE001 - reported by the caller
                errors[name] = f"{type(exc).__name__}: {exc}"
                continue
            samples[name].merge(part)
            if after_part is not None:
                after_part(name, part)
    return {name: s.summary() for name, s in samples.items() if name not in errors}, errors


def run_realtime(
    engine: EngineBase, observations: list[Observation], workload: Workload, rate_hz: float
) -> dict[str, float]:
    """A paced loop like the node's timer: ticks every 1/rate_hz s, language only in the slack.

    A tick that starts late (the previous one overran) counts as a miss; the schedule then
    restarts from now instead of bursting to catch up.
    """
    # as the node does: no capture inside a tick, decode sizes timed
    engine.warm_up(observations[0])
    period = 1.0 / rate_hz
    due = 0.0
    frame_ms: list[float] = []
    active: list[int] = []
    misses = late_starts = 0
    next_tick = time.perf_counter()
    start = tokens0 = 0.0
    for i in range(workload.warmup + workload.frames):
        now = time.perf_counter()
        if now < next_tick:
            time.sleep(next_tick - now)
        tick = time.perf_counter()
        if i == workload.warmup:
            start, tokens0, misses, late_starts = tick, engine.tokens_generated, 0, 0
            frame_ms, active = [], []
        if tick - next_tick > 0.5e-3:
            late_starts += 1
        due = submit_due(engine, due, workload)
        result = engine.step(
            observations[i % len(observations)], now=tick, next_deadline=tick + period
        )
        frame_ms.append(result.stats.frame_ms)
        active.append(result.stats.active_requests)
        misses += not result.stats.deadline_met
        next_tick = max(tick + period, time.perf_counter() - period / 2)
    wall = time.perf_counter() - start
    return {
        "target_hz": rate_hz,
        "frames_per_s": workload.frames / wall,
        "p50_frame_ms": percentile(frame_ms, 50),
        "p99_frame_ms": percentile(frame_ms, 99),
        "deadline_misses": misses,
        "late_starts": late_starts,
        "tokens_per_s": (engine.tokens_generated - tokens0) / wall,
        "mean_active_requests": float(np.mean(active)),
        "max_active_requests": int(max(active)),
        "peak_kv_bytes": engine.memory()["peak_bytes"],
    }


def _sync(policy: Pi05Policy) -> None:
    if policy.device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(fn, policy: Pi05Policy, repeats: int) -> list[float]:
    fn()  # warm
    out = []
    for _ in range(repeats):
        _sync(policy)
        t = time.perf_counter()
        fn()
        _sync(policy)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def component_times(
    policy: Pi05Policy,
    config: EngineConfig,
    observation: Observation,
    batch: int,
    repeats: int = 20,
) -> dict[str, float]:
    """Prefill, action chunk, admitting one request and one decode step at ``batch`` requests, each
    timed alone (median ms).

    The decode step reads ``batch`` requests spread over two frame prefixes with ~15 own tokens,
    like the paper workload's steady state.
    """
    engine = OxygenEngine(policy, config)
    engine.warm_up(observation)  # buckets captured and frozen, as in a real run
    # runner: the static paths when the config asks for them
    pool, runner = (
        engine.pool,
        engine.runner,
    )
    frames = [prefill_frame(policy, pool, observation, i, runner) for i in range(2)]
    noise = frame_noise(policy.config, 0, 0, policy.device)
    prefill = time_ms(
        lambda: pool.release(prefill_frame(policy, pool, observation, 9, runner).segment),
        policy,
        repeats,
    )
    action = time_ms(
        lambda: act_on_frame(policy, pool, frames[0], noise, config.num_steps, runner),
        policy,
        repeats,
    )
    decoder = LanguageDecoder(policy, pool, runner)
    requests = []
    for i in range(max(batch, 1)):
        request = new_request(policy, config, i + 1, "narration", "", SamplingParams(max_tokens=64))
        decoder.attach([request], frames[i % 2])
        requests.append(request)
    for _ in range(12):  # some own tokens, as mid-generation (max_tokens 64 is never reached)
        decoder.step(requests)
    step = time_ms(lambda: decoder.step(requests), policy, repeats)

    def admit_one() -> None:
        request = new_request(policy, config, 0, "narration", "", SamplingParams(max_tokens=64))
        decoder.attach([request], frames[0])
        decoder.release(request)

    admit = time_ms(admit_one, policy, repeats)
    for request in requests:
        decoder.release(request)
    for frame in frames:
        pool.release(frame.segment)
    engine.close()
    return {
        "prefill_ms": float(np.median(prefill)),
        "action_ms": float(np.median(action)),
        "admit_ms": float(np.median(admit)),  # prefilling one new request's kind text on the prefix
        "decode_step_ms": float(np.median(step)),
    }


def weight_bytes(policy: Pi05Policy) -> int:
    return sum(p.numel() * p.element_size() for p in policy.model.parameters())
