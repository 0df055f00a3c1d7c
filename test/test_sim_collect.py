"""oxygen-collect writes one readable rosbag2 per expert episode with every topic it promises, and
leaves no thread spinning when it returns (one would abort the process at exit, status 134)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from rosbags.rosbag2 import Reader
from rosbags.typesys import Stores, get_typestore

from oxygen_ros.tools.collect import TOPICS, main

pytestmark = [pytest.mark.ros, pytest.mark.slow]


def read_bag(path: Path) -> dict[str, list]:
    """Every message of the bag at ``path``, deserialised, per topic in log-time order."""
    store = get_typestore(Stores.ROS2_JAZZY)
    messages: dict[str, list] = {}
    with Reader(path) as reader:
        for connection, _, raw in reader.messages():
            message = store.deserialize_cdr(raw, connection.msgtype)
            messages.setdefault(connection.topic, []).append(message)
    return messages


def test_collect_writes_one_bag_per_episode(tmp_path: Path, ros_env):
    out = tmp_path / "episodes"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "oxygen_ros.tools.collect",
            "--out",
            str(out),
            "--episodes",
            "2",
            "--kind",
            "touch",
            "--seed",
            "3",
        ],
        env=ros_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    print(result.stdout)
    assert "2 episodes, 2 succeeded" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == ["episode_000000", "episode_000001"]
    for index, bag in enumerate(sorted(out.iterdir())):
        messages = read_bag(bag)
        assert set(messages) == {f"/{topic}" for topic in TOPICS}, set(messages)
        reports = [json.loads(m.data) for m in messages["/sim/episode"]]
        assert {r["episode"] for r in reports} == {index}  # nothing of the previous episode
        assert reports[0]["status"] == "running" and reports[-1]["status"] == "success"
        task = messages["/sim/task"][0].data
        assert [m.data for m in messages["/sim/task"]] == [task] and task.startswith("touch")
        color = task.split()[2]
        narrations = [m.data for m in messages["/sim/narration"]]
        assert re.fullmatch(
            rf"reaching for the {color} cube, (near|far) (left|centre|right)", narrations[0]
        ), narrations[0]
        assert narrations[-1] == f"the gripper is touching the {color} cube"
        elapsed = reports[-1]["elapsed_s"]
        images = messages["/camera/scene/image_raw"]
        # 10 Hz over the episode and its tail, from its first step
        assert len(images) >= int(elapsed * 10)
        # both cameras render at the same steps; the last pair can straddle the bag's close
        assert abs(len(messages["/camera/wrist/image_raw"]) - len(images)) <= 1
        assert (images[0].height, images[0].width, images[0].encoding) == (128, 128, "rgb8")
        joints = messages["/joint_states"]
        assert len(joints) >= int(elapsed * 50)
        assert list(joints[0].name)[-1] == "gripper" and len(joints[0].position) == 6
        trajectories = messages["/arm_controller/joint_trajectory"]
        assert len(trajectories) >= int(elapsed * 10) - 1
        assert len(trajectories[0].joint_names) == 5
        assert list(messages["/gripper_controller/joint_trajectory"][0].joint_names) == ["gripper"]


SPINNING = {"spin", "spin_once", "wait_for_ready_callbacks", "_wait_for_ready_callbacks"}


def threads_spinning() -> list[str]:
    """Names of the threads (other than this one) inside an rclpy executor's spin or wait."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    spinning = []
    for ident, frame in sys._current_frames().items():
        while frame is not None and ident != threading.get_ident():
            code = frame.f_code
            if "/rclpy/" in code.co_filename and code.co_name in SPINNING:
                spinning.append(names.get(ident, str(ident)))
                break
            frame = frame.f_back
    return spinning


def test_collect_returns_with_nothing_left_spinning(tmp_path: Path, capsys):
    args = ["--out", str(tmp_path / "episodes"), "--episodes", "1", "--kind", "touch"]
    assert main([*args, "--ros-args", "-p", "real_time_factor:=0.0"]) == 0
    assert "1 episodes, 1 succeeded" in capsys.readouterr().out
    assert threads_spinning() == []  # a process exiting now would abort on such a thread
