"""oxygen-sim: the simulated SO-101-like robot as a ROS 2 node (MuJoCo, headless).

    oxygen-sim [--expert] [--ros-args --params-file config/sim_so101.yaml -r __ns:=/sim1 ...]

Runs the ``sim`` node (:mod:`oxygen_ros.sim.node`; its docstring lists the topics, the reset
service, the parameters and how sim time works) until Ctrl-C. With ``--expert`` the scripted
expert runs in the same process and drives the robot through the controllers' topics, as a
policy node would; with ``auto_reset_s`` >= 0 (``--ros-args -p auto_reset_s:=1.0``) the sim
starts a new episode that long after each one ends.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence

import rclpy
from rclpy.executors import MultiThreadedExecutor

from oxygen_ros.ros.rclpy_compat import ExternalShutdownException, init_without_signal_handlers
from oxygen_ros.tools.cli import split_ros_args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="oxygen-sim",
        description=(
            "A simulated SO-101-like arm (MuJoCo) as a ROS 2 node: cameras, joint_states, "
            "arm_controller/ and gripper_controller/joint_trajectory with "
            "joint_trajectory_controller semantics, /clock, sim/task|subtask|narration|episode, "
            "and the sim/reset service. ROS arguments go after --ros-args."
        ),
        epilog=(
            "Example: oxygen-sim --expert --ros-args --params-file config/sim_so101.yaml "
            "-p auto_reset_s:=1.0 -p task:='put the red cube on the green pad'"
        ),
    )
    parser.add_argument(
        "--expert",
        action="store_true",
        help="also run the scripted expert in this process (it reads the privileged state)",
    )
    parser.add_argument(
        "--expert-rate-hz",
        type=float,
        default=10.0,
        help="how often the expert sends trajectories, in sim time (default 10)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv, ros_args = split_ros_args(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)

    from oxygen_ros.sim.expert import ExpertNode
    from oxygen_ros.sim.node import SimNode

    init_without_signal_handlers(args=["oxygen-sim", *ros_args])
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    nodes = []
    try:
        sim = SimNode()
        nodes.append(sim)
        if args.expert:
            nodes.append(
                ExpertNode(
                    sim.privileged_state,
                    rate_hz=args.expert_rate_hz,
                    namespace=sim.get_namespace(),
                )
            )
        executor = MultiThreadedExecutor(num_threads=2)
        for node in nodes:
            executor.add_node(node)
        sim.start()
        while not stop.is_set() and rclpy.ok():
            try:
                executor.spin_once(timeout_sec=0.1)
            except ExternalShutdownException:
                break
        sim.stop()
        return 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for node in nodes:
            if isinstance(node, SimNode):
                node.stop()
            node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    sys.exit(main())
