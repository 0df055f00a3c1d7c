"""The node failing over between two ``oxygen-serve`` processes, over real sockets and DDS.

Two real servers serve the tiny checkpoint; the real node (its own process, ``engine: remote``,
``server_uris`` naming both) ticks over the first. With an Ask being answered there, the first
server is killed (SIGKILL: no close frame, as when a box dies). The node moves on to the second
and keeps publishing chunks, every one of them computed from an observation stamped after the
kill; the Ask ends failed saying the server changed; /diagnostics names the second server and
counts the switch. What a switch restarts (RTC feedback, questions in flight, a request built for
the old session) and the deadline rule are tested in test_serving_client.py and
test_node_remote.py, against servers in the test's own process.

Cost: two server processes and one node (about 40 s on a busy 2-core machine, most of it start-up).
The failover bench's measurement (``oxygen-bench failover``) is checked on made-up arrivals.
"""

from __future__ import annotations

import signal

import pytest
from node_harness import STATE_ACTIVE, AskClient, NodeProcess, Probe, stamp_ns, wait_for

from oxygen_ros.tools.benches.closed_loop_ros import Received, Recording
from oxygen_ros.tools.benches.failover import (
    SCENARIOS,
    Fault,
    failback,
    fault_row,
    measure,
    ready_time,
    switch_time,
)
from oxygen_ros.tools.benches.serve_processes import ServeProcess, free_port
from oxygen_ros.tools.make_bag import camera_topic, joint_names, write_synthetic_bag

pytestmark = [pytest.mark.ros, pytest.mark.slow]
JOINTS = 8  # the tiny checkpoint's state width
WAIT_S = 120.0  # generous: nothing here depends on how busy the machine is
# each session's chunks continue its previous one; an answer long enough to be cut by the kill
SERVE_ARGS = ["--chunk-continuity", "rtc", "--max-tokens", "400"]


def test_the_node_moves_on_to_the_next_server_when_its_server_is_killed(tiny_checkpoint, tmp_path):
    bag = write_synthetic_bag(
        tmp_path / "bag", duration_s=3.0, width=64, height=64, num_joints=JOINTS
    )
    servers = [
        ServeProcess(tiny_checkpoint, free_port(), tmp_path / f"serve_{name}.log", SERVE_ARGS)
        for name in ("first", "second")
    ]
    first, second = servers
    node = None
    probe = Probe()
    try:
        for server in servers:  # both started above: their start-ups overlap
            server.wait_healthy(WAIT_S)
        node = NodeProcess(
            {
                "engine": "remote",
                "server_uris": [first.uri, second.uri],
                "server_timeout_ms": 30_000.0,  # only the kill moves the node, never a slow tick
                "camera_topics": [camera_topic("base"), camera_topic("wrist")],
                "camera_slots": ["base_0_rgb", "left_wrist_0_rgb"],
                "joint_names": joint_names(JOINTS),
                "rate_hz": 5.0,
                "action_dt": 0.5,
                "max_observation_age_s": 30.0,
            },
            tmp_path,
        )
        probe.wait_active(node, WAIT_S)
        with probe.play_in_background(bag):
            assert wait_for(lambda: len(probe.chunks) >= 2, WAIT_S), node.log()[-3000:]
            assert _diagnostics(probe)["server_uri"] == first.uri
            ask = AskClient(probe, wait_s=WAIT_S)
            handle = ask.send("what is on the table?", max_tokens=400)
            assert handle.accepted
            # the answer is being decoded on the first server when it dies
            assert wait_for(lambda: ask.feedback_of(handle), WAIT_S), node.log()[-3000:]
            killed_at_ns = probe.node.get_clock().now().nanoseconds
            first.process.send_signal(signal.SIGKILL)

            result = ask.result(handle).result
            assert result.finish_reason == "failed", (result.finish_reason, result.detail)
            assert result.detail.startswith("the server changed: ") and second.uri in result.detail

            assert wait_for(
                lambda: (
                    _diagnostics(probe).get("server_uri") == second.uri
                    and _diagnostics(probe).get("server_connected") == "true"
                ),
                WAIT_S,
            ), node.log()[-3000:]
            switched = _diagnostics(probe)
            assert switched["server_switches"] == "1" and switched["server_sessions"] == "2"
            assert switched["server_last_switch"].startswith(f"{first.uri} -> {second.uri}")
            seen = len(probe.chunks)
            assert wait_for(lambda: len(probe.chunks) >= seen + 3, WAIT_S), node.log()[-3000:]
            after = [msg for _, msg in probe.chunks[seen:]]
            assert all(stamp_ns(msg.header.stamp) > killed_at_ns for msg in after)
            assert _diagnostics(probe)["server_errors"] == "0"  # no feedback the second refused
            assert probe.get_state() == STATE_ACTIVE
        assert f"connected to oxygen-serve at {second.uri} (moved on from {first.uri})" in (
            node.log()
        )
        assert node.stop() == 0, node.log()[-3000:]
    finally:
        probe.close()
        if node is not None:
            node.stop()
        for server in servers:
            server.stop()


def _diagnostics(probe: Probe) -> dict[str, str]:
    return probe.fresh_diagnostics(30.0)


def test_the_failover_bench_measures_the_gap_from_what_reached_it():
    """Chunks at 10.0 and 10.1 s, the server killed at 10.2, the next chunk at 10.9 (wall, this
    process); each chunk's trajectory spans 1 sim s; a trajectory stamped in between would have
    come from the node without a server."""
    chunks = [Received(10.0, 5.0, 4.9), Received(10.1, 5.1, 5.0), Received(10.9, 6.3, 6.2)]
    trajectories = [
        Received(10.0, 5.0, 4.9, 5.9),
        Received(10.1, 5.1, 5.0, 6.0),
        Received(10.9, 6.3, 6.2, 7.2),
    ]
    rec = Recording("")
    rec.reports = [
        (9.0, {"episode": 3, "status": "running"}),
        (13.0, {"episode": 3, "status": "success"}),
    ]
    rec.joint_times = [5.9, 6.0, 6.1, 6.2, 6.3]
    rec.joint_positions = [[0.0, 1.0], [0.1, 1.0], [0.1, 1.0], [0.12, 1.0], [0.3, 1.0]]
    fault = Fault(at=10.2, wall=1000.2, sim=5.2)
    row = measure(SCENARIOS[0], fault, chunks, trajectories, rec, 3, 1000.25)
    assert row["no_chunk_s"] == pytest.approx(0.8) and row["first_chunk_s"] == pytest.approx(0.7)
    assert row["switch_s"] == pytest.approx(0.05) and row["cmds_in_gap"] == 0
    assert row["stale_after"] == "0/1" and row["horizon_s"] == pytest.approx(1.0)
    # the last good trajectory ended at sim 6.0, the new one arrived at 6.3: held 0.3 s, within
    # 0.02 rad of where it stopped
    assert row["held_s"] == pytest.approx(0.3) and row["moved_rad"] == pytest.approx(0.02)
    assert row["outcome"] == "success" and row["end_s"] == pytest.approx(2.8)
    assert fault_row(row | {"node": "active"})["gap_s"] == row["no_chunk_s"]

    gap = Received(10.5, 5.7, 5.6, 6.6)  # published while the node had no server
    stale = Received(10.95, 6.35, 5.1)  # a chunk after the fault from an older observation
    row = measure(SCENARIOS[1], fault, [*chunks, stale], [*trajectories, gap], rec, 3, None)
    assert row["cmds_in_gap"] == 1 and row["stale_after"] == "1/2" and row["switch_s"] is None


def test_the_failback_is_measured_from_the_restarted_servers_readiness():
    """The first server ready at 20.0 (wall 1020.0); the node's log says it moved back at wall
    1020.4 (20.4 here); chunks at 20.3 (the backup's), 20.6 and 20.7 (the first's)."""
    ready = Fault(at=20.0, wall=1020.0, sim=15.0)
    chunks = [Received(20.3, 15.3, 15.2), Received(20.6, 15.6, 15.5), Received(20.7, 15.7, 15.6)]
    row = failback(chunks, ready, 1020.4)
    assert row["back_s"] == pytest.approx(0.4) and row["back_gap_s"] == pytest.approx(0.3)
    assert row["chunks_back"] == 2 and row["stale_back"] == "0/2"
    # a reply of the backup's (an observation it had answered) commanded after the move: stale
    row = failback([*chunks, Received(20.8, 15.8, 15.2)], ready, 1020.4)
    assert row["stale_back"] == "1/3"
    assert failback(chunks, ready, None)["back_s"] is None  # the node never came back


def test_the_restarted_servers_readiness_is_read_from_its_log():
    log = (
        "2026-12-04 18:56:41,135 oxygen_ros.serving.server: oxygen-serve ready: warmed up"
        " in 0.1 s\n"
        "2026-12-04 18:56:54,181 oxygen_ros.serving.server: oxygen-serve listening"
        " on 127.0.0.1:1\n"
        "2026-12-04 18:56:54,312 oxygen_ros.serving.server: oxygen-serve ready: warmed up"
        " in 0.1 s\n"
    )
    first, last = ready_time(log.split("\n", 1)[0]), ready_time(log)
    assert last.wall - first.wall == pytest.approx(13.177)  # the restart's line, not the first
    assert last.at - first.at == pytest.approx(13.177, abs=0.01)  # the same on the monotonic clock
    with pytest.raises(RuntimeError, match="no 'oxygen-serve ready'"):
        ready_time("oxygen-serve listening on 127.0.0.1:1\n")


def test_the_switch_time_is_read_from_the_nodes_log():
    log = (
        "[INFO] [100.5] [oxygen_node]: connected to oxygen-serve at ws://a:1\n"
        "[INFO] [101.25] [oxygen_node]: connected to oxygen-serve at ws://b:1 (moved on from "
        "ws://a:1)\n"
    )
    assert switch_time(log, 101.0, "ws://b:1") == 101.25
    assert switch_time(log, 101.0, "ws://a:1") is None
    assert switch_time(log, 102.0, "ws://b:1") is None
