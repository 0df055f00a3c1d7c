"""The simulated robot as a ROS 2 node (``sim``): cameras, joint states, two trajectory
controllers, episodes, and the simulation clock.

Topics (relative names: a namespace moves them all):

* publishes ``camera/scene/image_raw`` and ``camera/wrist/image_raw`` (sensor_msgs/Image rgb8,
  reliable depth 2: a best-effort subscriber matches too) at ``camera_rate_hz`` of sim time;
  ``joint_states`` (the six joints, positions and velocities) at ``joint_state_rate_hz``;
  ``/clock`` (rosgraph_msgs/Clock, best effort depth 1 like every ROS clock) at
  ``clock_rate_hz``; ``sim/task``, ``sim/subtask`` and ``sim/episode`` (std_msgs/String, latched:
  reliable, transient-local) and ``sim/narration`` (String, reliable);
* subscribes ``arm_controller/joint_trajectory`` (the five arm joints) and
  ``gripper_controller/joint_trajectory`` (``gripper`` alone, 0 open .. 1 closed), both
  trajectory_msgs/JointTrajectory, reliable, volatile, depth 1; executed with
  joint_trajectory_controller semantics (:mod:`.controller`). A rejected trajectory is dropped
  whole, counted per controller and reason in ``sim/episode`` and logged (once per reason every
  few seconds); the node never dies of a bad message;
* serves ``sim/reset`` (std_srvs/Trigger): starts the next episode with the task text in the
  parameter ``task`` (empty: a random task from the seed) and the layout seed in ``seed``
  (-1: the episode's index). Set both (``ros2 param set``) before the call; a task text the sim
  does not know is refused when the parameter is set.

Parameters (:data:`PARAMETERS`, config/sim_so101.yaml) are read at start-up, except ``task``
and ``seed``, read at each reset. Two more (:data:`FAULT_PARAMETERS`) inject faults while the sim
runs (tests and ``oxygen-bench faults``): streams that stop, and a clock that jumps.

``sim/episode`` holds JSON: ``episode`` (index), ``task``, ``seed``, ``status``
(running | success | timeout), ``elapsed_s`` (sim seconds), ``rejected`` (this episode's
rejections, ``controller/reason`` -> count) and ``rejected_total``. Privileged state (object
poses) is never published; the in-process expert reads it through :meth:`SimNode.privileged_state`.

Time. The node owns a simulation clock: physics advances in control steps of sim time, every
message is stamped with the sim time at which its content was taken, ``/clock`` publishes it, and
the controllers judge trajectories (start times, "ends in the past") on it. ``real_time_factor``
paces sim time to the wall clock (1.0: real time; 0: as fast as the CPU allows). When the
machine cannot keep up, sim time simply runs slower than wall time (after a lag of more than
0.1 s the pacing restarts from now rather than racing to catch up): the episode is slower, not
failed, and every node started with ``use_sim_time:=true`` sees consistent time, its timers
included. For consumers without ``/clock``, the sim clock starts at the wall-clock time at start
(``sim_epoch_s: -1``; a value >= 0 fixes it, e.g. for reproducible bags), so at real-time speed
the sim's stamps and a wall-clock node's stamps agree; when the sim lags they drift apart by the
lag, which such a node would see as old messages (that is the honest signal: use sim time).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import rclpy
from rcl_interfaces.msg import SetParametersResult
from rclpy.node import Node
from rclpy.parameter import Parameter
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from rosgraph_msgs.msg import Clock
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String
from std_srvs.srv import Trigger
from trajectory_msgs.msg import JointTrajectory

from oxygen_ros.ros.convert import rgb_to_image, seconds_to_stamp
from oxygen_ros.ros.trajectory_rules import TrajectoryRejected

from .episode import ARM_CONTROLLER, GRIPPER_CONTROLLER, RUNNING, PrivilegedState, Simulation
from .expert import trajectory_qos
from .scene import ARM_JOINTS, GRIPPER_JOINT, JOINT_NAMES
from .tasks import TaskError, parse_task

CAMERAS = ("scene", "wrist")
MAX_LAG_S = 0.1  # pacing restarts from now when the sim falls this far behind the wall clock
EPISODE_REPORT_PERIOD_S = 1.0  # sim seconds between sim/episode updates while running
REJECTION_LOG_PERIOD_S = 5.0  # wall seconds between log lines for one kind of rejection

PARAMETERS: dict[str, object] = {
    "joint_names": list(JOINT_NAMES),
    "arm_controller_joints": list(ARM_JOINTS),
    "gripper_controller_joints": [GRIPPER_JOINT],
    "physics_rate_hz": 500.0,
    "control_rate_hz": 100.0,
    "joint_state_rate_hz": 50.0,
    "camera_rate_hz": 10.0,
    "clock_rate_hz": 100.0,
    "image_width": 128,
    "image_height": 128,
    "real_time_factor": 1.0,
    "sim_epoch_s": -1.0,
    "episode_timeout_s": 20.0,
    "narration_period_s": 2.0,
    "task": "",
    "seed": -1,
    "autostart": True,
    "auto_reset_s": -1.0,
}
"""Every parameter and its default (config/sim_so101.yaml sets the same values)."""

FAULT_STREAMS = (*CAMERAS, "joint_states")
FAULT_PARAMETERS: dict[str, object] = {
    "fault_silent_streams": "",
    "fault_clock_offset_s": 0.0,
}
"""Fault injection, changeable while the sim runs (``ros2 param set``); not in the config file, as a
robot has no such switch. ``fault_silent_streams``: comma-separated names from
:data:`FAULT_STREAMS` that the sim stops publishing (physics, the controllers and the other streams
run on) until the parameter no longer names them. ``fault_clock_offset_s``: added to sim time, so
changing it makes the clock jump by the difference, forward or back: stamps, ``/clock`` and the
controllers' "now" jump together, as when a simulator's time is reset; the running trajectories
keep their absolute times (a forward jump ends them, a backward one holds them until their time
comes again) and an episode's elapsed time is not changed."""


def parse_silent_streams(text: str) -> frozenset[str]:
    """The stream names in ``fault_silent_streams``.

    Raises:
        ValueError: a name that is not in :data:`FAULT_STREAMS`.
    """
    names = frozenset(name.strip() for name in text.split(",") if name.strip())
    unknown = sorted(names - set(FAULT_STREAMS))
    if unknown:
        raise ValueError(
            f"fault_silent_streams names {unknown}; the sim's streams are {list(FAULT_STREAMS)}"
        )
    return names


class SimNode(Node):
    """The simulated robot. Call :meth:`start` to run its physics thread, :meth:`stop` to end it."""

    def __init__(self, node_name: str = "sim", **node_kwargs) -> None:
        super().__init__(node_name, **node_kwargs)
        for name, default in {**PARAMETERS, **FAULT_PARAMETERS}.items():
            self.declare_parameter(name, default)
        self._check_joint_parameters()
        p = self._parameter
        for name in (
            "joint_state_rate_hz",
            "camera_rate_hz",
            "clock_rate_hz",
            "narration_period_s",
        ):
            if not p(name) > 0:
                raise ValueError(f"parameter {name} must be positive, got {p(name)}")
        if p("real_time_factor") < 0:
            raise ValueError(f"real_time_factor must be >= 0, got {p('real_time_factor')}")
        if p("image_width") <= 0 or p("image_height") <= 0:
            raise ValueError("image_width and image_height must be positive")
        epoch = p("sim_epoch_s")
        self.sim = Simulation(
            physics_rate_hz=p("physics_rate_hz"),
            control_rate_hz=p("control_rate_hz"),
            episode_timeout_s=p("episode_timeout_s"),
            epoch_s=(time.time() if epoch < 0 else epoch) + p("fault_clock_offset_s"),
        )
        self._validate_task(p("task"))
        self.silent_streams = parse_silent_streams(p("fault_silent_streams"))
        self._clock_jump_s = 0.0  # asked for by fault_clock_offset_s, not applied yet
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self._lock = threading.Lock()  # the simulation between the physics thread and callbacks
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._thread: threading.Thread | None = None
        self._pending_reset: tuple | None = None
        self._reset_done = threading.Condition(self._lock)
        self._rejection_logged: dict[str, float] = {}
        self.step_gate: Callable[[float], None] | None = None
        """Called by the physics thread before each control step while running, with the sim
        time, without the sim's lock: it may wait there for what must reach the robot at that
        instant (``oxygen-collect`` waits for the expert's commands: lockstep)."""
        self._make_interfaces()
        if p("autostart"):
            self.request_reset(wait=False)

    # -- parameters -------------------------------------------------------------------------------
    def _parameter(self, name: str):
        return self.get_parameter(name).value

    def _check_joint_parameters(self) -> None:
        expected = {
            "joint_names": set(JOINT_NAMES),
            "arm_controller_joints": set(ARM_JOINTS),
            "gripper_controller_joints": {GRIPPER_JOINT},
        }
        for name, joints in expected.items():
            value = list(self._parameter(name))
            if set(value) != joints or len(value) != len(joints):
                raise ValueError(
                    f"parameter {name} is {value}; the simulated arm has exactly {sorted(joints)}"
                )

    @staticmethod
    def _validate_task(text: str) -> None:
        if text:
            parse_task(text)

    def _on_set_parameters(self, parameters: list[Parameter]) -> SetParametersResult:
        """Refuse an unknown task or stream name; apply the fault switches once all are valid."""
        values = {parameter.name: parameter.value for parameter in parameters}
        try:
            if "task" in values:
                self._validate_task(values["task"])
            silent = parse_silent_streams(values.get("fault_silent_streams", ""))
        except (TaskError, ValueError) as error:
            return SetParametersResult(successful=False, reason=str(error))
        if "fault_silent_streams" in values:
            self.silent_streams = silent
            self.get_logger().warning(f"fault injection: silent streams {sorted(silent)}")
        if "fault_clock_offset_s" in values:
            jump = values["fault_clock_offset_s"] - self._parameter("fault_clock_offset_s")
            with self._lock:
                self._clock_jump_s += jump
        return SetParametersResult(successful=True)

    def take_clock_jump(self) -> float:
        """Under the lock: the clock jump asked for since the last call (seconds, 0 for none)."""
        jump, self._clock_jump_s = self._clock_jump_s, 0.0
        return jump

    # -- interfaces -------------------------------------------------------------------------------
    def _make_interfaces(self) -> None:
        latched = QoSProfile(
            depth=1,
            reliability=ReliabilityPolicy.RELIABLE,
            durability=DurabilityPolicy.TRANSIENT_LOCAL,
        )
        images = QoSProfile(depth=2, reliability=ReliabilityPolicy.RELIABLE)
        self._cameras = {
            camera: self.create_publisher(Image, f"camera/{camera}/image_raw", images)
            for camera in CAMERAS
        }
        self._joint_states = self.create_publisher(JointState, "joint_states", 10)
        self._clock_publisher = self.create_publisher(
            Clock, "/clock", QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT)
        )
        self._task = self.create_publisher(String, "sim/task", latched)
        self._subtask = self.create_publisher(String, "sim/subtask", latched)
        self._episode = self.create_publisher(String, "sim/episode", latched)
        self._narration = self.create_publisher(String, "sim/narration", 10)
        controllers = {
            ARM_CONTROLLER: self._parameter("arm_controller_joints"),
            GRIPPER_CONTROLLER: self._parameter("gripper_controller_joints"),
        }
        for controller in controllers:
            self.create_subscription(
                JointTrajectory,
                f"{controller}/joint_trajectory",
                self._trajectory_callback(controller),
                trajectory_qos(),
            )
        self.create_service(Trigger, "sim/reset", self._on_reset)

    def _trajectory_callback(self, controller: str) -> Callable[[JointTrajectory], None]:
        def on_trajectory(msg: JointTrajectory) -> None:
            try:
                with self._lock:
                    self.sim.receive(controller, msg)
            except TrajectoryRejected as rejection:
                self._log_rejection(controller, rejection)
            except Exception as error:  # noqa: BLE001 - a bad message must not stop the robot
                self.get_logger().error(f"{controller}: trajectory not executed: {error!r}")

        return on_trajectory

    def _log_rejection(self, controller: str, rejection: TrajectoryRejected) -> None:
        key = f"{controller}/{rejection.reason}"
        now = time.monotonic()
        if now - self._rejection_logged.get(key, -float("inf")) >= REJECTION_LOG_PERIOD_S:
            self._rejection_logged[key] = now
            self.get_logger().warning(f"{controller} rejected a trajectory ({key}): {rejection}")

    # -- episodes ---------------------------------------------------------------------------------
    def _on_reset(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        try:
            episode, task = self.request_reset(wait=True)
        except (TaskError, TimeoutError) as error:
            response.success, response.message = False, str(error)
            return response
        response.success = True
        response.message = json.dumps({"episode": episode, "task": task})
        return response

    def request_reset(
        self,
        task: str | None = None,
        seed: int | None = None,
        wait: bool = True,
        timeout_s: float = 5.0,
    ) -> tuple[int, str]:
        """Start the next episode (task text and seed default to the parameters ``task`` and
        ``seed``); the physics thread applies it at its next control step. With ``wait``, return
        (episode index, task text) once it has started.

        Raises:
            TaskError: an unknown task text.
            TimeoutError: ``wait`` and the physics thread did not start it in ``timeout_s``.
        """
        text = self._parameter("task") if task is None else task
        seed = self._parameter("seed") if seed is None else seed
        parsed = parse_task(text) if text else None
        with self._reset_done:
            target = self.sim.episode + 1
            self._pending_reset = (parsed, None if seed < 0 else int(seed))
            if not wait:
                return target, text
            if not self._reset_done.wait_for(lambda: self.sim.episode >= target, timeout_s):
                raise TimeoutError(f"the sim did not start episode {target} in {timeout_s} s")
            return self.sim.episode, self.sim.task.text

    def privileged_state(self) -> PrivilegedState:
        """A copy of the scene's privileged state (for the in-process expert and scoring)."""
        with self._lock:
            return self.sim.privileged_state()

    def episode_report(self) -> dict:
        with self._lock:
            return self.sim.episode_report()

    # -- the physics thread -----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sim_physics", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def pause(self) -> None:
        """Freeze the sim (no steps, no messages, sim time stands still) after the present step;
        a reset is still applied, and its task, subtask and episode messages published (so a
        recorder started now hears the new episode from its first step). Python API only."""
        self._paused.set()

    def resume(self) -> None:
        """Run again after :meth:`pause`; pacing restarts from now."""
        self._paused.clear()

    def _run(self) -> None:
        try:
            _PhysicsLoop(self).run(self._stop)
        except Exception as error:
            self.get_logger().fatal(f"the physics thread stopped: {error!r}")
            raise
        finally:
            self.sim.world.close()  # the renderer belongs to this thread

    def _apply_pending_reset(self) -> bool:
        """Under the lock: start the episode a reset asked for, if any."""
        if self._pending_reset is None:
            return False
        task, seed = self._pending_reset
        self._pending_reset = None
        self.sim.reset(task, seed)
        self._reset_done.notify_all()
        return True

    def _queue_auto_reset(self) -> None:
        """Under the lock: queue the next episode (the ``task`` parameter, the index as seed)."""
        if self._pending_reset is None:
            text = self._parameter("task")
            self._pending_reset = (parse_task(text) if text else None, None)


class _PhysicsLoop:
    """The physics thread's loop: control steps, publishing on their schedules, pacing."""

    def __init__(self, node: SimNode) -> None:
        self.node = node
        p = node._parameter
        self.rtf = float(p("real_time_factor"))
        self.joint_names = list(p("joint_names"))
        self.width, self.height = int(p("image_width")), int(p("image_height"))
        self.periods = {
            "joints": 1.0 / p("joint_state_rate_hz"),
            "cameras": 1.0 / p("camera_rate_hz"),
            "clock": 1.0 / p("clock_rate_hz"),
            "episode": EPISODE_REPORT_PERIOD_S,
            "narration": float(p("narration_period_s")),
        }
        self.due = dict.fromkeys(self.periods, node.sim.now_s)
        self.auto_reset_s = float(p("auto_reset_s"))
        self.ended_at_s: float | None = None  # sim time the last episode ended
        self.cameras_failed = False
        self.status = None
        self.subtask = None
        self.narration = None

    def run(self, stop: threading.Event) -> None:
        node, sim = self.node, self.node.sim
        wall_anchor, sim_anchor = time.perf_counter(), sim.now_s
        while not stop.is_set() and rclpy.ok(context=node.context):
            if node._paused.is_set():
                with node._lock:
                    if node._apply_pending_reset():
                        self._publish_episode_start()
                time.sleep(0.005)
                wall_anchor, sim_anchor = time.perf_counter(), sim.now_s
                continue
            if node.step_gate is not None:
                node.step_gate(sim.now_s)
            with node._lock:
                jump = node.take_clock_jump()
                if jump:
                    self._jump_clock(jump)
                    wall_anchor, sim_anchor = time.perf_counter(), sim.now_s
                if node._apply_pending_reset():
                    self._publish_episode_start()
                sim.control_step()
                now = sim.now_s
                self._publish_episode_changes(now)
                if self._is_due("joints", now) and "joint_states" not in node.silent_streams:
                    self._publish_joint_states(now)
                if self._auto_reset_due(now):
                    node._queue_auto_reset()
            if self._is_due("clock", now):
                node._clock_publisher.publish(Clock(clock=seconds_to_stamp(now)))
            if self._is_due("cameras", now):
                self._publish_images(now)  # outside the lock: only this thread changes the world
            if self.rtf > 0:
                ahead = wall_anchor + (now - sim_anchor) / self.rtf - time.perf_counter()
                if ahead > 0:
                    time.sleep(ahead)
                elif ahead < -MAX_LAG_S:
                    wall_anchor, sim_anchor = time.perf_counter(), now

    def _jump_clock(self, seconds: float) -> None:
        """Under the lock: sim time jumps by ``seconds`` (see :data:`FAULT_PARAMETERS`); the
        episode's times and the publishing schedule move with it."""
        sim = self.node.sim
        sim.now_s += seconds
        sim.episode_start_s += seconds
        if sim.episode_end_s is not None:
            sim.episode_end_s += seconds
        if self.ended_at_s is not None:
            self.ended_at_s += seconds
        self.due = {what: due + seconds for what, due in self.due.items()}
        self.node.get_logger().warning(f"fault injection: the clock jumped {seconds:+g} s")

    def _auto_reset_due(self, now: float) -> bool:
        if self.auto_reset_s < 0 or self.ended_at_s is None:
            return False
        return now >= self.ended_at_s + self.auto_reset_s

    def _is_due(self, what: str, now: float) -> bool:
        if now + 1e-9 < self.due[what]:
            return False
        # the next one a period later; after a stall, a period from now (no bursts)
        self.due[what] = max(self.due[what] + self.periods[what], now + 0.5 * self.periods[what])
        return True

    # -- publishing (under the lock unless said otherwise) ----------------------------------------
    def _publish_episode_start(self) -> None:
        sim = self.node.sim
        self.node._task.publish(String(data=sim.task.text))
        self.status = self.subtask = self.narration = self.ended_at_s = None
        self.due = dict.fromkeys(self.periods, sim.now_s)  # every stream starts with the episode
        self._publish_episode_changes(sim.now_s, narrate=False)  # narration: at the first step
        self.node.get_logger().info(f"episode {sim.episode}: {sim.task.text!r} (seed {sim.seed})")

    def _publish_episode_changes(self, now: float, narrate: bool = True) -> None:
        """Publish what changed: sim/episode (also every EPISODE_REPORT_PERIOD_S), sim/subtask,
        and with ``narrate`` sim/narration (also every narration_period_s while running)."""
        node, sim = self.node, self.node.sim
        if sim.phase is None:
            return
        if sim.status != self.status or self._is_due("episode", now):
            if sim.status != self.status and sim.status != RUNNING:
                self.ended_at_s = now
                node.get_logger().info(
                    f"episode {sim.episode} {sim.status} after {sim.elapsed_s:.2f} sim s"
                )
            self.status = sim.status
            node._episode.publish(String(data=json.dumps(sim.episode_report())))
        if sim.phase.subtask != self.subtask:
            self.subtask = sim.phase.subtask
            node._subtask.publish(String(data=self.subtask))
        if not narrate:
            return
        changed = sim.phase.narration != self.narration
        periodic = sim.status == RUNNING and now >= self.due["narration"]
        if changed or periodic:
            self.narration = sim.phase.narration
            self.due["narration"] = now + self.periods["narration"]
            node._narration.publish(String(data=self.narration))

    def _publish_joint_states(self, now: float) -> None:
        world = self.node.sim.world
        positions = dict(zip(ARM_JOINTS, world.arm_positions().tolist(), strict=True))
        velocities = dict(zip(ARM_JOINTS, world.arm_velocities().tolist(), strict=True))
        positions[GRIPPER_JOINT] = world.gripper_opening()
        velocities[GRIPPER_JOINT] = world.gripper_velocity()
        msg = JointState()
        msg.header.stamp = seconds_to_stamp(now)
        msg.name = self.joint_names
        msg.position = [positions[n] for n in self.joint_names]
        msg.velocity = [velocities[n] for n in self.joint_names]
        self.node._joint_states.publish(msg)

    def _publish_images(self, now: float) -> None:
        """Not under the lock: rendering reads the world, which only this thread changes."""
        if self.cameras_failed:
            return
        stamp = seconds_to_stamp(now)
        for camera, publisher in self.node._cameras.items():
            if camera in self.node.silent_streams:
                continue
            try:
                rgb = self.node.sim.world.render(camera, self.width, self.height)
            except Exception as error:  # no OpenGL: the robot runs on, blind
                self.cameras_failed = True
                self.node.get_logger().error(
                    f"rendering failed, no camera images from now on: {error!r} (headless "
                    "rendering needs MUJOCO_GL=egl set before mujoco is first imported)"
                )
                return
            publisher.publish(rgb_to_image(rgb, stamp, f"{camera}_camera"))
