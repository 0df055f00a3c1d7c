"""The oxygen_ros node: cameras + joint states in; action chunks and streamed language out.

One managed (lifecycle) node runs the OxyGen loop on a timer at ``rate_hz``::

    tick:  latest inputs -> Observation -> engine.act (ONE shared prefill + action expert)
           -> safety limits -> publish JointTrajectory + ActionChunk        (the deadline-bound path)
           -> submit due narration / queued questions onto this frame
           -> engine.decode(until = next tick - margin) -> publish Narration deltas and full texts

Lifecycle: ``configure`` validates the parameters, loads the checkpoint, builds the engine and
warms it up (a failure is logged with its reason and leaves the node unconfigured and alive);
``activate`` starts the timer and output; ``deactivate`` stops them; ``cleanup``/``shutdown``
release the engine. With ``autostart`` (default) the node configures and activates itself.

Threads: :func:`main` spins a SingleThreadedExecutor. Sensor callbacks only store the newest message,
so they need not run during a tick: messages that arrive while the model runs are taken in the gap
before the next tick (the language budget ends ``decode_margin_ms`` early to leave that gap). On the
2-core reference machine a MultiThreadedExecutor made the model itself 2-15x slower (rclpy's executor
loop busy-waits and holds the GIL while the tick's callback group is busy), see ``main``. The
callback groups and the engine lock keep the node correct under a multi-threaded executor too
(e.g. in a composed process): ticks never overlap and transitions wait for a running tick.

Topics (``~`` = the node's name):
  in   <camera_topics>        sensor_msgs/Image | CompressedImage  (sensor-data QoS)
       joint_states           sensor_msgs/JointState               (sensor-data QoS)
       ~/instruction          std_msgs/String   sets the ``task`` parameter
       ~/ask                  std_msgs/String   asks a question (an ``answer`` request)
  out  ~/joint_trajectory     trajectory_msgs/JointTrajectory (not in dry_run)
       ~/action_chunk         oxygen_ros/ActionChunk
       ~/narration            oxygen_ros/Narration (every text delta)
       ~/narration_text       std_msgs/String ("[kind] full text" when a request finishes)
       /diagnostics           diagnostic_msgs/DiagnosticArray (1 Hz)

Start without launch: ``oxygen_node --ros-args --params-file config/oxygen.yaml``.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import rclpy
import torch
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.executors import ShutdownException, SingleThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.parameter import Parameter
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory

from oxygen_ros.msg import ActionChunk as ActionChunkMsg
from oxygen_ros.msg import Narration

from ..engine.requests import SamplingParams
from ..engine.scheduler import OxygenEngine
from ..engine.types import ActionChunk, Observation, TextDelta
from .convert import chunk_to_joint_trajectory
from .diagnostics import Counters, KeyedThrottle, RateMeter, RollingWindow, status
from .messages import action_chunk_msg, narration_msg
from .model_setup import check_fits_model, load_engine, warm_up
from .observation import JOINT_STATES_TOPIC, NS_PER_S, ObservationAssembler
from .params import (
    SPECS,
    NodeSettings,
    SettingsError,
    changed_configure_parameters,
    check_value,
    declare_parameters,
    normalise,
)
from .safety import SafetyFilter, UnsafeChunkError
from .text_streams import LanguageStreams, PeriodicSchedule

try:
    from rclpy.executors import ExternalShutdownException
except ImportError:  # rclpy releases that predate it end spin() with KeyboardInterrupt only
    class ExternalShutdownException(Exception):  # type: ignore[no-redef]
        """Stand-in; never raised."""

NODE_NAME = "oxygen_node"

# Cameras: newest frame only, lost frames are fine (best effort matches every publisher).
CAMERA_QOS = QoSProfile(
    history=HistoryPolicy.KEEP_LAST, depth=1,
    reliability=ReliabilityPolicy.BEST_EFFORT, durability=DurabilityPolicy.VOLATILE,
)
# Joint states: also latest-only, a few deep so a burst is not all lost before the store sees it.
JOINT_QOS = QoSProfile(
    history=HistoryPolicy.KEEP_LAST, depth=5,
    reliability=ReliabilityPolicy.BEST_EFFORT, durability=DurabilityPolicy.VOLATILE,
)
COMMAND_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)  # ~/ask, ~/instruction, outputs
TEXT_QOS = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)  # never drop a text delta
MAX_PENDING_QUESTIONS = 32
# Counters (see /diagnostics "counters") that mean something went wrong; the rest count normal events.
FAULT_COUNTER_PREFIXES = ("image_", "joint_", "no_action_", "tick_", "non_finite", "stale", "stamp_",
                          "duplicate", "deadline", "late_ticks", "requests_refused", "ask_rejected",
                          "instruction_rejected", "executor_errors")
LOG_THROTTLE_S = 5.0

_thread_state = threading.local()


def _use_torch_threads(count: int) -> None:
    """``torch.set_num_threads`` is per thread: apply it to the calling thread once."""
    if getattr(_thread_state, "torch_threads", None) != count:
        torch.set_num_threads(count)
        _thread_state.torch_threads = count


class OxygenNode(LifecycleNode):
    """pi0.5 actions and language from shared prefills (see the module docstring).

    Raises:
        SettingsError: a parameter override has the wrong type or is out of range.
    """

    def __init__(self, node_name: str = NODE_NAME, **kwargs: Any) -> None:
        super().__init__(node_name, **kwargs)
        declare_parameters(self)
        self._counters = Counters()
        self._throttle = KeyedThrottle(LOG_THROTTLE_S)
        self._engine_lock = threading.Lock()
        self._timer_lock = threading.Lock()
        self._engine: Optional[OxygenEngine] = None
        self._settings: Optional[NodeSettings] = None  # set while configured
        self._assembler: Optional[ObservationAssembler] = None
        self._safety: Optional[Tuple[NodeSettings, SafetyFilter]] = None  # limits of the settings it was built for
        self._timer = None
        self._active = False
        self._state_label = "unconfigured"
        self._last_error = ""
        self._subscriptions_io: List[Any] = []
        self._publishers_io: List[Any] = []
        self._trajectory_pub = self._chunk_pub = self._narration_pub = self._text_pub = None
        self._questions: Deque[str] = collections.deque()
        self._streams = LanguageStreams()
        self._narration_due = PeriodicSchedule()
        self._submitted = 0
        self._last_frame_stamp = Time()
        self._last_tick_start: Optional[float] = None
        self._chunks_published = 0
        self._action_ms = RollingWindow()
        self._prefill_ms = RollingWindow()
        self._tick_ms = RollingWindow()
        self._ages: Dict[str, Optional[float]] = {}
        self._engine_stats: Dict[str, int] = {}
        self._frame_rate = RateMeter()
        self._token_rate = RateMeter()
        self._previous_counts: Dict[str, int] = {}

        self._tick_group = MutuallyExclusiveCallbackGroup()
        self._input_group = MutuallyExclusiveCallbackGroup()
        self._diagnostics_group = MutuallyExclusiveCallbackGroup()
        self._diagnostics_pub = self.create_publisher(DiagnosticArray, "/diagnostics", COMMAND_QOS)
        self.create_timer(1.0, self._publish_diagnostics, callback_group=self._diagnostics_group)
        self.create_subscription(String, "~/instruction", self._on_instruction, COMMAND_QOS)
        self.create_subscription(String, "~/ask", self._on_ask, COMMAND_QOS)
        self.add_on_set_parameters_callback(self._on_set_parameters)

    # ----------------------------------------------------------------------------------------------
    # Start-up and shutdown
    # ----------------------------------------------------------------------------------------------
    @property
    def autostart(self) -> bool:
        return bool(self.get_parameter("autostart").value)

    @property
    def state_label(self) -> str:
        """unconfigured | inactive | active | finalized."""
        return self._state_label

    def start(self) -> bool:
        """Configure and activate (what ``autostart`` does); False when a transition failed."""
        if self.trigger_configure() != TransitionCallbackReturn.SUCCESS:
            return False
        return self.trigger_activate() == TransitionCallbackReturn.SUCCESS

    def release(self) -> None:
        """Stop the loop and free the engine (idempotent; used on exit)."""
        self._active = False
        self._stop_timer()
        self._teardown()

    # ----------------------------------------------------------------------------------------------
    # Lifecycle transitions
    # ----------------------------------------------------------------------------------------------
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        log = self.get_logger()
        try:
            settings = NodeSettings.from_values(self._parameter_values())
            engine = load_engine(settings, warn=log.warning, info=log.info)
            frame_ms = warm_up(engine, settings)
            with self._engine_lock:
                self._engine, self._settings = engine, settings
                self._build_io(settings)
        except Exception as exc:  # any failure leaves the node unconfigured and alive, saying why
            self._teardown()
            self._last_error = f"configure failed: {type(exc).__name__}: {exc}"
            log.error(self._last_error)
            log.debug(traceback.format_exc())
            return TransitionCallbackReturn.FAILURE
        self._last_error = ""
        log.info(f"configured: warm-up frame {frame_ms:.1f} ms at rate_hz {settings.rate_hz:g} "
                 f"(period {settings.period_s * 1e3:.1f} ms); cameras "
                 f"{[f'{c.topic}->{c.slot}' for c in settings.cameras]}")
        self._state_label = "inactive"
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        result = super().on_activate(state)  # enables the lifecycle publishers
        if result != TransitionCallbackReturn.SUCCESS:
            return result
        self._narration_due.reset()
        self._active = True
        self._start_timer()
        self._state_label = "active"
        self.get_logger().info("active: publishing action chunks")
        return TransitionCallbackReturn.SUCCESS

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._active = False
        self._stop_timer()
        with self._engine_lock:  # wait for a tick in progress to finish
            pass
        self._state_label = "inactive"
        self.get_logger().info("inactive: output stopped")
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._teardown()
        self._state_label = "unconfigured"
        return TransitionCallbackReturn.SUCCESS

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.release()
        self._state_label = "finalized"
        return TransitionCallbackReturn.SUCCESS

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.get_logger().error(f"error during a transition from {state.label}; releasing the engine")
        self.release()
        self._state_label = "unconfigured"
        return TransitionCallbackReturn.SUCCESS

    def _build_io(self, settings: NodeSettings) -> None:
        """Publishers and sensor subscriptions of a configured node."""
        self._assembler = ObservationAssembler(settings.cameras, settings.joint_names, self._counters, self._warn)
        self._assembler.set_reset_threshold(settings.max_observation_age_s)
        self._trajectory_pub = self.create_lifecycle_publisher(JointTrajectory, "~/joint_trajectory", COMMAND_QOS)
        self._chunk_pub = self.create_lifecycle_publisher(ActionChunkMsg, "~/action_chunk", COMMAND_QOS)
        self._narration_pub = self.create_lifecycle_publisher(Narration, "~/narration", TEXT_QOS)
        self._text_pub = self.create_lifecycle_publisher(String, "~/narration_text", COMMAND_QOS)
        self._publishers_io = [self._trajectory_pub, self._chunk_pub, self._narration_pub, self._text_pub]
        for cam in settings.cameras:
            self._subscriptions_io.append(self.create_subscription(
                CompressedImage if cam.compressed else Image, cam.topic, self._assembler.latest[cam.topic].store,
                CAMERA_QOS, callback_group=self._input_group))
        self._subscriptions_io.append(self.create_subscription(
            JointState, JOINT_STATES_TOPIC, self._assembler.latest[JOINT_STATES_TOPIC].store,
            JOINT_QOS, callback_group=self._input_group))

    def _teardown(self) -> None:
        """Destroy I/O and close the engine (the node returns to 'unconfigured')."""
        with self._engine_lock:
            for sub in self._subscriptions_io:
                self.destroy_subscription(sub)
            for pub in self._publishers_io:
                self.destroy_lifecycle_publisher(pub)
            self._subscriptions_io, self._publishers_io = [], []
            if self._engine is not None:
                self._engine.close()
            self._engine = None
            self._settings = None
            self._assembler = None
            self._streams.clear()

    # ----------------------------------------------------------------------------------------------
    # Timer
    # ----------------------------------------------------------------------------------------------
    def _start_timer(self) -> None:
        with self._timer_lock:
            if self._timer is not None:
                self.destroy_timer(self._timer)
            self._last_tick_start = None
            self._timer = self.create_timer(self._settings.period_s, self._on_tick, callback_group=self._tick_group)

    def _stop_timer(self) -> None:
        with self._timer_lock:
            if self._timer is not None:
                self.destroy_timer(self._timer)
                self._timer = None

    def _next_tick_time(self, started: float, period: float) -> float:
        """Monotonic time of the timer's next call (the language budget ends there)."""
        timer = self._timer
        until_next = timer.time_until_next_call() if timer is not None else None
        if until_next is None:
            return started + period
        return time.monotonic() + until_next * 1e-9

    # ----------------------------------------------------------------------------------------------
    # The tick
    # ----------------------------------------------------------------------------------------------
    def _on_tick(self) -> None:
        started = time.monotonic()
        settings = self._settings
        if settings is None:
            return
        self._note_tick_start(started, settings.period_s)
        try:
            with self._engine_lock:
                if self._engine is None or not self._active or self._settings is None:
                    return
                self._run_tick(self._engine, self._settings, started)
        except Exception as exc:  # the action loop must outlive any single failure
            self._counters.add("tick_exceptions")
            self._warn(f"tick:{type(exc).__name__}",
                       f"tick failed, the loop continues: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        finally:
            elapsed = time.monotonic() - started
            self._tick_ms.add(elapsed * 1e3)
            if elapsed > settings.period_s:
                self._counters.add("tick_overruns")

    def _note_tick_start(self, started: float, period: float) -> None:
        """Count ticks that start late and the periods skipped before them (rcl skips missed periods)."""
        last, self._last_tick_start = self._last_tick_start, started
        if last is None:
            return
        gap = started - last
        if gap > 1.5 * period:
            skipped = max(int(round(gap / period)) - 1, 1)
            self._counters.add("late_ticks")
            self._counters.add("skipped_periods", skipped)
            self._warn("tick:late", f"tick started {gap * 1e3:.1f} ms after the previous one "
                                    f"(period {period * 1e3:.1f} ms): {skipped} period(s) without a tick")

    def _run_tick(self, engine: OxygenEngine, settings: NodeSettings, started: float) -> None:
        _use_torch_threads(settings.torch_threads)
        assembly = self._assembler.assemble(settings.task, settings.max_observation_age_s,
                                            self.get_clock().now().nanoseconds)
        self._ages = assembly.ages
        if assembly.observation is None:
            self._counters.add(f"no_action_{assembly.reason}")
            self._warn(f"no_action:{assembly.reason}", f"no action this tick: {assembly.detail}")
        elif self._act(engine, settings, assembly.observation, assembly.stamp_ns, started):
            self._submit_language(engine, settings, started)
        deltas = engine.decode(until=self._next_tick_time(started, settings.period_s))
        self._publish_text(deltas)
        memory = engine.memory()
        self._engine_stats = {
            "active_requests": engine.active_requests,
            "queued_requests": engine.queued_requests,
            "tokens_generated": engine.tokens_generated,
            "decode_steps": engine.decode_steps,
            **{f"kv_{key}": value for key, value in memory.items()},
        }

    def _act(self, engine: OxygenEngine, settings: NodeSettings, observation: Observation, stamp_ns: int,
             started: float) -> bool:
        """Shared prefill + action, limits, publish. Returns whether a new frame now exists."""
        try:
            chunk = engine.act(observation)
        except ValueError as exc:  # an observation the model cannot use
            self._counters.add("no_action_engine_rejected")
            self._warn("no_action:engine_rejected", f"no action this tick: the model rejected the observation: {exc}")
            return False
        stamp = Time(sec=stamp_ns // NS_PER_S, nanosec=stamp_ns % NS_PER_S)
        self._last_frame_stamp = stamp
        self._action_ms.add(chunk.prefill_ms + chunk.action_ms)
        self._prefill_ms.add(chunk.prefill_ms)
        horizon = settings.action_horizon or chunk.actions.shape[0]
        current = observation.state[list(settings.action_joint_indices)]
        try:
            safe = self._safety_filter(settings).apply(chunk.actions[:horizon], current, settings.action_dt)
        except UnsafeChunkError as exc:
            self._counters.add("non_finite_output")
            self._warn("unsafe_chunk", f"not publishing frame {chunk.frame_id}: {exc}")
            return True
        self._publish_chunk(settings, chunk, stamp, safe.actions, safe.clipped, started)
        return True

    def _publish_chunk(self, settings: NodeSettings, chunk: ActionChunk, stamp: Time, actions, clipped: int,
                       started: float) -> None:
        trajectory = None
        if not settings.dry_run:
            trajectory = chunk_to_joint_trajectory(actions, settings.action_joint_names, settings.action_dt, stamp)
        published = time.monotonic()
        deadline_met = published - started <= settings.period_s
        message = action_chunk_msg(
            stamp=stamp, frame_id=chunk.frame_id, joint_names=settings.action_joint_names, actions=actions,
            dt=settings.action_dt, observation_age=self._now() - chunk.stamp, prefill_ms=chunk.prefill_ms,
            action_ms=chunk.action_ms, frame_ms=(published - started) * 1e3, deadline_met=deadline_met,
            clipped_values=clipped,
        )
        if trajectory is not None:
            self._trajectory_pub.publish(trajectory)
        self._chunk_pub.publish(message)
        self._chunks_published += 1
        if clipped:
            self._counters.add("clipped_values", clipped)
        if not deadline_met:
            self._counters.add("deadline_misses")

    def _safety_filter(self, settings: NodeSettings) -> SafetyFilter:
        """The limits of ``settings`` (rebuilt only when the settings object changes)."""
        if self._safety is None or self._safety[0] is not settings:
            self._safety = (settings, SafetyFilter(
                len(settings.action_joint_names), settings.joint_lower_limits, settings.joint_upper_limits,
                settings.max_joint_velocity))
        return self._safety[1]

    # ----------------------------------------------------------------------------------------------
    # Language
    # ----------------------------------------------------------------------------------------------
    def _submit_language(self, engine: OxygenEngine, settings: NodeSettings, now: float) -> None:
        """Submit queued questions and a due narration onto the frame just computed."""
        while self._questions:
            question = self._questions.popleft()
            self._submit(engine, "answer", question, settings.answer_max_tokens, settings)
        if self._narration_due.due(now, settings.narration_period_s):
            self._narration_due.mark(now)
            if self._streams.busy("narration"):
                self._counters.add("narration_skipped_busy")
            else:
                self._submit(engine, "narration", "", settings.narration_max_tokens, settings)

    def _submit(self, engine: OxygenEngine, kind: str, text: str, max_tokens: int, settings: NodeSettings) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=settings.temperature,
                                  seed=settings.seed + self._submitted)
        self._submitted += 1
        self._streams.opened(engine.submit(kind, text, sampling), kind)

    def _publish_text(self, deltas: Sequence[TextDelta]) -> None:
        for delta in deltas:
            update = self._streams.update(delta, self._last_frame_stamp)
            self._narration_pub.publish(narration_msg(delta, update.stamp))
            if not delta.final:
                continue
            self._counters.add("requests_finished")
            if delta.finish_reason == "refused":
                self._counters.add("requests_refused")
                self._warn(f"refused:{delta.kind}", f"{delta.kind} request {delta.request_id} refused: {delta.detail}")
            self._text_pub.publish(String(data=update.full_text))

    def _on_ask(self, msg: String) -> None:
        question = msg.data.strip()
        if not question:
            self._counters.add("ask_rejected")
            self._warn("ask:empty", "ignoring an empty question on ~/ask")
            return
        if len(self._questions) >= MAX_PENDING_QUESTIONS:
            self._counters.add("ask_rejected")
            self._warn("ask:full", f"ignoring a question on ~/ask: {MAX_PENDING_QUESTIONS} are already waiting")
            return
        self._questions.append(question)

    def _on_instruction(self, msg: String) -> None:
        result = self.set_parameters([Parameter("task", Parameter.Type.STRING, msg.data.strip())])[0]
        if not result.successful:
            self._counters.add("instruction_rejected")
            self._warn("instruction", f"ignoring ~/instruction {msg.data!r}: {result.reason}")
        else:
            self.get_logger().info(f"task is now {msg.data.strip()!r}")

    # ----------------------------------------------------------------------------------------------
    # Parameters
    # ----------------------------------------------------------------------------------------------
    def _parameter_values(self) -> Dict[str, Any]:
        return {name: self.get_parameter(name).value for name in SPECS}

    def _on_set_parameters(self, parameters: List[Parameter]) -> SetParametersResult:
        """Reject invalid values with a reason; apply valid run-time changes at once."""
        changes = {p.name: p.value for p in parameters if p.name in SPECS}
        try:
            for name, value in changes.items():
                check_value(name, value)
            settings = self._settings
            if settings is None:  # unconfigured: consistency is checked by configure
                return SetParametersResult(successful=True)
            current = self._parameter_values()
            late = [name for name in changed_configure_parameters(list(changes))
                    if normalise(name, changes[name]) != normalise(name, current[name])]
            if late:
                raise SettingsError(
                    f"{', '.join(late)} can only change while the node is unconfigured (it is {self._state_label}): "
                    "deactivate and clean up, set them, then configure again"
                )
            updated = NodeSettings.from_values({**current, **changes})
            engine = self._engine
            if engine is not None:
                check_fits_model(updated, engine.policy)
        except SettingsError as exc:
            return SetParametersResult(successful=False, reason=str(exc))
        self._apply(updated, settings)
        return SetParametersResult(successful=True)

    def _apply(self, settings: NodeSettings, previous: NodeSettings) -> None:
        self._settings = settings
        if self._assembler is not None:
            self._assembler.set_reset_threshold(settings.max_observation_age_s)
        if settings.rate_hz != previous.rate_hz and self._timer is not None:
            self._start_timer()
            self.get_logger().info(f"rate_hz is now {settings.rate_hz:g}")

    # ----------------------------------------------------------------------------------------------
    # Diagnostics and logging
    # ----------------------------------------------------------------------------------------------
    def _now(self) -> float:
        return self.get_clock().now().nanoseconds * 1e-9

    def record_executor_error(self, exc: BaseException) -> None:
        """An error raised inside the executor itself (e.g. rclpy failing to take a message): counted
        and logged; the caller keeps spinning, so the action loop outlives it."""
        self._counters.add("executor_errors")
        self._warn(f"executor:{type(exc).__name__}", f"executor error, spinning on: {type(exc).__name__}: {exc}")

    def _warn(self, key: str, message: str) -> None:
        """A warning throttled per key (topic and reason), telling how many were held back."""
        allowed, held = self._throttle.allow(key)
        if allowed:
            suffix = f" [{held} similar message(s) suppressed in the last {LOG_THROTTLE_S:g} s]" if held else ""
            self.get_logger().warning(message + suffix)

    def _publish_diagnostics(self) -> None:
        try:
            self._diagnostics_pub.publish(self._diagnostics())
        except Exception as exc:  # diagnostics must not take the node down either
            self._warn("diagnostics", f"could not publish diagnostics: {type(exc).__name__}: {exc}")

    def _diagnostics(self) -> DiagnosticArray:
        settings = self._settings
        counters = self._counters.snapshot()
        engine = self._engine_stats
        frame_rate = self._frame_rate.rate(self._chunks_published)
        token_rate = self._token_rate.rate(engine.get("tokens_generated", 0))
        misses = counters.get("deadline_misses", 0)
        new = {key: n - self._previous_counts.get(key, 0) for key, n in counters.items()
               if n > self._previous_counts.get(key, 0)}
        self._previous_counts = counters
        new_misses = new.get("deadline_misses", 0)
        new_faults = sorted(key for key in new if key.startswith(FAULT_COUNTER_PREFIXES))
        action_p50, action_p99 = self._action_ms.percentiles(50, 99)
        prefill_p50, prefill_p99 = self._prefill_ms.percentiles(50, 99)
        (tick_p99,) = self._tick_ms.percentiles(99)
        name = self.get_fully_qualified_name().lstrip("/")

        if self._last_error:
            level, summary = DiagnosticStatus.ERROR, self._last_error
        elif self._state_label != "active":
            level, summary = DiagnosticStatus.OK, f"{self._state_label}: no output"
        elif frame_rate == 0.0:
            level, summary = DiagnosticStatus.WARN, "active but no action chunk in the last second"
        elif new_misses:
            level, summary = DiagnosticStatus.WARN, f"{new_misses} deadline miss(es) in the last second"
        else:
            level, summary = DiagnosticStatus.OK, f"{frame_rate:.1f} Hz"
        loop = {
            "state": self._state_label,
            "rate_hz": settings.rate_hz if settings else 0.0,
            "frame_rate_hz": frame_rate,
            "chunks_published": self._chunks_published,
            "deadline_misses": misses,
            "tick_overruns": counters.get("tick_overruns", 0),
            "late_ticks": counters.get("late_ticks", 0),
            "action_latency_p50_ms": action_p50,
            "action_latency_p99_ms": action_p99,
            "prefill_ms_p50": prefill_p50,
            "prefill_ms_p99": prefill_p99,
            "tick_ms_p99": tick_p99,
            "dry_run": bool(settings.dry_run) if settings else False,
            "task": settings.task if settings else "",
            "last_error": self._last_error,
        }
        language = {
            "tokens_per_s": token_rate,
            "active_requests": engine.get("active_requests", 0),
            "queued_requests": engine.get("queued_requests", 0),
            "questions_waiting": len(self._questions),
            "tokens_generated": engine.get("tokens_generated", 0),
            "decode_steps": engine.get("decode_steps", 0),
            "requests_finished": counters.get("requests_finished", 0),
            "requests_refused": counters.get("requests_refused", 0),
        }
        memory = {key: value for key, value in engine.items() if key.startswith("kv_")}
        inputs: Dict[str, object] = {}
        assembler = self._assembler
        if assembler is not None:
            for topic, latest in assembler.latest.items():
                age = self._ages.get(topic)
                inputs[f"input_age_s {topic}"] = "never" if age is None else age
                inputs[f"received {topic}"] = latest.received
            for topic, count in assembler.masked_ticks.items():
                inputs[f"masked_ticks {topic}"] = count
        array = DiagnosticArray()
        array.header.stamp = self.get_clock().now().to_msg()
        array.status = [
            status(f"{name}: action loop", "oxygen_ros", level, summary, loop),
            status(f"{name}: language", "oxygen_ros", DiagnosticStatus.OK, f"{token_rate:.1f} tok/s", language),
            status(f"{name}: kv memory", "oxygen_ros", DiagnosticStatus.OK,
                   f"{memory.get('kv_bytes_in_use', 0)} bytes in use", memory),
            status(f"{name}: inputs", "oxygen_ros", DiagnosticStatus.OK,
                   f"{len(assembler.latest) if assembler else 0} topics", inputs),
            status(f"{name}: counters", "oxygen_ros",
                   DiagnosticStatus.WARN if new_faults else DiagnosticStatus.OK,
                   f"in the last second: {', '.join(new_faults)}" if new_faults else "no new faults", counters),
        ]
        return array


def spin_forever(executor: SingleThreadedExecutor, on_error: Callable[[Exception], None]) -> None:
    """``executor.spin()`` that survives errors raised inside rclpy's executor (seen once under CI
    load: a subscription message rclpy could not take); ``on_error`` reports them, spinning goes on.

    Returns when the context shuts down or the executor does. (A shut-down executor holds no nodes
    and its ``spin_once`` returns at once, so without that check this would busy-loop.)
    """
    while rclpy.ok(context=executor.context) and executor.get_nodes():
        try:
            executor.spin_once(timeout_sec=0.1)
        except (KeyboardInterrupt, ExternalShutdownException):
            raise
        except ShutdownException:  # the executor itself was shut down
            return
        except Exception as exc:  # noqa: BLE001 - the node must keep its action loop alive
            if not rclpy.ok(context=executor.context):
                return  # errors from callbacks torn down by shutdown
            on_error(exc)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``oxygen_node``: run until SIGINT/SIGTERM; returns the exit status.

    ``argv`` is a full command line like ``sys.argv`` (program name first, ROS arguments after
    ``--ros-args``); the default is ``sys.argv``.
    """
    args = list(sys.argv if argv is None else argv)
    from .cli_help import help_requested, print_help  # help is printed before rclpy.init
    if help_requested(args):
        return print_help()
    rclpy.init(args=args)
    try:
        node = OxygenNode()
    except SettingsError as exc:
        print(f"oxygen_node: {exc}", file=sys.stderr)
        rclpy.try_shutdown()
        return 2
    # Single-threaded on purpose (measured on 2 cores, tiny model, 30 Hz, bag replayed at 1x):
    # SingleThreadedExecutor: model p50 18 ms / p99 27 ms, no deadline misses; MultiThreadedExecutor
    # with 4 threads: p50 30 ms / p99 93 ms, a third of the ticks late; with 2 threads: p50 260 ms.
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    try:
        if node.autostart and not node.start():
            node.get_logger().error("autostart failed; the node stays up (fix the parameters, then configure "
                                    "and activate it through its lifecycle services)")
        spin_forever(executor, node.record_executor_error)
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    finally:
        node.release()
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
