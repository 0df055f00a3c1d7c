"""Several robots, one namespace each, over real DDS: two ``oxygen_node`` processes side by side,
started in namespaces ``r1`` and ``r2`` with the shipped config/oxygen.yaml (relative input topics)
and a tiny random-weight model, each fed by its own replayed bag:

* robot r1: a root-namespace bag written by ``oxygen-make-bag --distro jazzy``, played by
  ``oxygen-replay --namespace r1 --loop`` (both command lines, in subprocesses);
* robot r2: a bag written with every topic under ``/r2``, played as it is.

Each node makes chunks, and every chunk's stamp is the stamp of one of its own robot's input
messages, never of the other robot's: each node gets only its own robot's inputs. Its
/diagnostics show the inputs under the relative names of the config.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from node_harness import NodeProcess, Playback, Probe, stamp_ns, wait_for

from oxygen_ros.tools.make_bag import JOINT_STATES_TOPIC, camera_topic, write_synthetic_bag

REPO = Path(__file__).resolve().parents[1]
ROBOTS = ("r1", "r2")
WAIT_S = 90.0


def _inputs(ns: str) -> list[str]:
    return [camera_topic("base", ns=ns), camera_topic("wrist", ns=ns), f"/{ns}{JOINT_STATES_TOPIC}"]


def _shipped_parameters(checkpoint: Path) -> dict:
    params = yaml.safe_load((REPO / "config" / "oxygen.yaml").read_text())["/**"]
    params = dict(params["ros__parameters"])
    assert not any(t.startswith("/") for t in params["camera_topics"]), params["camera_topics"]
    params.update(
        checkpoint_dir=str(checkpoint),
        rate_hz=5.0,
        narration_period_s=0.0,
        max_observation_age_s=1.0,
    )
    return params


@pytest.fixture
def bags(tmp_path, ros_env):
    root = tmp_path / "bags"
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "oxygen_ros.tools.make_bag",
            "--out",
            str(root / "r1"),
            "--duration",
            "2",
            "--distro",
            "jazzy",
        ],
        env=ros_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    return {"r1": root / "r1", "r2": write_synthetic_bag(root / "r2", 2.0, ns="r2")}


def _node_configs() -> list[Path]:
    """The shipped parameter files of oxygen_node (config/ also holds the simulated robot's and
    the dataset converter's)."""
    return [
        path
        for path in sorted((REPO / "config").glob("*.yaml"))
        if "checkpoint_dir"
        in (yaml.safe_load(path.read_text()).get("/**") or {}).get("ros__parameters", {})
    ]


@pytest.mark.parametrize("config", _node_configs(), ids=lambda p: p.name)
def test_every_shipped_config_has_relative_input_topics(config):
    """So that a namespace moves every input (joint_states is relative in the node itself)."""
    params = yaml.safe_load(config.read_text())["/**"]["ros__parameters"]
    topics = params.get("camera_topics") or []
    assert topics and not [t for t in topics if t.startswith("/")], topics


@pytest.mark.ros
@pytest.mark.slow
def test_two_namespaced_nodes_each_get_only_their_own_robots_inputs(
    tiny_checkpoint, bags, tmp_path, ros_env
):
    params = _shipped_parameters(tiny_checkpoint)
    nodes = {ns: NodeProcess(params, tmp_path / ns, namespace=ns) for ns in ROBOTS}
    probes = {ns: Probe(_inputs(ns), target=f"{ns}/oxygen_node") for ns in ROBOTS}
    replay_r1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "oxygen_ros.tools.replay",
            str(bags["r1"]),
            "--namespace",
            "r1",
            "--loop",
        ],
        env=ros_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    playback_r2 = probes["r2"].player(bags["r2"], loop=True)
    assert playback_r2.topics == sorted(_inputs("r2"))
    try:
        with Playback(playback_r2):
            for ns in ROBOTS:
                probes[ns].wait_active(nodes[ns], WAIT_S)
            for ns in ROBOTS:
                assert wait_for(lambda p=probes[ns]: len(p.chunks) >= 5, WAIT_S), (
                    f"{ns}: no chunks; log:\n{nodes[ns].log()[-3000:]}"
                )
            # The probes discover the players on their own: a node may act on inputs sent before
            # a probe heard its first message. Chunks from ticks after every input topic reached
            # both probes are the ones whose stamps the probes can know.
            for ns in ROBOTS:
                assert wait_for(lambda p=probes[ns], ns=ns: p.heard_all(_inputs(ns)), WAIT_S), (
                    f"{ns}: the probe heard {sorted(probes[ns].input_topics_heard)} only"
                )
            time.sleep(0.5)  # a tick under way when the last topic was heard has ended
            since = time.monotonic()
            for ns in ROBOTS:
                assert wait_for(lambda p=probes[ns]: len(p.chunks_since(since)) >= 3, WAIT_S)
            diagnostics = {ns: probes[ns].fresh_diagnostics(10.0) for ns in ROBOTS}
        replay_r1.send_signal(signal.SIGINT)
        out, err = replay_r1.communicate(timeout=30)
        assert replay_r1.returncode == 0, err
        assert "under /r1" in out

        for ns, other in (ROBOTS, ROBOTS[::-1]):
            probe = probes[ns]
            stamps = {stamp_ns(chunk.header.stamp) for chunk in probe.chunks_since(since)}
            assert wait_for(lambda p=probe, s=stamps: s <= p.input_stamps, 5), (
                f"{ns}: a chunk's stamp is not the stamp of one of its robot's inputs"
            )
            with probe.lock:
                every_stamp = {stamp_ns(chunk.header.stamp) for _, chunk in probe.chunks}
            with probes[other].lock:
                assert not every_stamp & probes[other].input_stamps, f"{ns} used {other}'s inputs"
            values = diagnostics[ns]
            for topic in (*params["camera_topics"], "joint_states"):
                assert values.get(f"input_age_s {topic}") not in (None, "never"), (ns, topic)
                assert int(values[f"received {topic}"]) > 0, (ns, topic)
        for ns in ROBOTS:
            assert nodes[ns].stop() == 0, nodes[ns].log()[-3000:]
    finally:
        if replay_r1.poll() is None:
            replay_r1.kill()
            replay_r1.communicate()
        for ns in ROBOTS:
            if nodes[ns].alive():
                nodes[ns].stop()
            probes[ns].close()
