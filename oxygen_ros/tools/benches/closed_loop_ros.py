"""The closed-loop benches' own ROS node (:class:`BenchNode`): it records what an episode needs
(joint states, the trajectories the sim's controllers receive, the sim's subtasks and episode
reports, the policy's chunks, subtasks and narrations) into a :class:`Recording`, and drives the
policy node's lifecycle and parameters, the sim's reset and the Ask action. The processes it
watches are started by :mod:`.harness`.

A fresh DDS client can lose the reply to its first request: requests that change nothing are
resent, lifecycle transitions go out on a client primed with a harmless request (as
test/node_harness.py does), and a reset is confirmed by the episode it starts on ``sim/episode``.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import rclpy
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState, GetState
from rcl_interfaces.srv import SetParameters
from rclpy.action import ActionClient
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import JointState
from std_msgs.msg import String
from std_srvs.srv import Trigger
from trajectory_msgs.msg import JointTrajectory

from oxygen_ros.action import Ask
from oxygen_ros.msg import ActionChunk
from oxygen_ros.ros.convert import stamp_to_seconds
from oxygen_ros.sim.scene import ARM_JOINTS
from oxygen_ros.tools.benches.closed_loop_metrics import Plan

POLICY_NODE = "oxygen_node"
EXPERT_NAMESPACE = "expert"
STATE_UNCONFIGURED, STATE_INACTIVE, STATE_ACTIVE = 1, 2, 3
CONFIGURE, CLEANUP, ACTIVATE, DEACTIVATE = 1, 2, 3, 4  # lifecycle_msgs/Transition ids
NO_TRANSITION = "oxygen_bench_no_such_transition"  # answered False, changes nothing
LATCHED = QoSProfile(
    depth=10, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL
)
RELIABLE = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


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
    chunks: list[tuple[float, bool, float]] = field(default_factory=list)  # (m_, on time, stamp)
    policy_subtasks: list[tuple[float, str]] = field(default_factory=list)  # (m_, text)
    narrations: list[tuple[float, str]] = field(default_factory=list)  # (m_, "[kind] text")

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
    """The bench's ROS node (own context, spun in a background thread)."""

    def __init__(self, namespaces: Sequence[str] = ("", EXPERT_NAMESPACE)) -> None:
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        node = self.node = rclpy.create_node("closed_loop_bench", context=self.context)
        self.lock = threading.Lock()
        self.recording: Recording | None = None
        self.sim_now: dict[str, float] = {}
        self.reports: dict[str, dict] = {}
        self.sim_clients: dict[str, tuple[Any, Any]] = {}
        for ns in namespaces:
            prefix = f"/{ns}" if ns else ""
            node.create_subscription(JointState, f"{prefix}/joint_states", self._on_joints(ns), 50)
            node.create_subscription(
                JointTrajectory,
                f"{prefix}/arm_controller/joint_trajectory",
                self._on_trajectory(ns),
                RELIABLE,
            )
            node.create_subscription(String, f"{prefix}/sim/subtask", self._on_subtask(ns), LATCHED)
            node.create_subscription(String, f"{prefix}/sim/episode", self._on_report(ns), LATCHED)
            self.sim_clients[ns] = (
                node.create_client(SetParameters, f"{prefix}/sim/set_parameters"),
                node.create_client(Trigger, f"{prefix}/sim/reset"),
            )
        policy = f"/{POLICY_NODE}"
        node.create_subscription(ActionChunk, f"{policy}/action_chunk", self._on_chunk, RELIABLE)
        node.create_subscription(String, f"{policy}/subtask", self._policy_text("sub"), LATCHED)
        node.create_subscription(
            String, f"{policy}/narration_text", self._policy_text("text"), RELIABLE
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

    def _on_joints(self, ns: str) -> Callable[[JointState], None]:
        def on_joints(msg: JointState) -> None:
            t = stamp_to_seconds(msg.header.stamp)
            names = list(msg.name)
            with self.lock:
                self.sim_now[ns] = t
                rec = self._recording_of(ns)
                if rec is not None:
                    rec.joint_times.append(t)
                    rec.joint_positions.append([msg.position[names.index(j)] for j in ARM_JOINTS])

        return on_joints

    def _on_trajectory(self, ns: str) -> Callable[[JointTrajectory], None]:
        def on_trajectory(msg: JointTrajectory) -> None:
            with self.lock:
                rec = self._recording_of(ns)
                now = self.sim_now.get(ns)
                if rec is None or now is None or not msg.points:
                    return
                start = stamp_to_seconds(msg.header.stamp) or now  # a zero stamp: "start now"
                order = [list(msg.joint_names).index(j) for j in ARM_JOINTS]
                times = [
                    start + p.time_from_start.sec + p.time_from_start.nanosec * 1e-9
                    for p in msg.points
                ]
                positions = [[p.positions[i] for i in order] for p in msg.points]
                rec.plans.append(Plan(np.array(times), np.array(positions)))
                rec.arrivals.append(now)

        return on_trajectory

    def _on_subtask(self, ns: str) -> Callable[[String], None]:
        def on_subtask(msg: String) -> None:
            with self.lock:
                rec = self._recording_of(ns)
                if rec is not None:
                    rec.sim_subtasks.append((time.monotonic(), msg.data))

        return on_subtask

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
        with self.lock:
            rec = self._recording_of("")
            if rec is not None:
                rec.chunks.append(
                    (time.monotonic(), bool(msg.deadline_met), stamp_to_seconds(msg.header.stamp))
                )

    def _policy_text(self, which: str) -> Callable[[String], None]:
        def on_text(msg: String) -> None:
            with self.lock:
                rec = self._recording_of("")
                if rec is not None:
                    target = rec.policy_subtasks if which == "sub" else rec.narrations
                    target.append((time.monotonic(), msg.data))

        return on_text

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
