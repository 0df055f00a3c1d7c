"""A private ROS 2 graph on this machine, for the demo, the benches and the tests.

Set in this process's environment before rclpy starts, and inherited by the processes it starts:

* ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST: discovery on one host is instant (SUBNET takes ~3 s)
  and the traffic stays on this machine (ROS_LOCALHOST_ONLY=1 on Humble, which predates it);
* a random ROS_DOMAIN_ID from the caller's range, so runs side by side do not see each other
  (the tests draw from :data:`TEST_DOMAINS`, the demo and benches from :data:`TOOL_DOMAINS`);
* RMW_IMPLEMENTATION=rmw_fastrtps_cpp, the middleware the venv ships;
* AMENT_PREFIX_PATH=<venv> when unset, so ament_index_python finds share/oxygen_ros in a venv.

Values already set in the environment are kept. No ROS import here: it must run before one.
"""

from __future__ import annotations

import os
import random
import sys

TEST_DOMAINS = range(1, 101)
TOOL_DOMAINS = range(101, 201)


def private_graph_environment(domains: range = TOOL_DOMAINS) -> dict[str, str]:
    """Sets up this process's environment for a private graph (see the module); returns a copy
    for subprocesses, with unbuffered Python output so their logs arrive as they happen."""
    env = os.environ
    env.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    if env.get("ROS_DISTRO") == "humble":
        env.setdefault("ROS_LOCALHOST_ONLY", "1")
    env.setdefault("ROS_DOMAIN_ID", str(random.SystemRandom().choice(domains)))
    env.setdefault("RMW_IMPLEMENTATION", "rmw_fastrtps_cpp")
    if not env.get("AMENT_PREFIX_PATH") and sys.prefix != sys.base_prefix:
        env["AMENT_PREFIX_PATH"] = sys.prefix
    return dict(env, PYTHONUNBUFFERED="1")
