"""``oxygen_node --help``: usage and every declared parameter, printed without starting a node."""

from __future__ import annotations

import subprocess
import sys

import pytest

from oxygen_ros.ros.cli_help import help_requested
from oxygen_ros.ros.params import PARAMETERS


def _run_node(*args, env):
    return subprocess.run(
        [sys.executable, "-m", "oxygen_ros.ros.node", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_prints_usage_and_every_parameter_and_exits_0(flag, ros_env):
    done = _run_node(flag, env=ros_env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("usage: oxygen_node [-h] [--ros-args")
    parameters = out.split("parameters (set with -p NAME:=VALUE or in a --params-file):\n", 1)[1]
    entries = [
        line.split(" (")[0].strip()
        for line in parameters.splitlines()
        if line.startswith("  ") and not line.startswith("   ")
    ]
    assert entries == [spec.name for spec in PARAMETERS]
    # Facts from params.py, written out by hand: type, default, range and when each applies.
    assert "  rate_hz (double, default 60.0, range [1, 200])\n" in out
    assert "  seed (integer, default 0, range [0, 2147483647])\n" in out
    assert (
        "  autostart (bool, default true)\n      configure and activate on start (plain runs). "
        "[static: read once at start-up]" in out
    )
    assert "  checkpoint_dir (string, default '')\n" in out
    assert "  camera_slots (string[], default ['base_0_rgb', 'left_wrist_0_rgb'])\n" in out
    assert "[runtime: can change while running]" in out
    assert "[configure: applied by the configure transition]" in out
    # No node was started: nothing was logged.
    assert "[INFO]" not in done.stderr and "[ERROR]" not in done.stderr


def test_help_before_ros_args_wins_over_bad_ros_arguments(ros_env):
    # rclpy would refuse this override; help is printed before rclpy sees the arguments.
    done = _run_node("--help", "--ros-args", "-p", "rate_hz:=not_a_number", env=ros_env)
    assert done.returncode == 0, done.stderr
    assert "rate_hz (double" in done.stdout


def test_help_flag_detection():
    assert help_requested(["oxygen_node", "--help"])
    assert help_requested(["oxygen_node", "-h", "--ros-args", "-p", "rate_hz:=30.0"])
    assert not help_requested(["oxygen_node"])
    assert not help_requested(["oxygen_node", "--ros-args", "-p", "task:=x", "-h"])
    assert not help_requested(["--help"])  # the program name itself is not an argument
