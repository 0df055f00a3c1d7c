"""Faults in the loop (``oxygen-bench faults``): on the simulated arm through the policy node over
DDS, a camera, both cameras and the joint states stop mid-episode and the sim's clock jumps forward
and back. Per fault: no command is computed from a stale input, the node keeps running, and the
arm moves again once the input is back. Timings are the bench's to print, not asserted here.

One bench run serves every test in the module (the sim and the shipped policy, one short episode
per fault); the measurement helpers are checked on hand-made timelines first, and the sim's fault
switches on a node that never starts its physics.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from oxygen_ros.sim.episode import SUCCESS, TIMEOUT, WRONG_CUBE
from oxygen_ros.tools.benches import faults, harness
from oxygen_ros.tools.benches.closed_loop_ros import Arrival
from oxygen_ros.tools.benches.faults import Act, InputAge, Window

REPO = Path(__file__).resolve().parents[1]
FAULT_S = 1.0
STOPS_ALL_INPUT = ("cameras", "joint_states")  # the node has nothing to act on: the arm holds
JUMPS = {"clock_forward": 2.0, "clock_back": -2.0, "clock_back_small": -0.3}
# the sim's faults; a killed server is test_node_failover's (and oxygen-bench failover's)
IN_SIM = [fault.key for fault in faults.FAULTS if not fault.failover]


def _full(row: dict) -> str:
    """A bench row in full, for a failed assertion (pytest shortens a dict)."""
    return json.dumps(row, default=str)


# -- the measurements, on hand-made timelines ----------------------------------------------------
def test_an_input_is_traced_to_the_newest_message_with_its_content():
    class Log:
        def source(self, stream, content, by):
            arrivals = {b"old": [Arrival(1.0, 1_000_000_000), Arrival(2.0, 2_000_000_000)]}
            known = [a for a in arrivals.get(content, []) if a.at <= by]
            return known[-1] if known else None

    act = Act(at=2.9, ros_ns=2_950_000_000, inputs={"scene": b"old", "joint_states": b"new"})
    ages = faults.input_ages(act, Log())
    assert ages["joint_states"] is None  # never seen: untraced, not judged
    assert ages["scene"].wall_s == pytest.approx(0.9)
    assert ages["scene"].stamp_s == pytest.approx(0.95)
    assert ages["scene"].stale(0.5)
    assert not InputAge(0.7, 0.5).stale(0.5)  # within the grace for taking messages between ticks
    assert InputAge(0.1, 0.6).stale(0.5)  # an old stamp is stale however recently it came


def test_hold_and_resume_from_trajectory_arrivals():
    window = Window(start=0.0, clear=2.0, onset=1.0, back=2.1)
    moving = [0.1 * i for i in range(10, 16)] + [2.2, 2.3, 2.4]  # stops 0.5 s after the onset
    hold, resume = faults.hold_and_resume(moving, window, stale_after_s=0.75)
    assert hold == pytest.approx(0.5) and resume == pytest.approx(0.1)
    steady = [0.1 * i for i in range(40)]  # never paused: the node went on (a camera masked)
    assert faults.hold_and_resume(steady, window, stale_after_s=0.75) == (None, None)
    stopped = [0.1 * i for i in range(10, 16)]  # never resumed
    assert faults.hold_and_resume(stopped, window, stale_after_s=0.75) == (
        pytest.approx(0.5),
        None,
    )


def test_the_silence_and_the_jump_are_found_in_the_streams():
    scene = [Arrival(t, 0) for t in (0.8, 0.9, 1.0, 2.05, 2.15)]
    wrist = [Arrival(t, 0) for t in (0.85, 0.95, 2.1)]
    window = faults.silent_window({"scene": scene, "wrist": wrist}, start=0.95, clear=2.0)
    assert (window.onset, window.back) == (1.0, 2.05)
    joints = [Arrival(0.02 * i, 20_000_000 * i) for i in range(50)]
    joints.append(Arrival(1.0, joints[-1].stamp_ns - 1_980_000_000))  # 2 s back
    window, jump = faults.jump_window(joints, start=0.5, clear=1.5)
    assert window.onset == window.back == 1.0 and jump == pytest.approx(-1.98)


def test_fault_selection():
    assert [f.key for f in harness.choose("all", faults.FAULTS, "faults")] == [
        f.key for f in faults.FAULTS
    ]
    assert [f.key for f in harness.choose("joint_states,cameras", faults.FAULTS, "faults")] == [
        "cameras",
        "joint_states",
    ]
    with pytest.raises(ValueError, match="unknown faults"):
        harness.choose("cameras,lidar", faults.FAULTS, "faults")


# -- the sim's fault switches ---------------------------------------------------------------------
@pytest.mark.ros
def test_the_sims_fault_switches_refuse_unknown_streams_and_queue_clock_jumps():
    import rclpy
    from rclpy.parameter import Parameter

    from oxygen_ros.sim.node import SimNode

    context = rclpy.Context()
    rclpy.init(context=context)
    sim = SimNode(context=context, parameter_overrides=[Parameter("autostart", value=False)])
    try:
        (refused,) = sim.set_parameters([Parameter("fault_silent_streams", value="scene,lidar")])
        assert not refused.successful and "lidar" in refused.reason
        assert sim.silent_streams == frozenset()
        (ok,) = sim.set_parameters([Parameter("fault_silent_streams", value="wrist, joint_states")])
        assert ok.successful and sim.silent_streams == {"wrist", "joint_states"}
        before = sim.sim.now_s
        sim.set_parameters([Parameter("fault_clock_offset_s", value=1.5)])
        sim.set_parameters([Parameter("fault_clock_offset_s", value=1.0)])
        assert sim.take_clock_jump() == pytest.approx(1.0)  # +1.5 then -0.5, applied at a step
        assert sim.take_clock_jump() == 0.0 and sim.sim.now_s == before
    finally:
        sim.destroy_node()
        context.try_shutdown()


# -- every fault, through the node ----------------------------------------------------------------
@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """One ``oxygen-bench faults`` run over the sim's faults: short episodes, 1 s silences."""
    tmp = tmp_path_factory.mktemp("faults")
    parser = argparse.ArgumentParser()
    faults.add_arguments(parser)
    args = parser.parse_args(
        [
            "--faults",
            ",".join(IN_SIM),
            "--checkpoint",
            str(REPO / "models" / "sim_so101"),
            "--fault-s",
            str(FAULT_S),
            "--warm-s",
            "0.5",
            "--timeout-s",
            "3.0",
            "--work",
            str(tmp / "work"),
            "--json",
            str(tmp / "faults.json"),
        ]
    )
    out = faults.run(args)
    assert json.loads(args.json.read_text())["rows"] == json.loads(json.dumps(out["rows"]))
    return {row["key"]: row for row in out["rows"] if "key" in row}


@pytest.mark.ros
@pytest.mark.slow
@pytest.mark.parametrize("key", IN_SIM)
def test_no_command_is_computed_from_a_stale_input(bench, key):
    row = bench[key]
    assert row["cmds"] > 0, _full(row)
    assert row["untraced"] <= row["cmds"] // 10, _full(row)  # the check saw (nearly) every input
    assert row["stale"] == 0, row["stale_by_stream"]


@pytest.mark.ros
@pytest.mark.slow
@pytest.mark.parametrize("key", IN_SIM)
def test_the_node_keeps_running_and_moves_again(bench, key):
    row = bench[key]
    assert row["node"] == "active", _full(row)
    assert row["outcome"].split()[0] in (SUCCESS, TIMEOUT, WRONG_CUBE), _full(row)
    if key == "scene_camera":  # the other camera is enough: the scene camera is masked
        assert row["hold_s"] is None and row["counters"].get("camera_masked", 0) > 0, _full(row)
        return
    assert row["resume_s"] is not None, _full(row)  # a current trajectory after the input came back
    if key in STOPS_ALL_INPUT:
        assert row["hold_s"] is not None, _full(row)  # and none for a while before: the arm held


@pytest.mark.ros
@pytest.mark.slow
@pytest.mark.parametrize("key", IN_SIM)
def test_the_fault_happened(bench, key):
    row = bench[key]
    counters = row["counters"]
    if key in JUMPS:
        assert row["jump_s"] == pytest.approx(JUMPS[key], abs=0.1), _full(row)
    else:
        assert row["gap_s"] > FAULT_S / 2, _full(row)
        # the node used inputs that aged while they were away (the stale check is not vacuous);
        # it ages an input by the later of its stamp and its arrival, and a sim running behind
        # real time ages it faster by arrival
        assert max(row["oldest_s"], row["oldest_wall_s"]) > 0.2, _full(row)
    if key == "cameras":
        assert counters.get("no_action_no_camera", 0) > 0, counters
    if key == "joint_states":
        assert counters.get("no_action_stale_joint_state", 0) > 0, counters
    if key == "clock_back":  # further back than max_observation_age_s: a restarted clock
        assert counters.get("stamp_resets", 0) > 0, counters
    # (-0.3 s is within it: what the node takes in those 0.3 s is dropped as out of order, but a
    # tick that runs long may leave it only messages stamped after the old ones: not asserted)
