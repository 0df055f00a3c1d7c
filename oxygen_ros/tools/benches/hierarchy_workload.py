"""``oxygen-bench hierarchy``'s three ways to run pi0.5 on the same frames:

* ``none``: no subtask, openpi's action prompt: one prefill and one chunk per frame;
* ``per_call``: the published way (openpi PR #942): every frame prefills the subtask prompt,
  decodes the subtask greedily to its eos, then re-prefills the conditioned prompt and acts; the
  chunk waits for all of it;
* ``oxygen``: the subtask loop (``same_frame``): a subtask decoded in the slack before each
  deadline every ``subtask_period_s``, every chunk conditioned on the newest one by appending its
  ids on the frame's shared prefix.

The *action path* of a frame is the time from its start to its chunk: prefill + chunk (and in
``per_call`` the subtask decode before them). A subtask's *staleness* is the time between the start
of the frame it was decoded from and the start of the frame whose chunk it conditions (0 in
``per_call``: every chunk's subtask comes from its own frame).
"""

from __future__ import annotations

import dataclasses
import gc
import time

import numpy as np

from oxygen_ros.engine import EngineConfig, OxygenEngine
from oxygen_ros.engine.base import make_pool, make_runner, new_request, subtask_token_limit
from oxygen_ros.engine.frames import act_on_frame, frame_noise, prefill_frame
from oxygen_ros.engine.language import LanguageDecoder
from oxygen_ros.engine.metrics import percentile
from oxygen_ros.engine.requests import LanguageRequest, SamplingParams
from oxygen_ros.engine.types import Observation
from oxygen_ros.policy_io.policy import Pi05Policy
from oxygen_ros.policy_io.prompts import FramePrompt, SubtaskText

MODES = ("none", "per_call", "oxygen")


@dataclasses.dataclass
class ModeSamples:
    """What one mode's frames measured."""

    action_ms: list[float] = dataclasses.field(default_factory=list)
    staleness_ms: list[float] = dataclasses.field(default_factory=list)
    subtask_ids: list[int] = dataclasses.field(default_factory=list)
    subtask_tokens: list[int] = dataclasses.field(default_factory=list)
    tokens: int = 0
    wall_s: float = 0.0

    def summary(self) -> dict[str, float]:
        ids = self.subtask_ids
        first = next((i for i, s in enumerate(ids) if s), None)
        after = ids[first:] if first is not None else []
        stale = self.staleness_ms
        return {
            "frames": len(self.action_ms),
            "frames_per_s": 1e3 / float(np.mean(self.action_ms)),
            "p50_action_ms": percentile(self.action_ms, 50),
            "p99_action_ms": percentile(self.action_ms, 99),
            "wall_frames_per_s": len(self.action_ms) / self.wall_s,
            "tokens_per_s": self.tokens / self.wall_s,
            "staleness_p50_ms": percentile(stale, 50) if stale else 0.0,
            "staleness_p99_ms": percentile(stale, 99) if stale else 0.0,
            "subtasks": len({s for s in ids if s}),
            "conditioned_after_first": (sum(1 for s in after if s) / len(after)) if after else 0.0,
            "mean_subtask_tokens": float(np.mean(self.subtask_tokens))
            if self.subtask_tokens
            else 0.0,
        }


class NoneMode:
    """No subtask: openpi's action prompt."""

    def __init__(self, policy: Pi05Policy, config: EngineConfig) -> None:
        plain = dataclasses.replace(config, prompt_format="openpi", subtask_conditioning="none")
        self.engine = OxygenEngine(policy, plain)

    def frame(self, observation: Observation, samples: ModeSamples) -> None:
        chunk = self.engine.act(observation)
        samples.action_ms.append(chunk.prefill_ms + chunk.action_ms)
        samples.subtask_ids.append(0)

    @property
    def static_fallbacks(self) -> int:
        return self.engine.static_fallbacks

    def close(self) -> None:
        self.engine.close()


class PerCallMode:
    """openpi PR #942's way: decode, re-prefill, act, every frame (on the same static / CUDA-graph
    paths as the engines when the config asks for them)."""

    def __init__(self, policy: Pi05Policy, config: EngineConfig) -> None:
        self.policy, self.config = policy, config
        self.pool = make_pool(policy, config)
        self.runner = make_runner(policy, self.pool, config)
        self.decoder = LanguageDecoder(policy, self.pool, self.runner)
        self.frame_id = 0

    def _subtask_request(self, observation: Observation) -> LanguageRequest:
        longest = self.policy.longest_prompt(
            observation.prompt, len(observation.state), self.config.format, True
        )
        limit = subtask_token_limit(self.policy, self.config, longest)
        return new_request(
            self.policy,
            self.config,
            self.frame_id,
            "subtask",
            sampling=SamplingParams(max_tokens=limit),
            task=observation.prompt,
        )

    def warm_up(self, observation: Observation) -> None:
        """Capture the static buckets its frames use (no-op on the eager paths), then freeze."""
        if self.runner is None:
            return
        full = self.policy.frame_prompt(
            observation.state, observation.prompt, self.config.format, True
        )
        request = self._subtask_request(observation)
        attach = len(request.prompt) + int(request.reads_shared)
        self.runner.warm_up(
            observation,
            num_steps=self.config.num_steps,
            max_batch=1,
            text_tokens=attach + request.sampling.max_tokens,
            attach_tokens=(attach,),
            prompt_lengths=(full.shared, self.policy.config.max_token_len),
        )
        self.runner.freeze()

    @property
    def static_fallbacks(self) -> int:
        return self.runner.fallbacks if self.runner is not None else 0

    def frame(self, observation: Observation, samples: ModeSamples) -> None:
        policy, cfg, fmt, runner = self.policy, self.config, self.config.format, self.runner
        self.frame_id += 1
        start = time.perf_counter()
        full = policy.frame_prompt(observation.state, observation.prompt, fmt, True)
        shared = FramePrompt(full.ids[: full.shared], full.shared)  # "...;\nSubtask: "
        frame = prefill_frame(policy, self.pool, observation, self.frame_id, runner, prompt=shared)
        request = self._subtask_request(observation)
        steps = self.decoder.run_to_completion(request, frame, [])
        self.pool.release(frame.segment)
        subtask = SubtaskText(tuple(request.tokens), request.text, self.frame_id)
        prompt = policy.frame_prompt(observation.state, observation.prompt, fmt, True, subtask)
        frame = prefill_frame(policy, self.pool, observation, self.frame_id, runner, prompt=prompt)
        noise = frame_noise(policy.config, cfg.seed, self.frame_id, policy.device)
        actions = act_on_frame(policy, self.pool, frame, noise, cfg.num_steps, runner)
        policy.robot_actions(actions, observation.state)
        self.pool.release(frame.segment)
        samples.action_ms.append((time.perf_counter() - start) * 1e3)
        samples.subtask_ids.append(self.frame_id)
        samples.subtask_tokens.append(len(request.tokens))
        samples.staleness_ms.append(0.0)
        samples.tokens += steps

    def close(self) -> None:
        pass


class PausableClock:
    """``time.perf_counter`` that stands still while paused: the oxygen engine's subtask ages do
    not count the time the other modes' frames take."""

    def __init__(self) -> None:
        self._paused_at: float | None = None
        self._offset = 0.0

    def __call__(self) -> float:
        now = self._paused_at if self._paused_at is not None else time.perf_counter()
        return now - self._offset

    def pause(self) -> None:
        self._paused_at = time.perf_counter()

    def resume(self) -> None:
        if self._paused_at is not None:
            self._offset += time.perf_counter() - self._paused_at
            self._paused_at = None


class OxygenMode:
    """The subtask loop: subtasks in the slack, every chunk conditioned (same_frame)."""

    def __init__(self, policy: Pi05Policy, config: EngineConfig, period_s: float) -> None:
        self.clock = PausableClock()
        self.engine = OxygenEngine(
            policy, dataclasses.replace(config, subtask_conditioning="same_frame"), self.clock
        )
        self.period_s = period_s

    def frame(self, observation: Observation, samples: ModeSamples) -> None:
        engine = self.engine
        start = engine.clock()
        tokens = engine.tokens_generated
        result = engine.step(observation, now=start, next_deadline=start + self.period_s)
        chunk = result.action
        samples.action_ms.append(chunk.prefill_ms + chunk.action_ms)
        samples.subtask_ids.append(chunk.subtask_id)
        if chunk.subtask_id:
            samples.staleness_ms.append(chunk.subtask_age_s * 1e3)
        samples.tokens += engine.tokens_generated - tokens
        for delta in result.deltas:
            if delta.kind == "subtask" and delta.final and delta.finish_reason in ("eos", "length"):
                samples.subtask_tokens.append(delta.token_count)

    @property
    def static_fallbacks(self) -> int:
        return self.engine.static_fallbacks

    def close(self) -> None:
        self.engine.close()


def run_hierarchy(
    policy: Pi05Policy,
    observations: list[Observation],
    config: EngineConfig,
    frames: int,
    warmup: int,
    period_s: float | None,
) -> tuple[dict[str, dict[str, float]], float]:
    """Each mode on the same frames, interleaved frame by frame (none, per_call, oxygen on one
    observation, then the next, the order rotating so that no mode always follows the same one),
    so that drifting machine speed hits all alike. ``period_s``: the oxygen loop's tick period
    (None: twice the none mode's median action path, measured in its warm-up). Returns the
    summaries by mode and the period used."""
    none = NoneMode(policy, config)
    per_call = PerCallMode(policy, config)
    modes: dict[str, NoneMode | PerCallMode | OxygenMode] = {"none": none, "per_call": per_call}
    try:
        none.engine.warm_up(observations[0])
        probe = ModeSamples()
        for i in range(max(warmup, 3)):
            none.frame(observations[i % len(observations)], probe)
        per_call.warm_up(observations[0])
        for i in range(warmup):
            per_call.frame(observations[i % len(observations)], ModeSamples())
        period = period_s or 2e-3 * float(np.median(probe.action_ms))
        oxygen = modes["oxygen"] = OxygenMode(policy, config, period)
        oxygen.engine.warm_up(observations[0])
        for i in range(warmup):
            oxygen.frame(observations[i % len(observations)], ModeSamples())
        oxygen.clock.pause()  # its subtask ages count its own frames only
        samples = {name: ModeSamples() for name in MODES}
        gc.collect()
        for i in range(frames):
            observation = observations[i % len(observations)]
            turn = i % len(MODES)  # each mode takes each place in turn
            for name in MODES[turn:] + MODES[:turn]:
                mode, target = modes[name], samples[name]
                if mode is oxygen:
                    oxygen.clock.resume()
                start = time.perf_counter()
                mode.frame(observation, target)
                target.wall_s += time.perf_counter() - start
                if mode is oxygen:
                    oxygen.clock.pause()
        # frame steps that found no captured static bucket (0 on the eager paths)
        summaries = {
            name: samples[name].summary() | {"static_fallbacks": modes[name].static_fallbacks}
            for name in MODES
        }
        return summaries, period
    finally:
        for mode in modes.values():
            mode.close()
