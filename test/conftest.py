"""Shared pytest setup.

Runs before any test module imports rclpy: every node a test creates in this process, and
through the `ros_env` fixture every subprocess, joins a private ROS graph on this machine with a
domain of its own (:mod:`oxygen_ros.tools.ros_graph`, the test range).
"""

from __future__ import annotations

import os

import pytest

from oxygen_ros.tools.ros_graph import TEST_DOMAINS, private_graph_environment

private_graph_environment(TEST_DOMAINS)


@pytest.fixture
def ros_env() -> dict[str, str]:
    """Environment for a subprocess that should join this test's ROS graph.

    Start the subprocess with `sys.executable` (the same venv): the ROS wheels' bootstrap has
    already set LD_LIBRARY_PATH in this process and the child inherits it.
    """
    return dict(os.environ, PYTHONUNBUFFERED="1")


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
