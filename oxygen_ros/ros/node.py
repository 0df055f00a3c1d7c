"""The oxygen_ros node: cameras + joint states in; action chunks and streamed language out.

This module wires the lifecycle node (I/O, transitions, parameters, the timer) and holds
:func:`main`; one tick is :mod:`.tick`, what it publishes :mod:`.outputs`, /diagnostics
:mod:`.diagnostics`, the Ask action :mod:`.ask_action`.

One managed (lifecycle) node runs the OxyGen loop on a timer at ``rate_hz``::

    tick:  latest inputs -> Observation -> engine.act (ONE shared prefill + action expert)
           -> safety limits -> publish JointTrajectory + ActionChunk        (the deadline-bound
           path)
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

Threads: :func:`main` spins a SingleThreadedExecutor. Sensor callbacks only store the newest
message, so they need not run during a tick: messages that arrive while the model runs are taken
in the gap before the next tick (the language budget ends ``decode_margin_ms`` early to leave that
gap). A MultiThreadedExecutor slows the model down on few cores (rclpy's executor loop busy-waits
and holds the GIL while the tick's callback group is busy). The callback groups and the engine
lock keep the node correct under a multi-threaded executor too
(e.g. in a composed process): ticks never overlap and transitions wait for a running tick.

Stopping: SIGINT/SIGTERM only request a stop; :func:`main` then releases the node while the ROS
context is valid (open Ask goals end ABORTED ``cancelled`` and their clients get the result) and
only then takes the node and the context down, exiting 0 (:mod:`.shutdown`). What differs between
rclpy releases is handled in :mod:`.rclpy_compat`.

Topics (``~`` = the node's name; relative input names follow the node's namespace):
  in   <camera_topics>        sensor_msgs/Image | CompressedImage  (sensor-data QoS)
       joint_states           sensor_msgs/JointState               (sensor-data QoS)
       ~/instruction          std_msgs/String   sets the ``task`` parameter (and starts a new
                              subtask at once in the subtask loop)
       ~/ask                  std_msgs/String   asks a question (an ``answer`` request)
       ~/ask                  oxygen_ros/action/Ask  the same as an action: streamed feedback,
                              the answer as result, cancellable (see :mod:`.ask_action`)
  out  ~/joint_trajectory     trajectory_msgs/JointTrajectory (not in dry_run, never for robot
  libero)
       ~/action_chunk         oxygen_ros/ActionChunk
       ~/narration            oxygen_ros/Narration (every text delta)
       ~/narration_text       std_msgs/String ("[kind] full text" when a request finishes)
       ~/subtask              std_msgs/String (the current subtask, transient-local; with
                              subtask_conditioning prompt | same_frame)
       ~/narration_marker     visualization_msgs/Marker (the same text, with narration_marker)
       /diagnostics           diagnostic_msgs/DiagnosticArray (1 Hz)

Start without launch: ``oxygen_node --ros-args --params-file config/oxygen.yaml``.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from rcl_interfaces.msg import SetParametersResult
from rclpy.action import CancelResponse, GoalResponse
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.executors import ShutdownException, SingleThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.parameter import Parameter
from rclpy.qos import DurabilityPolicy, HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import String

from oxygen_ros.action import Ask

from ..engine.counters import Counters
from ..engine.faults import NO_FAULTS, FaultInjector
from ..engine.runtime import warm_up
from ..engine.scheduler import OxygenEngine
from .ask_action import AskGoal, Question, goal_problem
from .diagnostics import DiagnosticsReport, KeyedThrottle
from .engine_setup import check_fits_model, load_engine, warm_up_observation
from .observation import JOINT_STATES_TOPIC, ObservationAssembler
from .outputs import RECORD_QOS, Outputs
from .params import (
    SPECS,
    NodeSettings,
    SettingsError,
    changed_configure_parameters,
    check_value,
    declare_parameters,
    normalise,
)
from .rclpy_compat import (
    ExternalShutdownException,
    create_action_server,
    has_post_set_parameters_callback,
    init_without_signal_handlers,
)
from .remote_engine import RemoteEngine
from .remote_setup import check_fits_server, connect_remote_engine
from .shutdown import StopSignals, close_node
from .tick import MAX_PENDING_QUESTIONS, TickLoop
from .tick_clock import TickClock

NODE_NAME = "oxygen_node"

# Cameras: newest frame only, lost frames are fine (best effort matches every publisher).
CAMERA_QOS = QoSProfile(
    history=HistoryPolicy.KEEP_LAST,
    depth=1,
    reliability=ReliabilityPolicy.BEST_EFFORT,
    durability=DurabilityPolicy.VOLATILE,
)
# Joint states: also latest-only, a few deep so a burst is not all lost before the store sees it.
JOINT_QOS = QoSProfile(
    history=HistoryPolicy.KEEP_LAST,
    depth=5,
    reliability=ReliabilityPolicy.BEST_EFFORT,
    durability=DurabilityPolicy.VOLATILE,
)
LOG_THROTTLE_S = 5.0


class OxygenNode(LifecycleNode):
    """pi0.5 actions and language from shared prefills (see the module docstring).

    ``faults`` injects failures into the node's own stages (``text_publish``), for tests.
    ``post_set`` chooses how accepted parameter changes are applied: True, by rclpy's post-set
    callback (rclpy >= Iron); False, at the start of the next tick or diagnostics period (Humble,
    which has no post-set callback); None, the former where rclpy has it.

    Raises:
        SettingsError: a parameter override has the wrong type or is out of range.
    """

    def __init__(
        self,
        node_name: str = NODE_NAME,
        *,
        faults: FaultInjector = NO_FAULTS,
        post_set: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(node_name, **kwargs)
        declare_parameters(self)
        # the loop's timers (see Clocks)
        self._steady_clock = Clock(clock_type=ClockType.STEADY_TIME)
        self._counters = Counters()
        self._throttle = KeyedThrottle(LOG_THROTTLE_S)
        self._engine_lock = threading.Lock()
        self._timer_lock = threading.Lock()
        self._engine: OxygenEngine | None = None
        self._settings: NodeSettings | None = None  # set while configured
        self._applied: dict[str, Any] = {}  # the parameter values _settings was built from
        self._timer = None
        self._active = False
        self._state_label = "unconfigured"
        self._last_error = ""
        self._subscriptions_io: list[Any] = []
        self._last_tick_start: float | None = None
        self._erroring = False  # the error transition is under way
        self._report = DiagnosticsReport()
        # ROS time that moves during a tick under use_sim_time too (see tick_clock)
        self._tick_clock = TickClock(
            lambda: self.get_clock().now().nanoseconds,
            lambda: self.get_clock().ros_time_is_active,
        )
        self._loop = TickLoop(
            self._counters,
            self._warn,
            self.get_logger(),
            faults,
            self._tick_clock.now_ns,
            self._start_timer,
            self._next_tick_time,
            float(self.get_parameter("rate_hz").value),
        )

        self._tick_group = MutuallyExclusiveCallbackGroup()
        self._input_group = MutuallyExclusiveCallbackGroup()
        self._diagnostics_group = MutuallyExclusiveCallbackGroup()
        self._diagnostics_pub = self.create_publisher(DiagnosticArray, "/diagnostics", RECORD_QOS)
        self.create_timer(
            1.0,
            self._publish_diagnostics,
            callback_group=self._diagnostics_group,
            clock=self._steady_clock,
        )
        self.create_subscription(String, "~/instruction", self._on_instruction, RECORD_QOS)
        self.create_subscription(String, "~/ask", self._on_ask, RECORD_QOS)
        self._ask_goals: list[AskGoal] = []  # accepted goals whose result is not sent yet
        self._ask_server = create_action_server(
            self,
            Ask,
            "~/ask",
            _never_executed,
            goal_callback=self._on_ask_goal,
            handle_accepted_callback=self._on_ask_accepted,
            cancel_callback=lambda goal_handle: CancelResponse.ACCEPT,
        )
        self.add_on_set_parameters_callback(self._on_set_parameters)
        if post_set is None:
            post_set = has_post_set_parameters_callback(self)
        self._post_set = post_set
        if post_set:
            self.add_post_set_parameters_callback(lambda parameters: self._sync_parameters())

    # ----------------------------------------------------------------------------------------------
    # Start-up and shutdown
    # ----------------------------------------------------------------------------------------------
    @property
    def faults(self) -> FaultInjector:
        """The fault injector of the node's own stages (tests may replace it while running)."""
        return self._loop.faults

    @faults.setter
    def faults(self, injector: FaultInjector) -> None:
        self._loop.faults = injector

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
        loop = self._loop
        engine = None
        try:
            values = self._parameter_values()
            settings = NodeSettings.from_values(values)
            if settings.engine == "remote":
                engine = connect_remote_engine(settings, log, self._server_deadline_s)
            else:
                engine = load_engine(settings, info=log.info)
            report = warm_up(engine, warm_up_observation(settings))
            with self._engine_lock:
                self._engine, self._settings, self._applied = engine, settings, values
                self._build_io(settings)
            loop.warm_up_cost = loop.cost_at_warm_up(settings, engine, report)
        except Exception as exc:  # any failure leaves the node unconfigured and alive, saying why
            if engine is not None and engine is not self._engine:
                engine.close()  # built but not kept (a remote one holds a connection)
            self._teardown()
            self._last_error = f"configure failed: {type(exc).__name__}: {exc}"
            log.error(self._last_error)
            log.debug(traceback.format_exc())
            return TransitionCallbackReturn.FAILURE
        self._last_error = ""
        loop.failing_ticks = 0
        cost = loop.warm_up_cost
        log.info(
            f"configured: warm-up tick {cost.total_s * 1e3:.1f} ms (prefill + action + publish "
            f"{cost.action_s * 1e3:.1f} ms, a language step {cost.language_step_s * 1e3:.1f} ms, "
            f"margin {cost.margin_s * 1e3:.1f} ms) at rate_hz {settings.rate_hz:g} (period "
            f"{settings.period_s * 1e3:.1f} ms); cameras "
            f"{[f'{c.topic}->{c.slot}' for c in settings.cameras]}"
        )
        loop.plan_rate(settings)
        self._state_label = "inactive"
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        result = super().on_activate(state)  # enables the lifecycle publishers
        if result != TransitionCallbackReturn.SUCCESS:
            return result
        self._sync_parameters()
        self._loop.narration_due.reset()
        self._loop.failing_ticks = 0
        self._start_fresh_run()
        self._active = True
        self._start_timer()
        self._state_label = "active"
        self.get_logger().info("active: publishing action chunks")
        return TransitionCallbackReturn.SUCCESS

    def _start_fresh_run(self) -> None:
        """Activation starts a new run: while the node was inactive the robot may have moved or
        been reset (a new episode), so the chunk published before deactivate no longer guides the
        first chunk (RTC), no gripper switch it planned is kept, and a new subtask is decoded from
        the first frame, even for the same task text."""
        with self._engine_lock:
            continuity = getattr(self._engine, "continuity", None)
            if continuity:
                continuity.reset()
            self._loop.forget_gripper_switches()
        self._loop.restart_subtask = True

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._active = False
        self._stop_timer()
        with self._engine_lock:  # wait for a tick in progress to finish
            pass
        self._loop.drop_questions("the node stopped being active before the question was asked")
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
        """Release the engine and end unconfigured, saying why (``last_error``, /diagnostics
        ERROR)."""
        self._erroring = False
        self._last_error = self._last_error or f"a transition from {state.label} failed"
        self._counters.add("error_transitions")
        self.get_logger().error(
            f"error transition from {state.label}: {self._last_error}; releasing "
            "the engine. Configure the node again once the cause is fixed."
        )
        self.release()
        self._state_label = "unconfigured"
        self._publish_diagnostics()  # at once, not at the next 1 Hz tick
        return TransitionCallbackReturn.SUCCESS

    def _fail(self, reason: str) -> None:
        """Leave 'active' through the lifecycle's error transition (deactivate -> ERROR ->
        on_error)."""
        self._last_error = reason
        self._erroring = True
        self.get_logger().error(reason)
        self.trigger_deactivate()
        if self._erroring:  # the transition could not start (the node was no longer active)
            self._erroring = False

    def _build_io(self, settings: NodeSettings) -> None:
        """Publishers and sensor subscriptions of a configured node."""
        assembler = ObservationAssembler(
            settings.cameras, settings.joint_names, self._counters, self._warn
        )
        assembler.set_reset_threshold(settings.max_observation_age_s)
        self._loop.assembler = assembler
        self._loop.outputs = Outputs(self, settings)
        for cam in settings.cameras:
            self._subscriptions_io.append(
                self.create_subscription(
                    CompressedImage if cam.compressed else Image,
                    cam.topic,
                    assembler.latest[cam.topic].store,
                    CAMERA_QOS,
                    callback_group=self._input_group,
                )
            )
        self._subscriptions_io.append(
            self.create_subscription(
                JointState,
                JOINT_STATES_TOPIC,
                assembler.latest[JOINT_STATES_TOPIC].store,
                JOINT_QOS,
                callback_group=self._input_group,
            )
        )

    def _teardown(self) -> None:
        """Destroy I/O and close the engine (the node returns to 'unconfigured'); the requests the
        engine cancels on closing are counted and end their Ask goals."""
        loop = self._loop
        with self._engine_lock:
            for sub in self._subscriptions_io:
                self.destroy_subscription(sub)
            self._subscriptions_io = []
            if loop.outputs is not None:
                loop.outputs.destroy()
            closed = []
            if self._engine is not None:
                try:
                    closed = self._engine.close()
                except Exception as exc:  # a broken engine must not keep the node from releasing it
                    self._counters.add("engine_close_errors")
                    self.get_logger().error(
                        f"closing the engine failed: {type(exc).__name__}: {exc}"
                    )
            loop.finish_closed(closed)
            self._engine = self._settings = loop.assembler = loop.outputs = loop.warm_up_cost = None
            self._applied = {}
        loop.drop_questions("the node released its engine before the question was asked")

    # ----------------------------------------------------------------------------------------------
    # Timer and tick
    # ----------------------------------------------------------------------------------------------
    def _start_timer(self) -> None:
        with self._timer_lock:
            if self._timer is not None:
                self.destroy_timer(self._timer)
            self._last_tick_start = None
            self._timer = self.create_timer(
                self._loop.governor.effective_period_s,
                self._on_tick,
                callback_group=self._tick_group,
                clock=self._steady_clock,
            )

    def _stop_timer(self) -> None:
        with self._timer_lock:
            if self._timer is not None:
                self.destroy_timer(self._timer)
                self._timer = None

    def _server_deadline_s(self) -> float:
        """engine remote: how long a tick waits for its reply (server_timeout_ms, else one
        period at the effective rate)."""
        settings = self._settings
        if settings is not None and settings.server_timeout_ms > 0:
            return settings.server_timeout_ms * 1e-3
        return self._loop.governor.effective_period_s

    def _next_tick_time(self, started: float, period: float) -> float:
        """Monotonic time of the timer's next call (the language budget ends there)."""
        timer = self._timer
        until_next = timer.time_until_next_call() if timer is not None else None
        if until_next is None:
            return started + period
        return time.monotonic() + until_next * 1e-9

    def _on_tick(self) -> None:
        started = time.monotonic()
        if not self._post_set:
            self._sync_parameters()
        settings = self._settings
        if settings is None:
            return
        period = self._loop.governor.effective_period_s
        self._note_tick_start(started, period)
        try:
            with self._engine_lock:
                if self._engine is None or not self._active or self._settings is None:
                    return
                fault = self._loop.run(self._engine, self._settings, started)
        except Exception as exc:  # the action loop must outlive any single failure
            self._counters.add("tick_exceptions")
            fault = f"{type(exc).__name__}: {exc}"
            self._warn(
                f"tick:{type(exc).__name__}",
                f"tick failed, the loop continues: {fault}\n{traceback.format_exc()}",
            )
        finally:
            elapsed = time.monotonic() - started
            self._loop.tick_ms.add(elapsed * 1e3)
            if elapsed > period:
                self._counters.add("tick_overruns")
        self._count_failures(fault, settings)

    def _count_failures(self, fault: str | None, settings: NodeSettings) -> None:
        """A tick whose engine calls all succeeded ends a run of failing ticks; a long run takes the
        node through the error transition."""
        loop = self._loop
        if fault is None:
            loop.failing_ticks = 0
            return
        loop.failing_ticks += 1
        if loop.failing_ticks >= settings.max_consecutive_failures:
            self._fail(
                f"{loop.failing_ticks} consecutive ticks failed inside the engine "
                f"(max_consecutive_failures {settings.max_consecutive_failures}); last: {fault}"
            )

    def _note_tick_start(self, started: float, period: float) -> None:
        """Count ticks that start late and the periods skipped before them (rcl skips missed
        ones)."""
        last, self._last_tick_start = self._last_tick_start, started
        if last is None:
            return
        gap = started - last
        if gap > 1.5 * period:
            skipped = max(int(round(gap / period)) - 1, 1)
            self._counters.add("late_ticks")
            self._counters.add("skipped_periods", skipped)
            self._warn(
                "tick:late",
                f"tick started {gap * 1e3:.1f} ms after the previous one "
                f"(period {period * 1e3:.1f} ms): {skipped} period(s) without a tick",
            )

    # ----------------------------------------------------------------------------------------------
    # Questions and instructions
    # ----------------------------------------------------------------------------------------------
    def _on_ask(self, msg: String) -> None:
        question = msg.data.strip()
        if self._refuse_text("ask", question) or self._queue_full("ask"):
            return
        self._loop.questions.append(Question(question))

    def _on_ask_goal(self, goal: Ask.Goal) -> GoalResponse:
        """Accept an Ask goal the node can answer now; reject it (counted, logged) otherwise."""
        problem = goal_problem(goal)
        if problem:
            self._refuse("ask_action", "empty", problem)
            return GoalResponse.REJECT
        if self._refuse_text("ask_action", goal.question.strip()) or self._queue_full("ask_action"):
            return GoalResponse.REJECT
        return GoalResponse.ACCEPT

    def _on_ask_accepted(self, goal_handle: Any) -> None:
        """Queue the goal's question for the next frame (never executed here: see ask_action)."""
        question = goal_handle.request.question.strip()
        goal = AskGoal(goal_handle)
        self._ask_goals = [g for g in self._ask_goals if not g.concluded] + [goal]
        self._loop.questions.append(Question(question, goal))

    def goals_awaiting_result(self) -> int:
        """Accepted Ask goals whose result has not been handed to rclpy yet (open, or ended and
        waiting for the executor to send the result)."""
        return sum(not goal.concluded for goal in self._ask_goals)

    def _on_instruction(self, msg: String) -> None:
        task = msg.data.strip()
        if self._refuse_text("instruction", task):
            return
        result = self.set_parameters([Parameter("task", Parameter.Type.STRING, task)])[0]
        if not result.successful:
            self._refuse("instruction", "invalid", result.reason)
        else:
            self._loop.restart_subtask = True  # a new subtask at once, even for the same task
            self.get_logger().info(f"task is now {task!r}")

    def _queue_full(self, topic: str) -> bool:
        if len(self._loop.questions) < MAX_PENDING_QUESTIONS:
            return False
        self._refuse(topic, "queue_full", f"{MAX_PENDING_QUESTIONS} questions are already waiting")
        return True

    def _refuse_text(self, topic: str, text: str) -> bool:
        """Refuse (counted, logged with the reason) a text on ~/ask or ~/instruction that the node
        cannot take: while not active (questions are not kept for later), empty, or too long."""
        settings = self._settings
        if not self._active or settings is None:
            self._refuse(topic, "inactive", f"the node is {self._state_label}, not active")
        elif not text:
            self._refuse(topic, "empty", "the text is empty")
        elif len(text) > settings.max_text_chars:
            self._refuse(
                topic,
                "too_long",
                f"{len(text)} characters, more than max_text_chars {settings.max_text_chars}",
            )
        else:
            return False
        return True

    def _refuse(self, topic: str, reason: str, why: str) -> None:
        self._counters.add(f"{topic}_rejected_{reason}")
        self._warn(f"{topic}:{reason}", f"refusing a message on ~/{topic}: {why}")

    # ----------------------------------------------------------------------------------------------
    # Parameters: validated in the on-set callback, applied after it
    # ----------------------------------------------------------------------------------------------
    def _parameter_values(self) -> dict[str, Any]:
        return {name: self.get_parameter(name).value for name in SPECS}

    def _on_set_parameters(self, parameters: list[Parameter]) -> SetParametersResult:
        """Reject invalid values with a reason; changes nothing (see :meth:`_sync_parameters`)."""
        changes = {p.name: p.value for p in parameters if p.name in SPECS}
        try:
            for name, value in changes.items():
                check_value(name, value)
            if self._settings is None:  # unconfigured: consistency is checked by configure
                return SetParametersResult(successful=True)
            current = self._parameter_values()
            late = [
                name
                for name in changed_configure_parameters(list(changes))
                if normalise(name, changes[name]) != normalise(name, current[name])
            ]
            if late:
                raise SettingsError(
                    f"{', '.join(late)} can only change while the node is unconfigured (it is "
                    f"{self._state_label}): deactivate and clean up, set them, then configure again"
                )
            updated = NodeSettings.from_values({**current, **changes})
            engine = self._engine
            if isinstance(engine, RemoteEngine):
                check_fits_server(updated, engine.policy)
            elif engine is not None:
                check_fits_model(updated, engine.policy)
        except SettingsError as exc:
            return SetParametersResult(successful=False, reason=str(exc))
        return SetParametersResult(successful=True)

    def _sync_parameters(self) -> None:
        """Apply parameter changes accepted since the settings were built (a no-op otherwise)."""
        previous = self._settings
        if previous is None:
            return
        values = self._parameter_values()
        if values == self._applied:
            return
        try:
            settings = NodeSettings.from_values(values)
        except SettingsError as exc:  # accepted one by one, but not together: keep the old settings
            self._warn("parameters", f"parameter changes not applied: {exc}")
            return
        self._settings, self._applied = settings, values
        loop = self._loop
        if loop.assembler is not None:
            loop.assembler.set_reset_threshold(settings.max_observation_age_s)
        # a new injected delay changes the tick's cost as a new model would: plan the rate again
        if (settings.rate_hz, settings.overrun_policy, settings.inject_inference_delay_ms) != (
            previous.rate_hz,
            previous.overrun_policy,
            previous.inject_inference_delay_ms,
        ):
            loop.plan_rate(settings)
            if self._timer is not None:
                self._start_timer()
            self.get_logger().info(
                f"rate_hz is now {settings.rate_hz:g} (overrun_policy "
                f"{settings.overrun_policy}, replanning at "
                f"{loop.governor.effective_hz:g} Hz)"
            )

    # ----------------------------------------------------------------------------------------------
    # Diagnostics and logging
    # ----------------------------------------------------------------------------------------------
    def record_executor_error(self, exc: BaseException) -> None:
        """An error raised inside the executor itself (e.g. rclpy failing to take a message):
        counted and logged; the caller keeps spinning, so the action loop outlives it."""
        self._counters.add("executor_errors")
        self._warn(
            f"executor:{type(exc).__name__}",
            f"executor error, spinning on: {type(exc).__name__}: {exc}",
        )

    def _warn(self, key: str, message: str) -> None:
        """A warning throttled per key (topic and reason), telling how many were held back."""
        allowed, held = self._throttle.allow(key)
        if allowed:
            suffix = (
                f" [{held} similar message(s) suppressed in the last {LOG_THROTTLE_S:g} s]"
                if held
                else ""
            )
            self.get_logger().warning(message + suffix)

    def _publish_diagnostics(self) -> None:
        try:
            if not self._post_set:
                self._sync_parameters()
            self._diagnostics_pub.publish(
                self._report.build(
                    self.get_fully_qualified_name().lstrip("/"),
                    self.get_clock().now().to_msg(),
                    self._state_label,
                    self._last_error,
                    self._settings,
                    self._loop,
                )
            )
        except Exception as exc:  # diagnostics must not take the node down either
            self._warn("diagnostics", f"could not publish diagnostics: {type(exc).__name__}: {exc}")


def _never_executed(goal_handle: Any) -> Ask.Result:
    """The action server's default execute callback: the node passes its own to every
    ``execute`` (see :class:`.ask_action.AskGoal`), so reaching this is a bug, answered as such."""
    goal_handle.abort()
    return Ask.Result(text="", finish_reason="failed", detail="internal error: no answer stream")


def spin_forever(
    executor: SingleThreadedExecutor,
    on_error: Callable[[Exception], None],
    stop: threading.Event | None = None,
) -> None:
    """``executor.spin()`` that survives errors raised inside rclpy's executor (seen once under CI
    load: a subscription message rclpy could not take); ``on_error`` reports them, spinning goes on.

    Returns when ``stop`` is set, or the context shuts down, or the executor does. (A shut-down
    executor holds no nodes and its ``spin_once`` returns at once, so without that check this would
    busy-loop.)
    """
    stop = stop or threading.Event()
    while not stop.is_set() and rclpy.ok(context=executor.context) and executor.get_nodes():
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``oxygen_node``: run until SIGINT/SIGTERM; returns the exit status.

    ``argv`` is a full command line like ``sys.argv`` (program name first, ROS arguments after
    ``--ros-args``); the default is ``sys.argv``.

    A signal only requests the stop (:class:`.shutdown.StopSignals`, installed instead of rclpy's
    handlers); the node is then released while the ROS context is still valid, so open Ask goals
    end ABORTED with ``cancelled`` and their clients get the result, and only then are the node and
    the context taken down (:func:`.shutdown.close_node`). A stop by signal exits 0 even when a
    teardown step fails (the failure is printed on stderr).
    """
    args = list(sys.argv if argv is None else argv)
    from .cli_help import help_requested, print_help  # help is printed before rclpy.init

    if help_requested(args):
        return print_help()
    init_without_signal_handlers(args)
    signals = StopSignals().install()
    try:
        try:
            node = OxygenNode()
        except SettingsError as exc:
            print(f"oxygen_node: {exc}", file=sys.stderr)
            rclpy.try_shutdown()
            return 2
        # Single-threaded on purpose: a multi-threaded executor's busy-waiting threads compete with
        # the model for the cores and the GIL, and the tick never needs a second thread.
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        try:
            if node.autostart and not node.start():
                node.get_logger().error(
                    "autostart failed; the node stays up (fix the parameters, then configure "
                    "and activate it through its lifecycle services)"
                )
            spin_forever(executor, node.record_executor_error, signals.event)
        except (KeyboardInterrupt, ExternalShutdownException):
            pass
        finally:
            close_node(node, executor)
    finally:
        signals.restore()
    return 0


if __name__ == "__main__":
    sys.exit(main())
