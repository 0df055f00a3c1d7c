"""The command-line tools' shared argument helpers (oxygen_ros.tools.cli)."""

from __future__ import annotations

import argparse

import pytest

from oxygen_ros.tools.cli import namespace, namespaced, positive_float, split_ros_args


def test_the_command_line_splits_at_ros_args():
    own, ros = split_ros_args(["--episodes", "3", "--ros-args", "-p", "rate_hz:=10.0"])
    assert own == ["--episodes", "3"] and ros == ["--ros-args", "-p", "rate_hz:=10.0"]
    assert split_ros_args(("--episodes", "3")) == (["--episodes", "3"], [])
    assert split_ros_args(["--ros-args"]) == ([], ["--ros-args"])


def test_value_types_refuse_what_they_cannot_be():
    assert positive_float("0.5") == 0.5
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_float(bad)
    assert namespace("/fleet/r1/") == "/fleet/r1" and namespace("/") == ""
    with pytest.raises(argparse.ArgumentTypeError):
        namespace("r1/2d")
    assert namespaced("/joint_states", "r1") == "/r1/joint_states"
