"""The closed-loop benches' own ROS node (:class:`BenchNode`): the one recorder of every bench
(joint states, the trajectories both controllers receive, the sim's subtasks and episode reports,
the policy's chunks, subtasks and narrations, and on request the sim's input streams by content)
into a :class:`Recording`; the node's server on /diagnostics; and it drives the policy node's
lifecycle and parameters, the sim's reset and the Ask action. The processes it watches are started
by :mod:`.harness`.

A fresh DDS client can lose the reply to its first request: requests that change nothing are
resent, lifecycle transitions go out on a client primed with a harmless request (as
test/node_harness.py does), and a reset is confirmed by the episode it starts on ``sim/episode``.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState, GetState
from rcl_interfaces.srv import SetParameters
from rclpy.action import ActionClient
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import String
from std_srvs.srv import Trigger
from trajectory_msgs.msg import JointTrajectory

from oxygen_ros.action import Ask
from oxygen_ros.msg import ActionChunk
from oxygen_ros.ros.convert import stamp_to_seconds
from oxygen_ros.sim.node import CAMERAS
from oxygen_ros.sim.scene import ARM_JOINTS
from oxygen_ros.tools.benches.closed_loop_metrics import Plan
from oxygen_ros.tools.processes import wait_for

POLICY_NODE = "oxygen_node"
EXPERT_NAMESPACE = "expert"
STATE_UNCONFIGURED, STATE_INACTIVE, STATE_ACTIVE = 1, 2, 3
CONFIGURE, CLEANUP, ACTIVATE, DEACTIVATE = 1, 2, 3, 4  # lifecycle_msgs/Transition ids
NO_TRANSITION = "oxygen_bench_no_such_transition"  # answered False, changes nothing
LATCHED = QoSProfile(
    depth=10, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL
)
RELIABLE = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
INPUT_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
JOINT_STATES = "joint_states"  # the joint states' stream among the recorded inputs
CONTROLLERS = ("arm_controller", "gripper_controller")


def digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def positions_digest(positions: Sequence[float]) -> bytes:
    """Joint positions as the node hands them to its engine (float32, in its joint order)."""
    return digest(np.asarray(positions, dtype=np.float32).tobytes())


@dataclass(frozen=True)
class Received:
    """A chunk or a trajectory as it reached this process."""

    at: float  # time.monotonic() then
    sim_at: float  # sim time then (the newest joint state's stamp)
    stamp: float  # its header stamp, sim seconds
    end: float = math.nan  # a trajectory's last point, sim seconds
    arm: bool = True  # a trajectory for the arm's controller (else the gripper's)
    on_time: bool = True  # a chunk's deadline_met


@dataclass(frozen=True)
class Arrival:
    """An input message as it reached this process."""

    at: float  # time.monotonic() then
    stamp_ns: int


@dataclass
class Recording:
    """What one episode leaves (times: ``m_`` monotonic wall seconds of receipt, else sim s)."""

    namespace: str
    start_sim: float = -math.inf  # sim time the episode was seen running
    end_sim: float = math.inf  # sim time it was seen ended
    joint_times: list[float] = field(default_factory=list)
    joint_positions: list[list[float]] = field(default_factory=list)
    plans: list[Plan] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # sim time each plan reached the sim
    sim_subtasks: list[tuple[float, str]] = field(default_factory=list)  # (m_, text)
    reports: list[tuple[float, dict]] = field(default_factory=list)  # (m_, sim/episode)
    chunks: list[Received] = field(default_factory=list)
    trajectories: list[Received] = field(default_factory=list)  # both controllers'
    inputs: dict[str, list[Arrival]] = field(default_factory=dict)  # stream -> arrivals
    by_content: dict[str, dict[bytes, list[Arrival]]] = field(default_factory=dict)
    policy_subtasks: list[tuple[float, str]] = field(default_factory=list)  # (m_, text)
    narrations: list[tuple[float, str]] = field(default_factory=list)  # (m_, "[kind] text")

    def arm_times(self) -> list[float]:
        """When the arm controller's trajectories arrived (monotonic s)."""
        return [t.at for t in self.trajectories if t.arm]

    def add_input(self, stream: str, content: bytes, stamp: Any) -> None:
        arrival = Arrival(time.monotonic(), stamp.sec * 1_000_000_000 + stamp.nanosec)
        self.inputs.setdefault(stream, []).append(arrival)
        self.by_content.setdefault(stream, {}).setdefault(content, []).append(arrival)

    def source(self, stream: str, content: bytes, by: float) -> Arrival | None:
        """The newest message of ``stream`` with this content that arrived by ``by``."""
        arrived = [a for a in self.by_content.get(stream, {}).get(content, []) if a.at <= by]
        return arrived[-1] if arrived else None

    def reports_of(self, index: int) -> list[tuple[float, dict]]:
        """The sim's reports of episode ``index``."""
        return [(t, r) for t, r in self.reports if r.get("episode") == index]

    def ended_at(self, index: int) -> float:
        """When this process heard episode ``index`` end (monotonic s; NaN: never)."""
        ends = (t for t, r in self.reports_of(index) if r.get("status") not in (None, "running"))
        return next(ends, math.nan)

    def outcome(self, index: int, fault_at: float | None = None) -> str:
        """The sim's verdict on episode ``index`` ("lost": no report), "... before the fault"
        when it ended before ``fault_at`` (monotonic s)."""
        reports = self.reports_of(index)
        if not reports:
            return "lost"
        final = reports[-1][1].get("status", "lost")
        if fault_at is not None and self.ended_at(index) < fault_at:
            return f"{final} before the fault"
        return final


def episode_wall_limit(timeout_s: float) -> float:
    """Wall seconds to wait for an episode of ``timeout_s`` sim seconds: a slow machine slows sim
    time."""
    return 4 * timeout_s + 30.0


class BenchNode:
    """The bench's ROS node (own context, spun in a background thread). ``joint_names``: also
    record the main sim's inputs (cameras, joint states in that order) by content."""

    def __init__(
        self,
        namespaces: Sequence[str] = ("", EXPERT_NAMESPACE),
        joint_names: Sequence[str] | None = None,
    ) -> None:
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        node = self.node = rclpy.create_node("closed_loop_bench", context=self.context)
        self.lock = threading.Lock()
        self.recording: Recording | None = None
        self.sim_now: dict[str, float] = {}
        self.reports: dict[str, dict] = {}
        self.sim_clients: dict[str, tuple[Any, Any]] = {}
        self.server: dict[str, str] = {}  # the policy node's server values on /diagnostics
        self.server_seen = 0
        self._input_joints = list(joint_names) if joint_names is not None else None
        for ns in namespaces:
            prefix = f"/{ns}" if ns else ""
            node.create_subscription(JointState, f"{prefix}/joint_states", self._on_joints(ns), 50)
            for controller in CONTROLLERS:
                node.create_subscription(
                    JointTrajectory,
                    f"{prefix}/{controller}/joint_trajectory",
                    self._on_trajectory(ns, controller == CONTROLLERS[0]),
                    RELIABLE,
                )
            node.create_subscription(
                String, f"{prefix}/sim/subtask", self._text(ns, "sim_subtasks"), LATCHED
            )
            node.create_subscription(String, f"{prefix}/sim/episode", self._on_report(ns), LATCHED)
            self.sim_clients[ns] = (
                node.create_client(SetParameters, f"{prefix}/sim/set_parameters"),
                node.create_client(Trigger, f"{prefix}/sim/reset"),
            )
        if self._input_joints is not None:
            for camera in CAMERAS:
                on_image = self._on_image(camera)
                node.create_subscription(Image, f"/camera/{camera}/image_raw", on_image, INPUT_QOS)
        node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, RELIABLE)
        policy = f"/{POLICY_NODE}"
        node.create_subscription(ActionChunk, f"{policy}/action_chunk", self._on_chunk, RELIABLE)
        node.create_subscription(
            String, f"{policy}/subtask", self._text("", "policy_subtasks"), LATCHED
        )
        node.create_subscription(
            String, f"{policy}/narration_text", self._text("", "narrations"), RELIABLE
        )
        self.change_state_client = node.create_client(ChangeState, f"{policy}/change_state")
        self.get_state_client = node.create_client(GetState, f"{policy}/get_state")
        self.policy_parameters = node.create_client(SetParameters, f"{policy}/set_parameters")
        self.ask_client = ActionClient(node, Ask, f"{policy}/ask")  # before the executor spins
        self._primed: set[int] = set()
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(node)
        self._spinner = threading.Thread(target=self.executor.spin, daemon=True)
        self._spinner.start()

    # -- recording --------------------------------------------------------------------------------
    def _recording_of(self, ns: str) -> Recording | None:
        rec = self.recording
        return rec if rec is not None and rec.namespace == ns else None

    def _add(self, ns: str, name: str, item: Any) -> None:
        """Append ``item`` to the recording's list ``name`` when recording ``ns``."""
        with self.lock:
            rec = self._recording_of(ns)
            if rec is not None:
                getattr(rec, name).append(item)

    def _text(self, ns: str, name: str) -> Callable[[String], None]:
        return lambda msg: self._add(ns, name, (time.monotonic(), msg.data))

    def _on_joints(self, ns: str) -> Callable[[JointState], None]:
        def on_joints(msg: JointState) -> None:
            t = stamp_to_seconds(msg.header.stamp)
            names = list(msg.name)
            content = None
            if not ns and self._input_joints is not None:
                content = positions_digest(
                    [msg.position[names.index(j)] for j in self._input_joints]
                )
            with self.lock:
                self.sim_now[ns] = t
                rec = self._recording_of(ns)
                if rec is not None:
                    rec.joint_times.append(t)
                    rec.joint_positions.append([msg.position[names.index(j)] for j in ARM_JOINTS])
                    if content is not None:
                        rec.add_input(JOINT_STATES, content, msg.header.stamp)

        return on_joints

    def _on_image(self, camera: str) -> Callable[[Image], None]:
        def on_image(msg: Image) -> None:
            content = digest(bytes(msg.data))
            with self.lock:
                if (rec := self._recording_of("")) is not None:
                    rec.add_input(camera, content, msg.header.stamp)

        return on_image

    def _on_trajectory(self, ns: str, arm: bool) -> Callable[[JointTrajectory], None]:
        def on_trajectory(msg: JointTrajectory) -> None:
            stamp = stamp_to_seconds(msg.header.stamp)
            last = msg.points[-1].time_from_start if msg.points else None
            span = last.sec + last.nanosec * 1e-9 if last is not None else 0.0
            with self.lock:
                rec = self._recording_of(ns)
                now = self.sim_now.get(ns, math.nan)
                if rec is None:
                    return
                rec.trajectories.append(Received(time.monotonic(), now, stamp, stamp + span, arm))
                if not arm or math.isnan(now) or not msg.points:
                    return
                start = stamp or now  # a zero stamp: "start now"
                order = [list(msg.joint_names).index(j) for j in ARM_JOINTS]
                times = [
                    start + p.time_from_start.sec + p.time_from_start.nanosec * 1e-9
                    for p in msg.points
                ]
                positions = [[p.positions[i] for i in order] for p in msg.points]
                rec.plans.append(Plan(np.array(times), np.array(positions)))
                rec.arrivals.append(now)

        return on_trajectory

    def _on_report(self, ns: str) -> Callable[[String], None]:
        def on_report(msg: String) -> None:
            report = json.loads(msg.data)
            with self.lock:
                self.reports[ns] = report
                rec = self._recording_of(ns)
                if rec is not None:
                    rec.reports.append((time.monotonic(), report))

        return on_report

    def _on_chunk(self, msg: ActionChunk) -> None:
        stamp, on_time = stamp_to_seconds(msg.header.stamp), bool(msg.deadline_met)
        received = Received(time.monotonic(), self.now(""), stamp, on_time=on_time)
        self._add("", "chunks", received)

    def _on_diagnostics(self, msg: DiagnosticArray) -> None:
        values = {
            kv.key: kv.value
            for status in msg.status
            if status.name == f"{POLICY_NODE}: server"
            for kv in status.values
        }
        if values:
            with self.lock:
                self.server = values
                self.server_seen += 1

    def fresh_server(self, timeout_s: float = 10.0) -> dict[str, str]:
        """The node's server values from a /diagnostics message sent after this call."""
        seen = self.server_seen
        if not wait_for(lambda: self.server_seen > seen, timeout_s):
            raise TimeoutError("no server status from the policy node on /diagnostics")
        with self.lock:
            return dict(self.server)

    def arm_times(self) -> list[float]:
        """When the arm's trajectories arrived in the recording so far (monotonic s)."""
        with self.lock:
            return [] if self.recording is None else self.recording.arm_times()

    def chunk_times(self) -> list[float]:
        """When the chunks arrived in the recording so far (monotonic s)."""
        with self.lock:
            return [] if self.recording is None else [c.at for c in self.recording.chunks]

    def start_recording(self, namespace: str) -> Recording:
        with self.lock:
            self.recording = Recording(namespace)
            return self.recording

    def stop_recording(self) -> Recording:
        with self.lock:
            rec, self.recording = self.recording, None
        return rec

    def forget_reports(self, ns: str) -> None:
        """Drop the last episode report of ``ns`` (its sim restarts: episode indices too)."""
        with self.lock:
            self.reports.pop(ns, None)

    def now(self, ns: str) -> float:
        """The newest sim time seen on ``ns``'s joint_states (NaN before any)."""
        with self.lock:
            return self.sim_now.get(ns, float("nan"))

    def report(self, ns: str) -> dict:
        with self.lock:
            return dict(self.reports.get(ns, {}))

    def episode_ended(self, ns: str, index: int) -> bool:
        """Whether the sim in ``ns`` has reported episode ``index`` over."""
        report = self.report(ns)
        return report.get("episode") == index and report.get("status") != "running"

    def wait_episode_end(self, ns: str, index: int, timeout_s: float) -> bool:
        """Wait for episode ``index`` (of ``timeout_s`` sim seconds) to end; False: it did not."""
        return wait_for(lambda: self.episode_ended(ns, index), episode_wall_limit(timeout_s))

    # -- services ---------------------------------------------------------------------------------
    def _send(self, client: Any, request: Any, timeout: float, tries: int = 1) -> Any:
        for _ in range(tries):
            future = client.call_async(request)
            if wait_for(future.done, timeout / tries):
                return future.result()
        raise TimeoutError(f"no reply from {client.srv_name} in {timeout} s ({tries} tries)")

    def _prime(self, client: Any, harmless: Any, timeout: float = 20.0) -> None:
        if id(client) not in self._primed:
            if not client.wait_for_service(timeout_sec=timeout):
                raise TimeoutError(f"service {client.srv_name} not available")
            self._send(client, harmless, timeout, tries=4)
            self._primed.add(id(client))

    def policy_state(self) -> int:
        reply = self._send(self.get_state_client, GetState.Request(), 20.0, tries=4)
        return reply.current_state.id

    def wait_for_policy(self, timeout: float = 120.0) -> None:
        if not self.get_state_client.wait_for_service(timeout_sec=timeout):
            raise TimeoutError("the policy node's lifecycle services never appeared")

    def transition(self, transition_id: int, timeout: float = 180.0) -> bool:
        client = self.change_state_client
        self._prime(client, ChangeState.Request(transition=Transition(label=NO_TRANSITION)))
        request = ChangeState.Request(transition=Transition(id=transition_id))
        return self._send(client, request, timeout).success

    def _set_parameters(self, client: Any, values: dict[str, Any], who: str) -> None:
        """Set ``values`` through ``client`` (absolute values: sending them twice is harmless)."""
        request = SetParameters.Request(
            parameters=[Parameter(k, value=v).to_parameter_msg() for k, v in values.items()]
        )
        results = self._send(client, request, 20.0, tries=4).results
        failed = [(k, r.reason) for k, r in zip(values, results, strict=True) if not r.successful]
        if failed:
            raise RuntimeError(f"{who} refused parameters: {failed}")

    def set_policy_parameters(self, values: dict[str, Any]) -> None:
        self._prime(self.policy_parameters, SetParameters.Request())
        self._set_parameters(self.policy_parameters, values, "the policy node")

    def set_sim_parameters(self, ns: str, values: dict[str, Any]) -> None:
        self._set_parameters(self.sim_clients[ns][0], values, f"the sim in /{ns}")

    def start_episode(self, ns: str, task: str, seed: int, timeout: float = 60.0) -> int:
        """Set the sim's task and seed, call ``sim/reset``; the new episode's index once it runs.

        Raises:
            TimeoutError: no reply and no new episode on ``sim/episode``.
        """
        parameters, reset = self.sim_clients[ns]
        self._primed.discard(id(parameters))  # the expert's sim is a new process each time
        self._prime(parameters, SetParameters.Request(), timeout)
        self.set_sim_parameters(ns, {"task": task, "seed": int(seed)})
        if not reset.wait_for_service(timeout_sec=timeout):
            raise TimeoutError(f"{reset.srv_name} not available")
        before = self.report(ns).get("episode", -1)
        future = reset.call_async(Trigger.Request())

        def started() -> bool:
            report = self.report(ns)
            return report.get("episode", -1) > before and report.get("status") == "running"

        if not wait_for(started, 20.0):
            raise TimeoutError(f"sim/reset in /{ns}: no new episode (reply: {future.done()})")
        return self.report(ns)["episode"]

    def ask(self, question: str) -> Any:
        """Send an Ask goal; returns a future of its result (None: not accepted in time)."""
        if not self.ask_client.wait_for_server(timeout_sec=5.0):
            return None
        sent = self.ask_client.send_goal_async(Ask.Goal(question=question))
        if not wait_for(sent.done, 10.0) or not sent.result().accepted:
            return None
        return sent.result().get_result_async()

    def close(self) -> None:
        self.executor.shutdown()
        self.node.destroy_node()
        rclpy.try_shutdown(context=self.context)
        self._spinner.join(timeout=5)
