"""oxygen-collect: record scripted-expert episodes of the simulated robot, one rosbag2 each.

    oxygen-collect --out data/sim --episodes 50 [--kind place] [--task TEXT] [--seed 1000]
                   [--ros-args -p real_time_factor:=1.0 ...]

Runs the sim node, the expert node and a recorder node in one process, the way a user records a
robot: the expert drives the arm through ``arm_controller/joint_trajectory`` and
``gripper_controller/joint_trajectory``, and :class:`~oxygen_ros.tools.record.BagRecorder`
records :data:`TOPICS` into ``OUT/episode_000000/``, ``OUT/episode_000001/``, ... (mcap). The
recorder's node uses sim time, so every bag is stamped on the simulation clock, as its messages'
headers are. Each episode: the sim is paused, reset to the episode's task and seed (the latched
task, subtask and episode messages of the new episode are what the new bag hears first), the
recorder subscribes, the sim resumes and runs until success or timeout, plus a short tail.

The expert runs in lockstep with the sim (:class:`Lockstep`): it plans every 0.1 sim s from the
episode's start, and the sim steps on only once both controllers have taken its commands over
DDS. So an episode is the same whether the machine is idle or busy, paced or not, and its frames
are those ``oxygen-sim-dataset demos`` writes for the same seed without ROS
(``test/test_headless_dataset.py``).

``--perturb RAD`` records demonstrations that teach recovery: the expert's arm trajectories reach
the controller with a smooth random joint offset (:class:`~oxygen_ros.sim.expert.ArmPerturbation`)
and the bag also holds the clean plan, ``expert/arm_plan``, for the dataset's action
(``config/sim_dataset_perturbed.yaml``).

``--headless`` measures the expert's success rate instead, without ROS, bags or cameras.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from oxygen_ros.tools.cli import positive_int, split_ros_args

TOPICS = (
    "camera/scene/image_raw",
    "camera/wrist/image_raw",
    "joint_states",
    "arm_controller/joint_trajectory",
    "gripper_controller/joint_trajectory",
    "sim/task",
    "sim/subtask",
    "sim/narration",
    "sim/episode",
)
"""What every episode's bag holds (resolved in the sim's namespace)."""

PLAN_TOPIC = "expert/arm_plan"
"""The expert's clean arm plan, recorded as well when the arm is perturbed."""

TAIL_S = 0.3  # sim seconds recorded after an episode ends (its final messages arrive)
SUBSCRIBE_TIMEOUT_S = 15.0
EXPERT_RATE_HZ = 10.0  # the expert plans every 0.1 sim s from the episode's start
COMMAND_TIMEOUT_S = 10.0  # longest wait for the sim to take the expert's commands of an instant


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oxygen-collect",
        description=(
            "Record scripted-expert episodes of the simulated robot (oxygen-sim), one rosbag2 "
            "per episode: both cameras, joint_states, both controllers' trajectories and the "
            "sim's task, subtask, narration and episode strings. ROS arguments (sim "
            "parameters) go after --ros-args."
        ),
    )
    parser.add_argument("--out", type=Path, help="folder for the episodes' bags (required)")
    parser.add_argument("--episodes", type=positive_int, default=10, help="default 10")
    parser.add_argument(
        "--kind",
        choices=("touch", "place", "any"),
        default="any",
        help="task kind drawn per episode (default any); --task overrides",
    )
    parser.add_argument("--task", default="", help="one task text for every episode")
    parser.add_argument(
        "--seed", type=int, default=0, help="episode i uses seed SEED + i (default 0)"
    )
    parser.add_argument(
        "--perturb",
        type=float,
        default=0.0,
        metavar="RAD",
        help="perturb the expert's arm trajectories by a drifting joint offset of this standard "
        "deviation and record its clean plan too (default 0: none); 0.03 keeps the expert "
        "succeeding",
    )
    parser.add_argument(
        "--headless",
        action="store_true",
        help="measure the expert's success rate without ROS (no bags, no cameras)",
    )
    return parser


def episode_task(args: argparse.Namespace, seed: int):
    """The task of the episode with ``seed``: --task, else one of --kind drawn from the seed."""
    from oxygen_ros.sim.tasks import parse_task, random_task

    if args.task:
        return parse_task(args.task)
    rng = np.random.default_rng([seed, 7])  # apart from the layout's stream of the same seed
    return random_task(rng, None if args.kind == "any" else args.kind)


def main(argv: Sequence[str] | None = None) -> int:
    argv, ros_args = split_ros_args(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    from oxygen_ros.sim.tasks import TaskError

    try:
        if args.task:
            episode_task(args, 0)
    except TaskError as error:
        parser.error(str(error))
    if not (np.isfinite(args.perturb) and args.perturb >= 0):
        parser.error(f"--perturb must be a finite angle >= 0 rad, got {args.perturb}")
    if args.headless:
        return _measure_headless(args)
    if args.out is None:
        parser.error("--out is required (unless --headless)")
    return _collect(args, ros_args)


def _measure_headless(args: argparse.Namespace) -> int:
    from oxygen_ros.sim.episode import Simulation
    from oxygen_ros.sim.headless import run_expert_episode

    sim = Simulation()
    results = []
    for i in range(args.episodes):
        seed = args.seed + i
        results.append(
            run_expert_episode(sim, episode_task(args, seed), seed, perturbation_rad=args.perturb)
        )
    for kind in ("touch", "put"):
        mine = [r for r in results if r.task.startswith(kind)]
        if mine:
            ok = sum(r.status == "success" for r in mine)
            print(
                f"{kind}: {ok}/{len(mine)} succeeded, "
                f"{np.mean([r.sim_s for r in mine]):.2f} sim s per episode"
            )
    failed = [(r.task, r.seed, r.status) for r in results if r.status != "success"]
    if failed:
        print("failed:", failed)
    print(f"success {len(results) - len(failed)}/{len(results)}")
    return 0


def _collect(args: argparse.Namespace, ros_args: list[str]) -> int:
    import rclpy
    from rclpy.executors import MultiThreadedExecutor
    from rclpy.node import Node
    from rclpy.parameter import Parameter

    from oxygen_ros.ros.rclpy_compat import init_without_signal_handlers
    from oxygen_ros.ros.shutdown import SpinThread
    from oxygen_ros.sim.expert import ExpertNode
    from oxygen_ros.sim.node import SimNode

    args.out.mkdir(parents=True, exist_ok=True)
    init_without_signal_handlers(args=["oxygen-collect", *ros_args])
    sim = SimNode(parameter_overrides=[Parameter("autostart", value=False)])
    namespace = sim.get_namespace()
    expert = ExpertNode(
        sim.privileged_state,
        rate_hz=EXPERT_RATE_HZ,
        namespace=namespace,
        perturbation_rad=args.perturb,
        timer=False,
    )
    sim.step_gate = Lockstep(sim, expert, EXPERT_RATE_HZ)
    recorder_node = Node(
        "sim_recorder",
        namespace=namespace,
        parameter_overrides=[Parameter("use_sim_time", value=True)],
    )
    executor = MultiThreadedExecutor(num_threads=3)
    for node in (sim, expert, recorder_node):
        executor.add_node(node)
    spinner = SpinThread(executor, name="collect_spin").start()
    sim.pause()
    sim.start()
    successes, sizes, walls, sims = 0, [], [], []
    try:
        for i in range(args.episodes):
            seed = args.seed + i
            started = time.perf_counter()
            report, size, counts = record_episode(
                sim,
                expert,
                recorder_node,
                args.out / f"episode_{i:06d}",
                episode_task(args, seed),
                seed,
            )
            wall = time.perf_counter() - started
            successes += report["status"] == "success"
            sizes.append(size)
            walls.append(wall)
            sims.append(report["elapsed_s"])
            print(
                f"episode {i}: {report['task']!r} seed {seed}: {report['status']} after "
                f"{report['elapsed_s']:.2f} sim s ({wall:.1f} s wall), {size / 1e6:.2f} MB, "
                f"messages {json.dumps(counts)}",
                flush=True,
            )
    finally:
        sim.stop()
        spinner.stop()  # before anything is destroyed: nothing is left inside rclpy at exit
        executor.shutdown()
        for node in (expert, recorder_node, sim):
            node.destroy_node()
        rclpy.try_shutdown()
    episodes = len(sizes)
    print(
        f"{episodes} episodes, {successes} succeeded; per episode {np.mean(sims):.2f} sim s, "
        f"{np.mean(walls):.2f} s wall (real-time factor {np.sum(sims) / np.sum(walls):.2f}), "
        f"{np.mean(sizes) / 1e6:.2f} MB"
    )
    return 0


class Lockstep:
    """The sim's step gate (``SimNode.step_gate``) that keeps the expert in step with the sim.

    At every planning instant of a running episode (every ``1 / rate_hz`` of sim time from the
    episode's start, where the headless recorder plans too) the expert plans from the state of
    that instant, and the sim steps on once both controllers have taken the commands over DDS.
    Left to its timer, the expert plans when the executor gets to it: a control step or more
    late, its command arriving later still, and when the machine is busy not at all, so that the
    arm stalls mid-motion (and the dataset holds the stall's labels). Messages still travel and are
    recorded as they would be; only the sim waits for them.
    """

    def __init__(self, sim, expert, rate_hz: float) -> None:
        self._sim, self._expert = sim, expert
        self._steps = max(1, round(1.0 / (rate_hz * sim.sim.control_dt)))

    def __call__(self, now_s: float) -> None:
        from oxygen_ros.sim.episode import RUNNING

        state = self._sim.sim  # read on the physics thread, the only one that changes it
        step = round((now_s - state.episode_start_s) / state.control_dt)
        if state.status != RUNNING or step % self._steps:
            return
        taken, published = self._commands_taken(), self._expert.published
        self._expert.tick()
        if self._expert.published == published:
            return
        deadline = time.monotonic() + COMMAND_TIMEOUT_S
        while self._commands_taken() < taken + 2:  # the arm's and the gripper's
            if time.monotonic() > deadline:
                self._sim.get_logger().error(
                    f"the sim did not take the expert's commands of t={now_s:.2f} s within "
                    f"{COMMAND_TIMEOUT_S} s; stepping on without them"
                )
                return
            time.sleep(0.0005)

    def _commands_taken(self) -> int:
        """Commands the sim's controllers have accepted or rejected so far."""
        return sum(
            c.accepted + sum(c.rejected.values()) for c in self._sim.sim.controllers.values()
        )


def record_episode(
    sim, expert, recorder_node, bag_dir: Path, task, seed: int
) -> tuple[dict, int, dict]:
    """One paused-reset-record-resume episode (see the module docstring) into ``bag_dir``:
    ``sim`` a paused, started SimNode, ``expert`` its ExpertNode, ``recorder_node`` spun.

    Returns the final episode report, the bag's size in bytes and the messages per topic.
    """
    from oxygen_ros.sim.episode import RUNNING
    from oxygen_ros.tools.record import BagRecorder

    sim.request_reset(task.text, seed, wait=True)  # paused: applied and announced, not stepped
    recorded = TOPICS + ((PLAN_TOPIC,) if expert.perturbation.scale_rad > 0 else ())
    topics = [recorder_node.resolve_topic_name(topic) for topic in recorded]
    before = _subscription_counts((sim, expert), topics)
    recorder = BagRecorder(recorder_node, bag_dir, recorded)
    try:
        _wait_until_subscribed((sim, expert), topics, before, recorder)
        _wait_until_latched_heard(recorder_node, recorder)
        sim.resume()
        while sim.episode_report()["status"] == RUNNING:
            time.sleep(0.02)
        end_s = sim.privileged_state().time_s
        while sim.privileged_state().time_s < end_s + TAIL_S:
            time.sleep(0.02)
        sim.pause()
        time.sleep(0.1)  # the last messages in flight reach the recorder
    finally:
        counts = recorder.close()
        # DDS unmatches the closed recorder's subscriptions asynchronously: wait for it, so that
        # the next episode's count before its recorder is not this one's, still matched
        _wait_until_unsubscribed((sim, expert), topics, before)
    report = sim.episode_report()
    size = sum(f.stat().st_size for f in bag_dir.rglob("*") if f.is_file())
    return report, size, counts


def _subscription_counts(nodes, topics: Sequence[str]) -> dict[str, int]:
    """Matched subscriptions of the ``nodes``' publishers on ``topics`` (fully qualified)."""
    return {
        publisher.topic_name: publisher.get_subscription_count()
        for node in nodes
        for publisher in node.publishers
        if publisher.topic_name in topics
    }


def _wait_until_subscribed(nodes, topics: Sequence[str], before: dict, recorder) -> None:
    """Until the recorder subscribed every topic and each of its subscriptions matched the
    publisher (one more matched subscription than ``before`` on each)."""
    deadline = time.monotonic() + SUBSCRIBE_TIMEOUT_S
    while time.monotonic() < deadline:
        counts = _subscription_counts(nodes, topics)
        if not recorder.pending_topics() and all(counts[t] > n for t, n in before.items()):
            return
        time.sleep(0.02)
    raise TimeoutError(
        f"the recorder did not subscribe to {recorder.pending_topics() or 'every topic'} "
        f"within {SUBSCRIBE_TIMEOUT_S} s"
    )


def _wait_until_latched_heard(node, recorder) -> None:
    """Until the recorder has written the message of every latched topic (transient-local
    publishers: the new episode's task, subtask and status, published at its reset), so that the
    bag hears them before the sim resumes, not a control step or two into the episode."""
    from rclpy.qos import DurabilityPolicy

    def is_latched(topic: str) -> bool:
        publishers = node.get_publishers_info_by_topic(topic)
        transient = DurabilityPolicy.TRANSIENT_LOCAL
        return bool(publishers) and all(p.qos_profile.durability == transient for p in publishers)

    latched = [topic for topic in recorder.topics if is_latched(topic)]
    deadline = time.monotonic() + SUBSCRIBE_TIMEOUT_S
    while time.monotonic() < deadline:
        counts = recorder.message_counts()
        if all(counts[topic] > 0 for topic in latched):
            return
        time.sleep(0.02)
    raise TimeoutError(
        f"the recorder did not receive the latched messages of {latched} within "
        f"{SUBSCRIBE_TIMEOUT_S} s"
    )


def _wait_until_unsubscribed(nodes, topics: Sequence[str], before: dict) -> None:
    """Until the publishers on ``topics`` are back to the matched subscriptions of ``before``."""
    deadline = time.monotonic() + SUBSCRIBE_TIMEOUT_S
    while time.monotonic() < deadline:
        counts = _subscription_counts(nodes, topics)
        if all(counts[t] <= n for t, n in before.items()):
            return
        time.sleep(0.02)
    raise TimeoutError(
        f"a closed recorder's subscriptions were still matched after {SUBSCRIBE_TIMEOUT_S} s"
    )


if __name__ == "__main__":
    sys.exit(main())
