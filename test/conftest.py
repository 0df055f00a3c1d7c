"""Shared pytest setup.

Runs before any test module imports rclpy, so the ROS environment below applies to every node a
test creates in this process and, through the `ros_env` fixture, to subprocesses:

* ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST: discovery on one host is instant (SUBNET took ~3 s)
  and test traffic stays on this machine (ROS_LOCALHOST_ONLY=1 on Humble, which predates it);
* a random ROS_DOMAIN_ID (1-100) per pytest process, so parallel test runs don't see each other;
* RMW_IMPLEMENTATION=rmw_fastrtps_cpp (the middleware the venv ships);
* AMENT_PREFIX_PATH=<venv> when unset, so ament_index_python finds share/oxygen_ros in a venv.

Values already set in the environment are kept.
"""

from __future__ import annotations

import os
import random
import sys

import pytest


def _configure_ros_environment() -> None:
    env = os.environ
    env.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    if env.get("ROS_DISTRO") == "humble":
        env.setdefault("ROS_LOCALHOST_ONLY", "1")
    env.setdefault("ROS_DOMAIN_ID", str(random.SystemRandom().randint(1, 100)))
    env.setdefault("RMW_IMPLEMENTATION", "rmw_fastrtps_cpp")
    if not env.get("AMENT_PREFIX_PATH") and sys.prefix != sys.base_prefix:
        env["AMENT_PREFIX_PATH"] = sys.prefix


_configure_ros_environment()


@pytest.fixture
def ros_env() -> dict[str, str]:
    """Environment for a subprocess that should join this test's ROS graph.

    Start the subprocess with `sys.executable` (the same venv): the ROS wheels' bootstrap has
    already set LD_LIBRARY_PATH in this process and the child inherits it.
    """
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def pytest_report_header(config: pytest.Config) -> str:
    from importlib import metadata

    from oxygen_ros.ros.rclpy_compat import ros_distro

    try:
        rclpy_version = metadata.version("ros-rclpy")
    except metadata.PackageNotFoundError:
        rclpy_version = "from a ROS install"
    return (
        f"ROS 2 {ros_distro() or 'unknown'} (rclpy {rclpy_version}) "
        f"ROS_DOMAIN_ID={os.environ['ROS_DOMAIN_ID']} "
        f"RMW_IMPLEMENTATION={os.environ['RMW_IMPLEMENTATION']} "
        f"ROS_AUTOMATIC_DISCOVERY_RANGE={os.environ['ROS_AUTOMATIC_DISCOVERY_RANGE']}"
    )


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    """A random-weight tiny checkpoint (openpi layout + trained tokenizer), built once per run."""
    from oxygen_ros.tools.make_checkpoint import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def synthetic_bag(tmp_path_factory: pytest.TempPathFactory):
    """A 3 s synthetic rosbag2 (two cameras, joint states), written once per run; read-only."""
    from oxygen_ros.tools.make_bag import write_synthetic_bag

    return write_synthetic_bag(tmp_path_factory.mktemp("bag") / "synthetic", duration_s=3.0)
