"""The oxygen_ros node: cameras + joint states in; action chunks and streamed language out.

One managed (lifecycle) node runs the OxyGen loop on a timer at ``rate_hz``::

    tick:  latest inputs -> Observation -> engine.act (ONE shared prefill + action expert)
           -> safety limits -> publish JointTrajectory + ActionChunk        (the deadline-bound path)
           -> submit due narration / queued questions onto this frame
           -> engine.decode(until = next tick - expected publish time) -> publish Narration deltas
              and full texts (the engine keeps decode_margin_ms free before ``until``)

Clocks: the loop's timing is steady time (``time.monotonic``): the tick timer, the language
budget ``until``, deadlines and overruns, because computing takes real time whatever the ROS clock
says. Stamps and ages are ROS time (the node clock, simulated with ``use_sim_time``): chunks carry
their observation's header stamp, inputs age against the node clock. A rosbag replayed with
``--clock`` thus drives ages and stamps while the loop keeps its real-time rate.

Faults: an engine call that fails in a tick is counted by kind (``no_action_engine_rejected`` for an
observation the model cannot use, ``no_action_kv_memory``, ``no_action_engine_error``,
``decode_errors``) and the next tick retries. After ``max_consecutive_failures`` failing ticks in a
row the node reports ERROR on /diagnostics and takes the lifecycle error transition (the engine is
released, the node ends unconfigured, ``last_error`` says why) instead of looping dead.

Rate: warm-up at configure measures a whole tick; when ``rate_hz`` cannot be held with room for a
language step the node says so once. With ``overrun_policy: adapt`` (default) the timer runs at the
rate the measured tick cost allows and climbs back to ``rate_hz`` when the cost falls (see
:mod:`.rate_control`); deadlines count against that effective rate. ``skip`` keeps ``rate_hz``.

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
  out  ~/joint_trajectory     trajectory_msgs/JointTrajectory (not in dry_run, never for robot libero)
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

import numpy as np
import rclpy
import torch
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.executors import ShutdownException, SingleThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.parameter import Parameter
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from rclpy.serialization import serialize_message
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory

from oxygen_ros.msg import ActionChunk as ActionChunkMsg
from oxygen_ros.msg import Narration

from ..engine.faults import NO_FAULTS, FaultInjector
from ..engine.kv_cache import KVMemoryError
from ..engine.requests import SamplingParams
from ..engine.scheduler import OxygenEngine
from ..engine.types import ActionChunk, Observation, TextDelta
from .commands import Command, build_command, safety_filter
from .diagnostics import Counters, KeyedThrottle, RateMeter, RollingWindow, status
from .messages import action_chunk_msg, narration_msg
from .model_setup import WarmUpTimes, check_fits_model, load_engine, warm_up
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
from .rate_control import RateGovernor, TickCost
from .safety import SafetyFilter, UnsafeChunkError
from .text_streams import LanguageStreams, PeriodicSchedule, PublishCost

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
COMMAND_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)  # ~/ask, ~/instruction, records
TEXT_QOS = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)  # never drop a text delta
# Commands to a controller (~/joint_trajectory): ros2_control's JointTrajectoryController subscribes
# with the system-default QoS (reliable, volatile in every RMW); a reliable, volatile publisher
# matches it, and a keep-last depth of 1 means only the newest trajectory is ever waiting to be
# delivered: a stale one is replaced, never queued behind a fresh one.
TRAJECTORY_QOS = QoSProfile(
    history=HistoryPolicy.KEEP_LAST, depth=1,
    reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.VOLATILE,
)
MAX_PENDING_QUESTIONS = 32
# Beyond the engine's own limits (queued max_wait_frames, then stalled max_stall_frames) a request
# without a final delta is lost: the node finishes it as failed.
EXPIRY_SLACK_TICKS = 10
# Counters (see /diagnostics "counters") that mean something went wrong; the rest count normal events.
FAULT_COUNTER_PREFIXES = ("image_", "joint_", "no_action_", "tick_", "non_finite", "stale", "stamp_",
                          "duplicate", "deadline", "late_ticks", "requests_refused", "requests_failed",
                          "requests_stalled", "ask_rejected", "ask_dropped", "instruction_rejected",
                          "executor_errors", "decode_errors", "text_publish_errors", "final_deltas_lost",
                          "streams_expired", "engine_close_errors", "error_transitions")
LOG_THROTTLE_S = 5.0

_thread_state = threading.local()


class _EngineFault(Exception):
    """An engine call failed in this tick (already counted and logged); the message says which."""


def _use_torch_threads(count: int) -> None:
    """``torch.set_num_threads`` is per thread: apply it to the calling thread once."""
    if getattr(_thread_state, "torch_threads", None) != count:
        torch.set_num_threads(count)
        _thread_state.torch_threads = count


class OxygenNode(LifecycleNode):
    """pi0.5 actions and language from shared prefills (see the module docstring).

    ``faults`` injects failures into the node's own stages (``text_publish``), for tests.

    Raises:
        SettingsError: a parameter override has the wrong type or is out of range.
    """

    def __init__(self, node_name: str = NODE_NAME, *, faults: FaultInjector = NO_FAULTS, **kwargs: Any) -> None:
        super().__init__(node_name, **kwargs)
        declare_parameters(self)
        self.faults = faults
        self._steady_clock = Clock(clock_type=ClockType.STEADY_TIME)  # the loop's timers (see Clocks)
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
        self._governor = RateGovernor(float(self.get_parameter("rate_hz").value))
        self._warm_up_cost: Optional[TickCost] = None  # of the configured engine
        self._publish_cost = PublishCost()
        self._failing_ticks = 0  # consecutive ticks with an engine fault
        self._erroring = False  # the error transition is under way

        self._tick_group = MutuallyExclusiveCallbackGroup()
        self._input_group = MutuallyExclusiveCallbackGroup()
        self._diagnostics_group = MutuallyExclusiveCallbackGroup()
        self._diagnostics_pub = self.create_publisher(DiagnosticArray, "/diagnostics", COMMAND_QOS)
        self.create_timer(1.0, self._publish_diagnostics, callback_group=self._diagnostics_group,
                          clock=self._steady_clock)
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
            times = warm_up(engine, settings)
            with self._engine_lock:
                self._engine, self._settings = engine, settings
                self._build_io(settings)
            self._warm_up_cost = self._tick_cost_at_warm_up(settings, times)
        except Exception as exc:  # any failure leaves the node unconfigured and alive, saying why
            self._teardown()
            self._last_error = f"configure failed: {type(exc).__name__}: {exc}"
            log.error(self._last_error)
            log.debug(traceback.format_exc())
            return TransitionCallbackReturn.FAILURE
        self._last_error = ""
        self._failing_ticks = 0
        cost = self._warm_up_cost
        log.info(f"configured: warm-up tick {cost.total_s * 1e3:.1f} ms (prefill + action + publish "
                 f"{cost.action_s * 1e3:.1f} ms, a language step {cost.language_step_s * 1e3:.1f} ms, margin "
                 f"{cost.margin_s * 1e3:.1f} ms) at rate_hz {settings.rate_hz:g} (period "
                 f"{settings.period_s * 1e3:.1f} ms); cameras {[f'{c.topic}->{c.slot}' for c in settings.cameras]}")
        self._plan_rate(settings)
        self._state_label = "inactive"
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        result = super().on_activate(state)  # enables the lifecycle publishers
        if result != TransitionCallbackReturn.SUCCESS:
            return result
        self._narration_due.reset()
        self._failing_ticks = 0
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
        self._drop_questions()
        if self._erroring:  # on to on_error (see _fail)
            return TransitionCallbackReturn.ERROR
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
        """Release the engine and end unconfigured, saying why (``last_error``, /diagnostics ERROR)."""
        self._erroring = False
        self._last_error = self._last_error or f"a transition from {state.label} failed"
        self._counters.add("error_transitions")
        self.get_logger().error(f"error transition from {state.label}: {self._last_error}; releasing the engine. "
                                "Configure the node again once the cause is fixed.")
        self.release()
        self._state_label = "unconfigured"
        self._publish_diagnostics()  # at once, not at the next 1 Hz tick
        return TransitionCallbackReturn.SUCCESS

    def _fail(self, reason: str) -> None:
        """Leave 'active' through the lifecycle's error transition (deactivate -> ERROR -> on_error)."""
        self._last_error = reason
        self._erroring = True
        self.get_logger().error(reason)
        self.trigger_deactivate()
        if self._erroring:  # the transition could not start (the node was no longer active)
            self._erroring = False

    def _build_io(self, settings: NodeSettings) -> None:
        """Publishers and sensor subscriptions of a configured node."""
        self._assembler = ObservationAssembler(settings.cameras, settings.joint_names, self._counters, self._warn)
        self._assembler.set_reset_threshold(settings.max_observation_age_s)
        self._trajectory_pub = self.create_lifecycle_publisher(JointTrajectory, "~/joint_trajectory", TRAJECTORY_QOS)
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
                try:
                    self._engine.close()
                except Exception as exc:  # a broken engine must not keep the node from releasing it
                    self._counters.add("engine_close_errors")
                    self.get_logger().error(f"closing the engine failed: {type(exc).__name__}: {exc}")
            self._engine = None
            self._settings = None
            self._assembler = None
            self._warm_up_cost = None
            self._streams.clear()
        self._drop_questions()

    # ----------------------------------------------------------------------------------------------
    # Timer
    # ----------------------------------------------------------------------------------------------
    def _start_timer(self) -> None:
        with self._timer_lock:
            if self._timer is not None:
                self.destroy_timer(self._timer)
            self._last_tick_start = None
            self._timer = self.create_timer(self._governor.effective_period_s, self._on_tick,
                                            callback_group=self._tick_group, clock=self._steady_clock)

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
        period = self._governor.effective_period_s
        self._note_tick_start(started, period)
        try:
            with self._engine_lock:
                if self._engine is None or not self._active or self._settings is None:
                    return
                fault = self._run_tick(self._engine, self._settings, started)
        except Exception as exc:  # the action loop must outlive any single failure
            self._counters.add("tick_exceptions")
            fault = f"{type(exc).__name__}: {exc}"
            self._warn(f"tick:{type(exc).__name__}",
                       f"tick failed, the loop continues: {fault}\n{traceback.format_exc()}")
        finally:
            elapsed = time.monotonic() - started
            self._tick_ms.add(elapsed * 1e3)
            if elapsed > period:
                self._counters.add("tick_overruns")
        self._count_failures(fault, settings)

    def _count_failures(self, fault: Optional[str], settings: NodeSettings) -> None:
        """A tick whose engine calls all succeeded ends a run of failing ticks; a long run takes the
        node through the error transition."""
        if fault is None:
            self._failing_ticks = 0
            return
        self._failing_ticks += 1
        if self._failing_ticks >= settings.max_consecutive_failures:
            self._fail(f"{self._failing_ticks} consecutive ticks failed inside the engine (max_consecutive_failures "
                       f"{settings.max_consecutive_failures}); last: {fault}")

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

    def _run_tick(self, engine: OxygenEngine, settings: NodeSettings, started: float) -> Optional[str]:
        """One tick. Returns what failed inside the engine, None when every engine call succeeded."""
        _use_torch_threads(settings.torch_threads)
        assembly = self._assembler.assemble(settings.task, settings.max_observation_age_s,
                                            self.get_clock().now().nanoseconds)
        self._ages = assembly.ages
        fault = None
        if assembly.observation is None:
            self._counters.add(f"no_action_{assembly.reason}")
            self._warn(f"no_action:{assembly.reason}", f"no action this tick: {assembly.detail}")
        else:
            try:
                if self._act(engine, settings, assembly.observation, assembly.stamp_ns, started):
                    action_s = time.monotonic() - started
                    self._submit_language(engine, settings, started)
                    self._adapt_rate(engine, settings, action_s)
            except _EngineFault as exc:
                fault = str(exc)
        deltas, decode_fault = self._decode(engine, started)
        self._publish_text(deltas + self._expired(engine))
        self._record_engine_stats(engine)
        return fault or decode_fault

    def _decode(self, engine: OxygenEngine, started: float) -> Tuple[List[TextDelta], Optional[str]]:
        """Language in the rest of the period: (the deltas, what failed or None).

        Publishing this tick's text is part of its budget, so decoding ends that much before the next
        tick; in decode_mode fixed, ``until`` bounds the k steps too.
        """
        until = self._next_tick_time(started, self._governor.effective_period_s) - self._publish_cost.expected_s()
        try:
            return engine.decode(until=until), None
        except Exception as exc:  # the engine answers language faults with failed finals; this is worse
            self._counters.add("decode_errors")
            self._warn(f"decode:{type(exc).__name__}", f"language decoding failed this tick: {type(exc).__name__}: "
                                                       f"{exc}\n{traceback.format_exc()}")
            return [], f"decode: {type(exc).__name__}: {exc}"

    def _record_engine_stats(self, engine: OxygenEngine) -> None:
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
        """Shared prefill + action, limits, publish. Returns whether a new frame now exists.

        Raises:
            _EngineFault: the engine failed (counted); the next tick retries.
        """
        try:
            chunk = engine.act(observation)
        except ValueError as exc:  # an observation the model cannot use: not the engine's failure
            self._counters.add("no_action_engine_rejected")
            self._warn("no_action:engine_rejected", f"no action this tick: the model rejected the observation: {exc}")
            return False
        except KVMemoryError as exc:
            self._counters.add("no_action_kv_memory")
            self._warn("no_action:kv_memory", f"no action this tick: no KV memory for the frame: {exc}")
            raise _EngineFault(f"act: KVMemoryError: {exc}") from exc
        except Exception as exc:  # an internal fault (a CUDA error, an out-of-memory, a bug)
            self._counters.add("no_action_engine_error")
            self._warn(f"no_action:engine_error:{type(exc).__name__}",
                       f"no action this tick: the engine failed: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            raise _EngineFault(f"act: {type(exc).__name__}: {exc}") from exc
        stamp = Time(sec=stamp_ns // NS_PER_S, nanosec=stamp_ns % NS_PER_S)
        self._last_frame_stamp = stamp
        self._action_ms.add(chunk.prefill_ms + chunk.action_ms)
        self._prefill_ms.add(chunk.prefill_ms)
        horizon = settings.action_horizon or chunk.actions.shape[0]
        try:
            command = build_command(settings, chunk.actions[:horizon], observation.state, stamp,
                                    self._safety_filter(settings))
        except UnsafeChunkError as exc:
            self._counters.add("non_finite_output")
            self._warn("unsafe_chunk", f"not publishing frame {chunk.frame_id}: {exc}")
            return True
        self._publish_chunk(settings, chunk, stamp, command, started)
        return True

    def _publish_chunk(self, settings: NodeSettings, chunk: ActionChunk, stamp: Time, command: Command,
                       started: float) -> None:
        actions, clipped, trajectory = command.actions, command.clipped, command.trajectory
        published = time.monotonic()
        deadline_met = published - started <= self._governor.effective_period_s  # the rate the loop runs at
        message = action_chunk_msg(
            stamp=stamp, frame_id=chunk.frame_id, joint_names=settings.action_joint_names, actions=actions,
            dt=settings.action_dt, observation_age=self._now() - chunk.stamp, prefill_ms=chunk.prefill_ms,
            action_ms=chunk.action_ms, frame_ms=(published - started) * 1e3, deadline_met=deadline_met,
            clipped_values=clipped, action_space=command.action_space,
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
            self._safety = (settings, safety_filter(settings))
        return self._safety[1]

    # ----------------------------------------------------------------------------------------------
    # Rate
    # ----------------------------------------------------------------------------------------------
    def _tick_cost_at_warm_up(self, settings: NodeSettings, times: WarmUpTimes) -> TickCost:
        """The whole tick as warm-up measured it: the engine's part plus building and serialising
        what a tick publishes (a chunk, its trajectory, one text delta)."""
        horizon = settings.action_horizon or self._engine.policy.config.action_horizon
        actions = np.zeros((horizon, len(settings.action_joint_names)), dtype=np.float32)
        state = np.zeros(len(settings.joint_names), dtype=np.float64)
        delta = TextDelta(0, "narration", "word")
        chunk_s, delta_s = [], []
        for _ in range(20):
            started = time.monotonic()
            command = build_command(settings, actions, state, Time(), self._safety_filter(settings))
            if command.trajectory is not None:
                serialize_message(command.trajectory)
            serialize_message(action_chunk_msg(
                stamp=Time(), frame_id=0, joint_names=settings.action_joint_names, actions=actions,
                dt=settings.action_dt, observation_age=0.0, prefill_ms=0.0, action_ms=0.0, frame_ms=0.0,
                deadline_met=True, clipped_values=0))
            middle = time.monotonic()
            serialize_message(narration_msg(delta, Time()))
            chunk_s.append(middle - started)
            delta_s.append(time.monotonic() - middle)
        per_delta = float(np.median(delta_s))
        self._publish_cost.seed(per_delta)
        return TickCost(action_s=times.action_ms * 1e-3 + float(np.median(chunk_s)),
                        language_step_s=times.language_step_ms * 1e-3 + per_delta,
                        margin_s=settings.decode_margin_ms * 1e-3)

    def _plan_rate(self, settings: NodeSettings) -> None:
        """Check ``rate_hz`` against the warm-up tick (a WARN when it cannot be held with room for
        language) and start the governor: at rate_hz, or with ``adapt`` at the rate that fits."""
        cost = self._warm_up_cost
        adapt = settings.overrun_policy == "adapt"
        holdable = cost.holdable_hz() if cost is not None else float("inf")
        feasible = holdable >= settings.rate_hz
        self._governor.reset(settings.rate_hz, adapt, start_hz=None if feasible else holdable)
        if not feasible:
            then = (f"overrun_policy adapt: replanning at {self._governor.effective_hz:g} Hz, back up to rate_hz "
                    "when ticks get cheaper" if adapt else "overrun_policy skip: ticks will overrun and skip periods")
            self.get_logger().warning(
                f"rate_hz {settings.rate_hz:g} cannot be held with room for language: a tick costs "
                f"{cost.total_s * 1e3:.1f} ms at warm-up (prefill + action + publish {cost.action_s * 1e3:.1f} ms, "
                f"a language step {cost.language_step_s * 1e3:.1f} ms, margin {cost.margin_s * 1e3:.1f} ms) of a "
                f"{settings.period_s * 1e3:.1f} ms period; about {holdable:.1f} Hz fits. {then}")

    def _adapt_rate(self, engine: OxygenEngine, settings: NodeSettings, action_s: float) -> None:
        """Feed this tick's cost to the governor; a new effective rate restarts the timer (logged)."""
        cost = TickCost(action_s=action_s,
                        language_step_s=engine.timer.estimate(1) + self._publish_cost.per_delta_s,
                        margin_s=settings.decode_margin_ms * 1e-3)
        previous = self._governor.effective_hz
        changed = self._governor.record(cost)
        if changed is None:
            return
        self._counters.add("rate_changes")
        direction = "lowered" if changed < previous else "raised"
        self.get_logger().warning(
            f"replanning rate {direction} from {previous:g} to {changed:g} Hz (rate_hz {settings.rate_hz:g}): "
            f"recent ticks hold about {self._governor.holdable_hz:.1f} Hz with room for language "
            f"(this tick: action path {action_s * 1e3:.1f} ms, a language step {cost.language_step_s * 1e3:.1f} ms)")
        self._start_timer()

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

    def _expired(self, engine: OxygenEngine) -> List[TextDelta]:
        """Failed finals for requests the engine went silent on for longer than its own limits (counted)."""
        limits = engine.config
        expired = self._streams.expire(limits.max_wait_frames + limits.max_stall_frames + EXPIRY_SLACK_TICKS)
        if expired:
            self._counters.add("streams_expired", len(expired))
        return expired

    def _publish_text(self, deltas: Sequence[TextDelta]) -> None:
        """Publish each delta (and a finished request's full text); its cost feeds the budget.

        A request's stream closes with its final delta before that is published, so a final lost to
        a publishing failure (counted) never leaves its kind busy.
        """
        started = time.monotonic()
        for delta in deltas:
            update = self._streams.update(delta, self._last_frame_stamp)
            if delta.final:
                self._count_finish(delta)
            try:
                self.faults.check("text_publish")
                self._narration_pub.publish(narration_msg(delta, update.stamp))
                if delta.final:
                    self._text_pub.publish(String(data=update.full_text))
            except Exception as exc:  # rclpy (or an injected fault): lose this delta, not the tick
                self._counters.add("text_publish_errors")
                if delta.final:
                    self._counters.add("final_deltas_lost")
                self._warn(f"text_publish:{type(exc).__name__}",
                           f"could not publish a text delta of {delta.kind} request {delta.request_id}"
                           f"{' (its final)' if delta.final else ''}: {type(exc).__name__}: {exc}")
        self._publish_cost.record(len(deltas), time.monotonic() - started)

    def _count_finish(self, delta: TextDelta) -> None:
        self._counters.add("requests_finished")
        if delta.finish_reason in ("refused", "failed", "stalled"):
            self._counters.add(f"requests_{delta.finish_reason}")
            self._warn(f"{delta.finish_reason}:{delta.kind}",
                       f"{delta.kind} request {delta.request_id} {delta.finish_reason}: {delta.detail}")

    def _on_ask(self, msg: String) -> None:
        question = msg.data.strip()
        if self._refuse_text("ask", question):
            return
        if len(self._questions) >= MAX_PENDING_QUESTIONS:
            self._refuse("ask", "queue_full", f"{MAX_PENDING_QUESTIONS} questions are already waiting")
            return
        self._questions.append(question)

    def _on_instruction(self, msg: String) -> None:
        task = msg.data.strip()
        if self._refuse_text("instruction", task):
            return
        result = self.set_parameters([Parameter("task", Parameter.Type.STRING, task)])[0]
        if not result.successful:
            self._refuse("instruction", "invalid", result.reason)
        else:
            self.get_logger().info(f"task is now {task!r}")

    def _refuse_text(self, topic: str, text: str) -> bool:
        """Refuse (counted, logged with the reason) a text on ~/ask or ~/instruction that the node
        cannot take: while not active (questions are not kept for later), empty, or too long."""
        settings = self._settings
        if not self._active or settings is None:
            self._refuse(topic, "inactive", f"the node is {self._state_label}, not active")
        elif not text:
            self._refuse(topic, "empty", "the text is empty")
        elif len(text) > settings.max_text_chars:
            self._refuse(topic, "too_long", f"{len(text)} characters, more than max_text_chars "
                                            f"{settings.max_text_chars}")
        else:
            return False
        return True

    def _refuse(self, topic: str, reason: str, why: str) -> None:
        self._counters.add(f"{topic}_rejected_{reason}")
        self._warn(f"{topic}:{reason}", f"refusing a message on ~/{topic}: {why}")

    def _drop_questions(self) -> None:
        """Questions still waiting when the node stops being active are dropped (counted)."""
        if self._questions:
            self._counters.add("ask_dropped_inactive", len(self._questions))
            self._questions.clear()

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
        if (settings.rate_hz, settings.overrun_policy) != (previous.rate_hz, previous.overrun_policy):
            self._plan_rate(settings)
            if self._timer is not None:
                self._start_timer()
            self.get_logger().info(f"rate_hz is now {settings.rate_hz:g} (overrun_policy {settings.overrun_policy}, "
                                   f"replanning at {self._governor.effective_hz:g} Hz)")

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

        governor, cost = self._governor, self._warm_up_cost
        if self._last_error:
            level, summary = DiagnosticStatus.ERROR, self._last_error
        elif self._state_label != "active":
            level, summary = DiagnosticStatus.OK, f"{self._state_label}: no output"
        elif frame_rate == 0.0:
            level, summary = DiagnosticStatus.WARN, "active but no action chunk in the last second"
        elif governor.effective_hz < governor.requested_hz:
            level, summary = DiagnosticStatus.WARN, (
                f"replanning at {governor.effective_hz:g} Hz of the requested {governor.requested_hz:g} Hz: "
                f"ticks hold about {governor.holdable_hz:.1f} Hz with room for language")
        elif cost is not None and cost.holdable_hz() < governor.requested_hz and not governor.adapt:
            level, summary = DiagnosticStatus.WARN, (
                f"rate_hz {governor.requested_hz:g} cannot be held with room for language: a tick costs "
                f"{cost.total_s * 1e3:.1f} ms at warm-up (overrun_policy skip)")
        elif new_misses:
            level, summary = DiagnosticStatus.WARN, f"{new_misses} deadline miss(es) in the last second"
        else:
            level, summary = DiagnosticStatus.OK, f"{frame_rate:.1f} Hz"
        loop = {
            "state": self._state_label,
            "rate_hz": settings.rate_hz if settings else 0.0,
            "requested_rate_hz": governor.requested_hz,
            "effective_rate_hz": governor.effective_hz,
            "overrun_policy": settings.overrun_policy if settings else "",
            "rate_changes": counters.get("rate_changes", 0),
            "warmup_tick_ms": cost.total_s * 1e3 if cost else 0.0,
            "warmup_action_path_ms": cost.action_s * 1e3 if cost else 0.0,
            "warmup_language_step_ms": cost.language_step_s * 1e3 if cost else 0.0,
            "warmup_holdable_rate_hz": min(cost.holdable_hz(), 1e6) if cost else 0.0,
            "rate_feasible": cost.holdable_hz() >= governor.requested_hz if cost else False,
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
            "consecutive_failures": self._failing_ticks,
            "max_consecutive_failures": settings.max_consecutive_failures if settings else 0,
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
            "requests_failed": counters.get("requests_failed", 0),
            "publish_ms_per_delta": self._publish_cost.per_delta_s * 1e3,
            "publish_reserve_ms": self._publish_cost.expected_s() * 1e3,
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
