"""The private ROS graph's environment (oxygen_ros.tools.ros_graph): what it sets, what it keeps."""

from __future__ import annotations

import os

from oxygen_ros.tools.ros_graph import TEST_DOMAINS, TOOL_DOMAINS, private_graph_environment


def test_a_domain_is_drawn_from_the_callers_range_and_local_discovery_set(monkeypatch):
    for name in ("ROS_DOMAIN_ID", "ROS_AUTOMATIC_DISCOVERY_RANGE", "RMW_IMPLEMENTATION"):
        monkeypatch.delenv(name, raising=False)
    env = private_graph_environment(range(150, 151))
    assert env["ROS_DOMAIN_ID"] == os.environ["ROS_DOMAIN_ID"] == "150"
    assert env["ROS_AUTOMATIC_DISCOVERY_RANGE"] == "LOCALHOST"
    assert env["RMW_IMPLEMENTATION"] == "rmw_fastrtps_cpp"
    assert env["PYTHONUNBUFFERED"] == "1"


def test_values_already_set_are_kept(monkeypatch):
    monkeypatch.setenv("ROS_DOMAIN_ID", "7")
    monkeypatch.setenv("ROS_AUTOMATIC_DISCOVERY_RANGE", "SUBNET")
    env = private_graph_environment(TOOL_DOMAINS)
    assert env["ROS_DOMAIN_ID"] == "7" and env["ROS_AUTOMATIC_DISCOVERY_RANGE"] == "SUBNET"


def test_tests_and_tools_draw_from_ranges_that_do_not_meet():
    assert not set(TEST_DOMAINS) & set(TOOL_DOMAINS)
    assert min(TEST_DOMAINS) >= 0 and max(TOOL_DOMAINS) <= 232  # ROS 2's usable domain ids
