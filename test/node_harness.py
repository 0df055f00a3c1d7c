"""Helpers for tests that run the real node in a subprocess and talk to it over DDS.

* :class:`NodeProcess` starts ``python -m oxygen_ros.ros.node`` with a params file, keeps its log,
  and stops it with SIGINT;
* :class:`Probe` is the test's own ROS node: it records the node's outputs (chunks, trajectories,
  narration, /diagnostics), the header stamps of the inputs the test publishes, calls the node's
  lifecycle and parameter services, and replays bags with :class:`BagPlayer`;
* :class:`AskClient` sends the node's Ask action goals from a probe and keeps their feedback.

The ROS environment (localhost discovery, a random domain id) comes from conftest.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from lifecycle_msgs.msg import Transition
from lifecycle_msgs.srv import ChangeState, GetState
from rcl_interfaces.msg import SetParametersResult
from rcl_interfaces.srv import GetParameters, SetParameters
from rclpy.action import ActionClient
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter, parameter_value_to_python
from rclpy.qos import QoSProfile, ReliabilityPolicy
from std_msgs.msg import String
from trajectory_msgs.msg import JointTrajectory
from visualization_msgs.msg import Marker

from oxygen_ros.action import Ask
from oxygen_ros.msg import ActionChunk, Narration
from oxygen_ros.tools.make_bag import camera_topic, joint_names
from oxygen_ros.tools.processes import wait_for
from oxygen_ros.tools.replay import BagPlayer

NODE = "oxygen_node"
# What `make_bag.write_synthetic_bag` publishes: two cameras and the joint states.
SYNTHETIC_INPUT_TOPICS = [camera_topic("base"), camera_topic("wrist"), "/joint_states"]
# a ChangeState label that names no lifecycle transition (the probe's harmless first request)
UNKNOWN_TRANSITION = "oxygen_ros_harness_no_such_transition"


def synthetic_bag_params(checkpoint: Path) -> dict[str, Any]:
    """Node parameters wiring the synthetic bag (its base and wrist cameras into the base and
    left-wrist slots, its 7 joints) to the model in ``checkpoint``; a test adds its own."""
    return {
        "checkpoint_dir": str(checkpoint),
        "camera_topics": [camera_topic("base"), camera_topic("wrist")],
        "camera_slots": ["base_0_rgb", "left_wrist_0_rgb"],
        "joint_names": joint_names(7),
    }


STATE_UNCONFIGURED, STATE_INACTIVE, STATE_ACTIVE = 1, 2, 3


def send_request(client: Any, name: str, request: Any, timeout: float, tries: int = 1) -> Any:
    """Send ``request`` on service ``client`` (named ``name``) and return the reply; with ``tries``
    > 1, send it again each time a share of ``timeout`` passes without one (only for a request
    that changes nothing: see `Probe.call`).

    Raises:
        AssertionError: no reply within ``timeout``.
    """
    for _ in range(tries):
        future = client.call_async(request)
        if wait_for(future.done, timeout / tries):
            return future.result()
    raise AssertionError(f"no reply from {name} within {timeout} s ({tries} tries)")


def stamp_ns(stamp) -> int:
    return stamp.sec * 1_000_000_000 + stamp.nanosec


class NodeProcess:
    """``oxygen_node`` in a subprocess of this venv's Python, with ``parameters`` as its params
    file, named ``name`` in ``namespace`` (default: the root)."""

    def __init__(
        self, parameters: dict[str, Any], work: Path, name: str = NODE, namespace: str = ""
    ) -> None:
        work.mkdir(parents=True, exist_ok=True)
        stem = f"{namespace.strip('/').replace('/', '_')}_{name}" if namespace else name
        self.params_file = work / f"{stem}_params.yaml"
        self.params_file.write_text(json.dumps({"/**": {"ros__parameters": parameters}}, indent=2))
        self.log_path = work / f"{stem}.log"
        remaps = ["-r", f"__node:={name}"]
        if namespace:
            remaps += ["-r", f"__ns:=/{namespace.strip('/')}"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "oxygen_ros.ros.node",
                    "--ros-args",
                    "--params-file",
                    str(self.params_file),
                    *remaps,
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 20.0, signum: int = signal.SIGINT) -> int:
        """Send ``signum``, then wait; kill if it does not exit in time. Returns the exit status."""
        if self.alive():
            self.process.send_signal(signum)
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired as exc:
                self.process.kill()
                self.process.wait()
                raise AssertionError(
                    f"node did not exit within {timeout} s of signal {signum}; "
                    f"log:\n{self.log()[-3000:]}"
                ) from exc
        return self.process.returncode


class Probe:
    """The test's ROS node (own context, spun in a background thread), watching node ``target``
    (its name, with its namespace when it has one: ``r1/oxygen_node``)."""

    def __init__(self, input_topics: Sequence[str] = (), target: str = NODE) -> None:
        self.target = target
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node(f"probe_of_{target.replace('/', '_')}", context=self.context)
        self.lock = threading.Lock()
        self.chunks: list[tuple[float, ActionChunk]] = []
        self.trajectories: list[tuple[float, JointTrajectory]] = []
        self.gripper_trajectories: list[tuple[float, JointTrajectory]] = []
        # (output, wall-clock receive time in s, message) of ~/joint_trajectory ("arm") and
        # ~/gripper_trajectory ("gripper"): what a controller sees, and when
        self.arrivals: list[tuple[str, float, JointTrajectory]] = []
        self.narrations: list[Narration] = []
        self.texts: list[str] = []
        self.diagnostics: dict[str, str] = {}
        self.diagnostics_count = 0
        self.input_stamps: set = set()
        self.input_topics_heard: set[str] = set()  # input topics with at least one message
        reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        node = self.node
        node.create_subscription(ActionChunk, f"/{target}/action_chunk", self._on_chunk, reliable)
        node.create_subscription(
            JointTrajectory, f"/{target}/joint_trajectory", self._on_trajectory, reliable
        )
        node.create_subscription(
            JointTrajectory,
            f"/{target}/gripper_trajectory",
            self._on_gripper_trajectory,
            reliable,
        )
        node.create_subscription(
            Narration, f"/{target}/narration", self._append(self.narrations), reliable
        )
        node.create_subscription(
            String,
            f"/{target}/narration_text",
            lambda m: self._append(self.texts)(m.data),
            reliable,
        )
        node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, reliable)
        for topic in input_topics:
            self._record_stamps(topic)
        self.ask = node.create_publisher(String, f"/{target}/ask", 10)
        self.instruction = node.create_publisher(String, f"/{target}/instruction", 10)
        # Created before the node spins: rclpy 9 (Kilted) registers an ActionClient with its node
        # before the client is fully built, so a spinning executor can meet it half-made.
        self.ask_action = ActionClient(node, Ask, f"/{target}/ask")
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(node)
        self._spinner = threading.Thread(target=self.executor.spin, daemon=True)
        self._spinner.start()

    # -- recording --------------------------------------------------------------------------------
    def _append(self, target: list) -> Callable[[Any], None]:
        def append(item: Any) -> None:
            with self.lock:
                target.append(item)

        return append

    def _on_chunk(self, msg: ActionChunk) -> None:
        with self.lock:
            self.chunks.append((time.monotonic(), msg))

    def _on_trajectory(self, msg: JointTrajectory) -> None:
        with self.lock:
            self.trajectories.append((time.monotonic(), msg))
            self.arrivals.append(("arm", time.time(), msg))

    def _on_gripper_trajectory(self, msg: JointTrajectory) -> None:
        with self.lock:
            self.gripper_trajectories.append((time.monotonic(), msg))
            self.arrivals.append(("gripper", time.time(), msg))

    def _on_diagnostics(self, msg: DiagnosticArray) -> None:
        values = {
            kv.key: kv.value
            for status in msg.status
            if status.name.startswith(f"{self.target}:")
            for kv in status.values
        }
        if values:
            with self.lock:
                self.diagnostics = values
                self.diagnostics_count += 1

    def _record_stamps(self, topic: str) -> None:
        """Record header stamps (ns) of every message on ``topic`` from its raw CDR bytes."""

        def on_raw(raw: bytes) -> None:
            order = "<" if raw[1:2] == b"\x01" else ">"
            sec, nanosec = struct.unpack_from(f"{order}iI", raw, 4)
            with self.lock:
                self.input_stamps.add(sec * 1_000_000_000 + nanosec)
                self.input_topics_heard.add(topic)

        from oxygen_ros.tools.replay import message_class, qos_for

        msg_type = (
            "sensor_msgs/msg/JointState"
            if "joint" in topic
            else (
                "sensor_msgs/msg/CompressedImage"
                if topic.endswith("compressed")
                else "sensor_msgs/msg/Image"
            )
        )
        qos = qos_for(msg_type)
        qos = QoSProfile(depth=100, reliability=qos.reliability)
        self.node.create_subscription(message_class(msg_type), topic, on_raw, qos, raw=True)

    def heard_all(self, topics: Sequence[str]) -> bool:
        """Whether every one of ``topics`` has delivered a message to this probe."""
        with self.lock:
            return set(topics) <= self.input_topics_heard

    def chunks_since(self, since: float) -> list[ActionChunk]:
        with self.lock:
            return [msg for t, msg in self.chunks if t >= since]

    def trajectories_since(self, since: float) -> list[JointTrajectory]:
        with self.lock:
            return [msg for t, msg in self.trajectories if t >= since]

    def gripper_trajectories_since(self, since: float) -> list[JointTrajectory]:
        with self.lock:
            return [msg for t, msg in self.gripper_trajectories if t >= since]

    def fresh_diagnostics(self, timeout: float = 5.0) -> dict[str, str]:
        """The first /diagnostics message that arrives after this call."""
        with self.lock:
            seen = self.diagnostics_count
        assert wait_for(lambda: self.diagnostics_count > seen, timeout), (
            "no /diagnostics from the node"
        )
        with self.lock:
            return dict(self.diagnostics)

    def counter(self, key: str, timeout: float = 5.0) -> int:
        """An error counter from a fresh /diagnostics message (0 when never counted)."""
        return int(self.fresh_diagnostics(timeout).get(key, 0))

    # -- services ---------------------------------------------------------------------------------
    def call(
        self,
        srv_type: Any,
        name: str,
        request: Any,
        timeout: float = 20.0,
        tries: int = 1,
        prime: Any = None,
    ) -> Any:
        """Call service ``name`` on a fresh client. DDS matches a new client's request path before
        its reply path, so a reply to its first request can be lost:

        * a query that changes nothing passes ``tries`` > 1 to send it again each time a share of
          ``timeout`` passes without a reply;
        * a call that changes something passes ``prime``, a request of the same service that
          changes nothing; it is sent (and resent) until answered, and the real request, sent once,
          then goes out on a client whose replies are known to arrive."""
        client = self.node.create_client(srv_type, name)
        try:
            assert client.wait_for_service(timeout_sec=timeout), f"service {name} not available"
            if prime is not None:
                send_request(client, name, prime, timeout, tries=4)
            return send_request(client, name, request, timeout, tries)
        finally:
            self.node.destroy_client(client)

    def get_state(self) -> int:
        reply = self.call(GetState, f"/{self.target}/get_state", GetState.Request(), tries=4)
        return reply.current_state.id

    def change_state(self, transition_id: int, timeout: float = 60.0) -> bool:
        request = ChangeState.Request(transition=Transition(id=transition_id))
        # a label no transition has: answered with success False, the state machine untouched
        no_transition = ChangeState.Request(transition=Transition(label=UNKNOWN_TRANSITION))
        service = f"/{self.target}/change_state"
        return self.call(ChangeState, service, request, timeout, prime=no_transition).success

    def set_parameters(self, *parameters: Parameter) -> list[SetParametersResult]:
        request = SetParameters.Request(parameters=[p.to_parameter_msg() for p in parameters])
        service = f"/{self.target}/set_parameters"
        return list(
            self.call(SetParameters, service, request, prime=SetParameters.Request()).results
        )

    def set(
        self, name: str, value: Any, type_: Parameter.Type | None = None
    ) -> SetParametersResult:
        parameter = (
            Parameter(name, type_, value) if type_ is not None else Parameter(name, value=value)
        )
        return self.set_parameters(parameter)[0]

    def get_parameter(self, name: str) -> Any:
        reply = self.call(
            GetParameters,
            f"/{self.target}/get_parameters",
            GetParameters.Request(names=[name]),
            tries=4,
        )
        return parameter_value_to_python(reply.values[0])

    def wait_active(self, node: NodeProcess, timeout: float = 90.0) -> None:
        """Wait until the node reports 'active' (it configures itself with autostart)."""

        def active() -> bool:
            assert node.alive(), f"node exited; log:\n{node.log()[-3000:]}"
            try:
                return self.get_state() == STATE_ACTIVE
            except AssertionError:
                return False

        assert wait_for(active, timeout, interval=0.5), (
            f"node not active; log:\n{node.log()[-3000:]}"
        )

    # -- playback ---------------------------------------------------------------------------------
    def player(
        self, bag: Path, loop: bool = False, restamp: bool = True, rate: float = 1.0
    ) -> BagPlayer:
        return BagPlayer(self.node, bag, rate=rate, loop=loop, restamp=restamp)

    def play_in_background(self, bag: Path) -> Playback:
        return Playback(self.player(bag, loop=True))

    def close(self) -> None:
        self.executor.shutdown()
        self.node.destroy_node()
        self.context.try_shutdown()
        self._spinner.join(timeout=5)


@contextlib.contextmanager
def playing_probe(node: NodeProcess, bag: Path, input_topics: Sequence[str]) -> Iterator[Probe]:
    """A Probe on ``input_topics`` that waits for ``node`` to be active and loops ``bag`` into it
    inside the ``with`` block, then stops the playback and closes (the node tests' fixture)."""
    probe = Probe(input_topics)
    probe.wait_active(node)
    playback = probe.play_in_background(bag)
    try:
        yield probe
    finally:
        playback.stop()
        probe.close()


class Playback:
    """A looping bag player in a background thread; ``stop()`` ends it."""

    def __init__(self, player: BagPlayer) -> None:
        self.player = player
        self._stop = threading.Event()
        self._thread = threading.Thread(target=player.play, args=(self._stop,), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def __enter__(self) -> Playback:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class AskClient:
    """An ActionClient on the probe's node, plus a raw subscription to the action's feedback topic
    (rclpy's client drops a goal's feedback once its result is in; the topic keeps all of it)."""

    def __init__(self, probe: Probe, wait_s: float = 30.0) -> None:
        target = probe.target
        self.wait_s = wait_s
        self.client = probe.ask_action
        assert self.client.wait_for_server(timeout_sec=wait_s), "no Ask action server on the node"
        self.lock = threading.Lock()
        self.feedback = {}  # goal uuid bytes -> [(delta, token_count)]
        self.markers = []
        reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        probe.node.create_subscription(
            Ask.Impl.FeedbackMessage,
            f"/{target}/ask/_action/feedback",
            self._on_feedback,
            reliable,
        )
        probe.node.create_subscription(
            Marker, f"/{target}/narration_marker", self._on_marker, reliable
        )

    def _on_feedback(self, msg) -> None:
        with self.lock:
            self.feedback.setdefault(bytes(msg.goal_id.uuid), []).append(
                (msg.feedback.delta, msg.feedback.token_count)
            )

    def _on_marker(self, msg: Marker) -> None:
        with self.lock:
            self.markers.append(msg)

    def feedback_of(self, handle):
        with self.lock:
            return list(self.feedback.get(bytes(handle.goal_id.uuid), []))

    def send(self, question: str, max_tokens: int = 0):
        future = self.client.send_goal_async(Ask.Goal(question=question, max_tokens=max_tokens))
        assert wait_for(future.done, self.wait_s), "no reply to the goal"
        return future.result()

    def result(self, handle):
        future = handle.get_result_async()
        assert wait_for(future.done, self.wait_s), "no result"
        return future.result()
