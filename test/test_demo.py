"""``oxygen-demo`` end to end, shortened: it builds its inputs, runs the node on the bag, asks a
question, stops the node cleanly and prints a summary."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ros, pytest.mark.slow]


def test_demo_runs_and_summarises(tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # not the other tests' graph
    env["ROS_DOMAIN_ID"] = str(int(env.get("ROS_DOMAIN_ID", "0")) % 100 + 101)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "oxygen_ros.tools.demo",
            "--duration",
            "5",
            "--rate-hz",
            "15",
            "--work",
            str(tmp_path),
            "--json",
            str(tmp_path / "summary.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    node_log = tmp_path / "node.log"
    output = (
        result.stdout
        + result.stderr
        + "\n--- node log ---\n"
        + (node_log.read_text()[-4000:] if node_log.exists() else "(none)")
    )
    assert result.returncode == 0, output
    assert "oxygen-demo summary" in output and "node stopped (exit status 0)" in output
    chunks = int(re.search(r"action chunks\s+(\d+)", output).group(1))
    assert chunks >= 10, output
    narrations = re.search(r"(\d+) narrations, 1 answers", output)
    assert narrations, output
    assert re.search(r"frame\s+[\d.]+ Hz", output), output  # the live lines
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["chunks"] == chunks and summary["requested_rate_hz"] == 15.0
    assert 1.0 <= summary["effective_rate_hz"] <= 15.0
    assert (summary["narrations_finished"], summary["answers_finished"]) == (
        int(narrations.group(1)),
        1,
    )
    assert summary["late_fraction"] == pytest.approx(summary["deadline_misses"] / chunks, abs=1e-4)
    for key in ("tokens_per_s", "mean_frame_rate_hz", "load_average_1min", "warmup_tick_ms"):
        assert key in summary, summary


def test_sim_demo_drives_the_arm_with_the_trained_policy(tmp_path):
    """``oxygen-demo --sim`` (what ``make demo`` runs): the shipped checkpoint drives the sim
    through the node for one short episode, narrating the task's cube, and ends with the sim's
    verdict."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["ROS_DOMAIN_ID"] = str(int(env.get("ROS_DOMAIN_ID", "0")) % 100 + 101)
    result = subprocess.run(
        [sys.executable, "-m", "oxygen_ros.tools.demo", "--sim", "--episodes", "1"]
        + ["--timeout", "4", "--work", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "episode 0: 'touch the red cube'" in output, output
    said = re.findall(r"node (?:says|said last): '\[narration\] ([^']*)'", output)
    verdict = re.search(r"-> (success|timeout|wrong_cube) after", output)
    assert verdict, output
    # every narration names the task's cube; only a touch quicker than the first narration
    # (the contact rule ends the episode at once) may end with none
    assert all("red cube" in text for text in said), output
    assert said or verdict.group(1) == "success", output
    assert "sim demo summary:" in output


def test_sim_demo_counts_the_subtasks_that_match_the_sims_words():
    from oxygen_ros.tools.sim_demo import subtasks_matching

    sim = [(0.0, "touch the red cube, far left"), (2.0, "touch the red cube")]
    decoded = [
        (-1.0, "touch the red cube, far left"),  # before the sim said anything
        (0.5, "touch the red cube,  far left"),  # spacing aside, the sim's words
        (1.0, "touch the red cube, near left"),
        (1.5, "   "),  # empty: not counted
        (2.5, "touch the red cube"),
    ]
    assert subtasks_matching(decoded, sim) == (2, 4)
    assert subtasks_matching([], sim) == (0, 0)
