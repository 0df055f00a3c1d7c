"""One tick of the node's loop, and the state the loop keeps between ticks.

    assemble the newest inputs -> act (ONE shared prefill + action expert) -> command (limits)
    -> publish the chunk -> submit questions / a due narration onto this frame
    -> decode language until the next tick -> publish text (Narration, texts, Ask feedback)
    -> record stats

Faults inside the engine are counted by kind and reported to the caller, which decides when a run
of failing ticks takes the node through the lifecycle error transition. Nothing here touches the
lifecycle or the timer directly: the node passes ``restart_timer`` and ``next_tick_time``.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from builtin_interfaces.msg import Time

from ..engine.counters import Counters
from ..engine.faults import FaultInjector
from ..engine.kv_cache import KVMemoryError
from ..engine.requests import SamplingParams
from ..engine.scheduler import OxygenEngine
from ..engine.switch_commit import SwitchCommitment
from ..engine.types import ActionChunk, Observation, TextDelta, WarmUpReport
from .ask_action import AskGoal, Question
from .commands import build_command, safety_filter
from .diagnostics import RateMeter, RollingWindow
from .observation import NS_PER_S, ObservationAssembler
from .outputs import Outputs, publish_cost
from .params import NodeSettings
from .rate_control import RateGovernor, TickCost
from .remote_engine import RemoteEngine, ServerUnavailable
from .safety import SafetyFilter, UnsafeChunkError
from .text_streams import LanguageStreams, PeriodicSchedule, PublishCost

MAX_PENDING_QUESTIONS = 32
Warn = Callable[[str, str], None]

_thread_state = threading.local()


class EngineFault(Exception):
    """An engine call failed in this tick (already counted and logged); the message says which."""


def use_torch_threads(count: int) -> None:
    """``torch.set_num_threads`` is per thread: apply it to the calling thread once."""
    if getattr(_thread_state, "torch_threads", None) != count:
        torch.set_num_threads(count)
        _thread_state.torch_threads = count


class TickLoop:
    """The loop's state and one tick (called with the engine lock held, from one thread)."""

    def __init__(
        self,
        counters: Counters,
        warn: Warn,
        log: Any,
        faults: FaultInjector,
        now_ns: Callable[[], int],
        restart_timer: Callable[[], None],
        next_tick_time: Callable[[float, float], float],
        rate_hz: float,
    ) -> None:
        self.counters, self._warn, self._log, self.faults = counters, warn, log, faults
        self._now_ns, self._restart_timer, self._next_tick_time = (
            now_ns,
            restart_timer,
            next_tick_time,
        )
        self.outputs: Outputs | None = None  # set while configured
        self.assembler: ObservationAssembler | None = None
        self.questions: collections.deque[Question] = collections.deque()
        self.asks: dict[int, AskGoal] = {}  # request id -> the Ask goal it answers
        self.streams = LanguageStreams()
        self.narration_due = PeriodicSchedule()
        self.governor = RateGovernor(rate_hz)
        self.warm_up_cost: TickCost | None = None  # of the configured engine
        self.publish_cost = PublishCost()
        self.action_ms, self.prefill_ms, self.tick_ms = (
            RollingWindow(),
            RollingWindow(),
            RollingWindow(),
        )
        self.frame_rate, self.token_rate = RateMeter(), RateMeter()
        self.ages: dict[str, float | None] = {}
        self.engine_stats: dict[str, int] = {}
        self.chunks_published = 0
        self.subtask_stats: dict[str, object] = {}  # the engine's subtask loop (empty without)
        self.server_stats: dict[str, object] = {}  # engine remote: the connection (else empty)
        self.restart_subtask = False  # set by ~/instruction: a new subtask from the next frame
        self._published_subtask: tuple[int, str] | None = None
        self.failing_ticks = 0  # consecutive ticks with an engine fault
        self._submitted = 0
        self._frame_stamp = Time()
        self._safety: tuple[NodeSettings, SafetyFilter] | None = None
        # gripper_commit: the switches kept, for the (dims, level, action_dt) they were kept with
        self._commitment: tuple[tuple, SwitchCommitment] | None = None
        self._shortened: tuple[Any, int] = (None, 0)  # (tokenizer, its tasks_shortened reported)

    # -- the tick ---------------------------------------------------------------------------------
    def run(self, engine: OxygenEngine, settings: NodeSettings, started: float) -> str | None:
        """One tick. Returns what failed inside the engine, None when every engine call
        succeeded."""
        use_torch_threads(settings.torch_threads)
        assembly = self.assembler.assemble(
            settings.task, settings.max_observation_age_s, self._now_ns()
        )
        self.ages = assembly.ages
        if self.restart_subtask:
            self.restart_subtask = False
            engine.restart_subtask()
        fault = None
        if assembly.observation is None:
            self.counters.add(f"no_action_{assembly.reason}")
            self._warn(f"no_action:{assembly.reason}", f"no action this tick: {assembly.detail}")
        else:
            try:
                if self._act(engine, settings, assembly.observation, assembly.stamp_ns, started):
                    action_s = time.monotonic() - started
                    self._submit_language(engine, settings, started)
                    self._adapt_rate(engine, settings, action_s)
            except EngineFault as exc:
                fault = str(exc)
            self._report_shortened_task(engine)
        deltas = self._cancelled(engine)
        decoded, decode_fault = self._decode(engine, started)
        self.publish_text(deltas + decoded, settings)
        self._publish_subtask(engine)
        self._record_engine_stats(engine)
        return fault or decode_fault

    def _act(
        self,
        engine: OxygenEngine,
        settings: NodeSettings,
        observation: Observation,
        stamp_ns: int,
        started: float,
    ) -> bool:
        """Shared prefill + action, limits, publish. Returns whether a new frame now exists.

        Raises:
            EngineFault: the engine failed (counted); the next tick retries.
        """
        try:
            engine.set_action_dt(settings.action_dt)  # a runtime change reaches RTC's delay
            chunk = engine.act(observation)
            if settings.inject_inference_delay_ms > 0:  # a slower model, for tests and benches
                time.sleep(settings.inject_inference_delay_ms * 1e-3)
        except ServerUnavailable as exc:  # engine remote: no reply in time, or no connection
            self.counters.add(f"no_action_server_{exc.reason}")
            self._warn(f"no_action:server_{exc.reason}", f"no action this tick: {exc}")
            return False
        except ValueError as exc:  # an observation the model cannot use: not the engine's failure
            self.counters.add("no_action_engine_rejected")
            self._warn(
                "no_action:engine_rejected",
                f"no action this tick: the model rejected the observation: {exc}",
            )
            return False
        except KVMemoryError as exc:
            self.counters.add("no_action_kv_memory")
            self._warn(
                "no_action:kv_memory", f"no action this tick: no KV memory for the frame: {exc}"
            )
            raise EngineFault(f"act: KVMemoryError: {exc}") from exc
        except Exception as exc:  # an internal fault (a CUDA error, an out-of-memory, a bug)
            self.counters.add("no_action_engine_error")
            self._warn(
                f"no_action:engine_error:{type(exc).__name__}",
                f"no action this tick: the engine failed: {type(exc).__name__}: {exc}\n"
                f"{traceback.format_exc()}",
            )
            raise EngineFault(f"act: {type(exc).__name__}: {exc}") from exc
        stamp = Time(sec=stamp_ns // NS_PER_S, nanosec=stamp_ns % NS_PER_S)
        self._frame_stamp = stamp
        self.action_ms.add(chunk.prefill_ms + chunk.action_ms)
        self.prefill_ms.add(chunk.prefill_ms)
        horizon = settings.action_horizon or engine.policy.published_horizon
        actions = self._keep_gripper_switches(settings, chunk.actions[:horizon], stamp_ns)
        try:
            command = build_command(
                settings,
                actions,
                observation.state,
                stamp,
                self.safety_filter(settings),
            )
        except UnsafeChunkError as exc:
            self.counters.add("non_finite_output")
            self._warn("unsafe_chunk", f"not publishing frame {chunk.frame_id}: {exc}")
            self._report_published(engine, chunk, None, stamp_ns)
            return True
        self._publish_chunk(settings, chunk, stamp, command, started)
        self._report_published(engine, chunk, command.actions, stamp_ns)
        return True

    def _report_published(
        self, engine: OxygenEngine, chunk: ActionChunk, actions: Any, stamp_ns: int
    ) -> None:
        """Tell the engine's RTC what the controller now executes (the published, limited chunk,
        or None: still the previous one) and the delay the robot saw: the observation's stamp to
        now, on the node's clock (its age at the tick + prefill + action + limits + publish)."""
        engine.chunk_published(chunk.frame_id, actions, (self._now_ns() - stamp_ns) / NS_PER_S)

    def _report_shortened_task(self, engine: OxygenEngine) -> None:
        """Count (``prompt_task_shortened``) and log, throttled, prompts whose task the tokenizer
        shortened to keep the robot state within ``max_token_len`` (a task refused at set time
        never gets here; one set before a stricter check, or a state needing more tokens than
        the set-time measure, can)."""
        tokenizer = engine.policy.tokenizer
        if tokenizer is None:  # engine remote: the server tokenizes
            return
        reported = self._shortened[1] if self._shortened[0] is tokenizer else 0
        new = tokenizer.tasks_shortened - reported
        if new <= 0:
            return
        self._shortened = (tokenizer, tokenizer.tasks_shortened)
        self.counters.add("prompt_task_shortened", new)
        last = tokenizer.last_shortened
        self._warn(
            "prompt:task_shortened",
            f"the task's prompt takes {last.prompt_tokens} tokens, more than the model's "
            f"max_token_len {last.max_len}: the model sees only the first {last.kept} of its "
            f"{last.task_tokens} task tokens (the robot state is kept whole); set a shorter task",
        )

    def _publish_chunk(
        self, settings: NodeSettings, chunk: ActionChunk, stamp: Time, command: Any, started: float
    ) -> None:
        published = time.monotonic()
        deadline_met = published - started <= self.governor.effective_period_s  # the loop's rate
        now_s = self._now_ns() / NS_PER_S
        age = now_s - chunk.stamp
        not_sent = self.outputs.publish_command(
            settings, chunk, stamp, command, (published - started) * 1e3, deadline_met, age, now_s
        )
        for name, rejected in not_sent:
            self.counters.add(f"trajectory_not_sent_{rejected.reason}")
            self._warn(
                f"trajectory_not_sent:{rejected.reason}",
                f"not publishing frame {chunk.frame_id}'s {name} trajectory: a stock "
                f"joint_trajectory_controller would reject it: {rejected}",
            )
        self.chunks_published += 1
        if command.clipped:
            self.counters.add("clipped_values", command.clipped)
        if not deadline_met:
            self.counters.add("deadline_misses")

    def _keep_gripper_switches(
        self, settings: NodeSettings, actions: np.ndarray, stamp_ns: int
    ) -> np.ndarray:
        """``actions`` with the gripper's planned switches kept (``gripper_commit``), else as
        they are; the switches the commitment made sooner than the chunk planned are counted."""
        if not settings.gripper_commit:
            self._commitment = None
            return actions
        key = (settings.gripper_dims, settings.gripper_switch_level, settings.action_dt)
        if self._commitment is None or self._commitment[0] != key:
            self._commitment = (key, SwitchCommitment(*key))
        commitment = self._commitment[1]
        before = commitment.switches
        kept = commitment.apply(actions, stamp_ns / NS_PER_S)
        if commitment.switches > before:
            self.counters.add("gripper_switches_kept", commitment.switches - before)
        return kept

    def forget_gripper_switches(self) -> None:
        """A new run: the switches kept for the last one no longer apply."""
        if self._commitment is not None:
            self._commitment[1].reset()

    def safety_filter(self, settings: NodeSettings) -> SafetyFilter:
        """The limits of ``settings`` (rebuilt only when the settings object changes)."""
        if self._safety is None or self._safety[0] is not settings:
            self._safety = (settings, safety_filter(settings))
        return self._safety[1]

    def _decode(self, engine: OxygenEngine, started: float) -> tuple[list[TextDelta], str | None]:
        """Language in the rest of the period: (the deltas, what failed or None).

        Publishing this tick's text is part of its budget, so decoding ends that much before the
        next tick; in decode_mode fixed, ``until`` bounds the k steps too.
        """
        until = (
            self._next_tick_time(started, self.governor.effective_period_s)
            - self.publish_cost.expected_s()
        )
        try:
            return engine.decode(until=until), None
        except Exception as exc:
            # the engine answers language faults with failed finals: this one escaped it
            self.counters.add("decode_errors")
            self._warn(
                f"decode:{type(exc).__name__}",
                f"language decoding failed this tick: {type(exc).__name__}: {exc}\n"
                f"{traceback.format_exc()}",
            )
            return [], f"decode: {type(exc).__name__}: {exc}"

    def _publish_subtask(self, engine: OxygenEngine) -> None:
        """A new current subtask (or none, after a task change) on ~/subtask."""
        loop = engine.subtasks
        if loop is None:
            return
        current = loop.current
        now = (current.text.subtask_id, current.text.text) if current else (0, "")
        if now == self._published_subtask or (self._published_subtask is None and not current):
            return
        self._published_subtask = now
        try:
            self.faults.check("text_publish")
            self.outputs.publish_subtask(now[1])
        except Exception as exc:  # rclpy (or an injected fault): lose this update, not the tick
            self.counters.add("text_publish_errors")
            self._warn(
                f"subtask_publish:{type(exc).__name__}",
                f"could not publish the subtask: {type(exc).__name__}: {exc}",
            )

    def _record_engine_stats(self, engine: OxygenEngine) -> None:
        memory = engine.memory()
        self.engine_stats = {
            "active_requests": engine.active_requests,
            "queued_requests": engine.queued_requests,
            "tokens_generated": engine.tokens_generated,
            "decode_steps": engine.decode_steps,
            **{f"kv_{key}": value for key, value in memory.items()},
            # the static path's health: captures inside a frame must stay 0
            "engine_captures_during_frames": engine.captures_during_frames,
            "engine_static_fallbacks": engine.static_fallbacks,
            "engine_fixed_steps_skipped": engine.fixed_steps_skipped,
            **{f"engine_faults {stage}": n for stage, n in engine.faults_by_stage.items()},
        }
        if engine.subtasks is not None:
            self.subtask_stats = engine.subtasks.stats(engine.clock())
        continuity = engine.continuity
        if continuity is not None:  # RTC: the delay it freezes, and trained-mode refusals
            self.engine_stats["engine_rtc_delay_steps"] = continuity.frozen_steps()
            self.engine_stats["engine_rtc_trained_fallbacks"] = continuity.trained_fallbacks
        self.server_stats = engine.server_stats() if isinstance(engine, RemoteEngine) else {}

    # -- language ---------------------------------------------------------------------------------
    def _submit_language(self, engine: OxygenEngine, settings: NodeSettings, now: float) -> None:
        """Submit queued questions and a due narration onto the frame just computed."""
        while self.questions:
            question = self.questions.popleft()
            if question.goal is not None and question.goal.cancel_requested:
                self.counters.add("ask_goals_cancelled")
                question.goal.cancel("cancelled before it was asked")
                continue
            request_id = self._submit(
                engine,
                "answer",
                question.text,
                question.token_budget(settings.answer_max_tokens),
                settings,
            )
            if question.goal is not None:
                self.asks[request_id] = question.goal
        if self.narration_due.due(now, settings.narration_period_s):
            self.narration_due.mark(now)
            if self.streams.busy("narration"):
                self.counters.add("narration_skipped_busy")
            else:
                self._submit(engine, "narration", "", settings.narration_max_tokens, settings)

    def _submit(
        self, engine: OxygenEngine, kind: str, text: str, max_tokens: int, settings: NodeSettings
    ) -> int:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=settings.temperature,
            seed=settings.seed + self._submitted,
        )
        self._submitted += 1
        request_id = engine.submit(kind, text, sampling)
        self.streams.opened(request_id, kind)
        return request_id

    def _cancelled(self, engine: OxygenEngine) -> list[TextDelta]:
        """The ``cancelled`` finals of Ask goals whose client cancelled (their KV is freed now)."""
        deltas = []
        for request_id, goal in list(self.asks.items()):
            if goal.cancel_requested:
                delta = engine.cancel(request_id)
                if delta is not None:
                    self.counters.add("ask_goals_cancelled")
                    deltas.append(delta)
        return deltas

    def publish_text(self, deltas: Sequence[TextDelta], settings: NodeSettings) -> None:
        """Publish each delta (and a finished request's full text, and Ask feedback); the cost feeds
        the language budget.

        A request's stream closes with its final delta before anything else is done with it, and
        whatever fails for one delta (counting, Ask feedback, publishing) loses only that delta:
        a final lost to a publishing failure (counted) never leaves its kind busy, and the deltas
        after it are still handled. (The engine gives every request one final delta — from
        ``decode``, which never raises for a language fault, ``cancel`` or ``close`` — so no stream
        needs a node-side timeout.)
        """
        started = time.monotonic()
        for delta in deltas:
            try:
                update = self.streams.update(delta, self._frame_stamp)
                if delta.final:
                    self._count_finish(delta)
                goal = (
                    self.asks.pop(delta.request_id, None)
                    if delta.final
                    else self.asks.get(delta.request_id)
                )
                if goal is not None:
                    goal.feed(delta)
                self.faults.check("text_publish")
                self.outputs.publish_delta(delta, update.stamp)
                if delta.final:
                    self.outputs.publish_finished(update.full_text, settings, update.stamp)
            except Exception as exc:  # rclpy (or an injected fault): lose this delta, not the tick
                self.counters.add("text_publish_errors")
                if delta.final:
                    self.counters.add("final_deltas_lost")
                self._warn(
                    f"text_publish:{type(exc).__name__}",
                    f"could not publish a text delta of {delta.kind} request {delta.request_id}"
                    f"{' (its final)' if delta.final else ''}: {type(exc).__name__}: {exc}",
                )
        self.publish_cost.record(len(deltas), time.monotonic() - started)

    def _count_finish(self, delta: TextDelta) -> None:
        self.counters.add("requests_finished")
        if delta.finish_reason in ("refused", "failed", "stalled"):
            self.counters.add(f"requests_{delta.finish_reason}")
            self._warn(
                f"{delta.finish_reason}:{delta.kind}",
                f"{delta.kind} request {delta.request_id} {delta.finish_reason}: {delta.detail}",
            )

    def finish_closed(self, deltas: Sequence[TextDelta]) -> None:
        """The engine was closed: count the requests it cancelled, end their Ask goals, forget every
        open stream (nothing is published; the publishers are going away)."""
        finals = [delta for delta in deltas if delta.final]
        if finals:
            self.counters.add("requests_cancelled_at_close", len(finals))
        for delta in finals:
            goal = self.asks.pop(delta.request_id, None)
            if goal is not None:
                goal.feed(delta)
        for goal in self.asks.values():  # no final came back for these
            goal.cancel("the engine was released")
        self.asks.clear()
        self.streams.clear()

    def drop_questions(self, why: str) -> None:
        """Questions still waiting when the node stops being active are dropped (counted); their
        Ask goals end as aborted with ``why``."""
        if self.questions:
            self.counters.add("ask_dropped_inactive", len(self.questions))
        while self.questions:
            question = self.questions.popleft()
            if question.goal is not None:
                question.goal.cancel(why)

    # -- rate -------------------------------------------------------------------------------------
    def cost_at_warm_up(
        self, settings: NodeSettings, engine: OxygenEngine, report: WarmUpReport
    ) -> TickCost:
        """The whole tick as warm-up measured it: the engine's part plus building and serialising
        what a tick publishes (a chunk, its trajectory, one text delta)."""
        horizon = settings.action_horizon or engine.policy.published_horizon
        chunk_s, delta_s = publish_cost(settings, horizon, self.safety_filter(settings))
        self.publish_cost.seed(delta_s)
        return TickCost(
            action_s=report.action_ms * 1e-3 + chunk_s,
            language_step_s=report.language_step_ms * 1e-3 + delta_s,
            margin_s=settings.decode_margin_ms * 1e-3,
        )

    def plan_rate(self, settings: NodeSettings) -> None:
        """Check ``rate_hz`` against the warm-up tick (a WARN when it cannot be held with room for
        language) and start the governor: at rate_hz, or with ``adapt`` at the rate that fits."""
        cost = self.warm_up_cost
        if cost is not None and settings.inject_inference_delay_ms > 0:
            # the injected delay is a slower model's: its ticks cost that much more from the start
            extra_s = settings.inject_inference_delay_ms * 1e-3
            cost = dataclasses.replace(cost, action_s=cost.action_s + extra_s)
        adapt = settings.overrun_policy == "adapt"
        holdable = cost.holdable_hz() if cost is not None else float("inf")
        feasible = holdable >= settings.rate_hz
        self.governor.reset(settings.rate_hz, adapt, start_hz=None if feasible else holdable)
        if not feasible:
            then = (
                f"overrun_policy adapt: replanning at {self.governor.effective_hz:g} Hz, back up "
                "to rate_hz when ticks get cheaper"
                if adapt
                else "overrun_policy skip: ticks will overrun and skip periods"
            )
            self._log.warning(
                f"rate_hz {settings.rate_hz:g} cannot be held with room for language: a tick costs "
                f"{cost.total_s * 1e3:.1f} ms at warm-up (prefill + action + publish "
                f"{cost.action_s * 1e3:.1f} ms, a language step {cost.language_step_s * 1e3:.1f} "
                f"ms, margin {cost.margin_s * 1e3:.1f} ms) of a {settings.period_s * 1e3:.1f} ms "
                f"period; about {holdable:.1f} Hz fits. {then}"
            )

    def _adapt_rate(self, engine: OxygenEngine, settings: NodeSettings, action_s: float) -> None:
        """Feed this tick's cost to the governor; a new effective rate restarts the timer
        (logged)."""
        cost = TickCost(
            action_s=action_s,
            language_step_s=engine.timer.estimate(1) + self.publish_cost.per_delta_s,
            margin_s=settings.decode_margin_ms * 1e-3,
        )
        previous = self.governor.effective_hz
        changed = self.governor.record(cost)
        if changed is None:
            return
        self.counters.add("rate_changes")
        direction = "lowered" if changed < previous else "raised"
        self._log.warning(
            f"replanning rate {direction} from {previous:g} to {changed:g} Hz (rate_hz "
            f"{settings.rate_hz:g}): recent ticks hold about {self.governor.holdable_hz:.1f} Hz "
            "with "
            f"room for language (this tick: action path {action_s * 1e3:.1f} ms, a language step "
            f"{cost.language_step_s * 1e3:.1f} ms)"
        )
        self._restart_timer()
