"""The node end to end: a real ``oxygen_node`` process (tiny random-weight model) fed by a synthetic
rosbag replayed over DDS, observed by a separate test node.

One node process serves the whole module (start-up and warm-up take a few seconds on 2 cores);
tests that change its state put it back. Rates and counts are kept generous: the tiny model runs a
frame in 15-45 ms on the reference CPU, so the node runs at 15 Hz here.
"""

from __future__ import annotations

import math
import time

import pytest
from lifecycle_msgs.msg import Transition
from node_harness import (
    STATE_ACTIVE,
    STATE_INACTIVE,
    SYNTHETIC_INPUT_TOPICS,
    NodeProcess,
    playing_probe,
    stamp_ns,
    synthetic_bag_params,
    wait_for,
)
from std_msgs.msg import String

from oxygen_ros.tools.make_bag import joint_names

pytestmark = [pytest.mark.ros, pytest.mark.slow]

RATE_HZ = 15.0
HORIZON = 5
DT = 0.05
ACTION_JOINTS = joint_names(6)  # the first 6 of the bag's 7 joints are driven


@pytest.fixture(scope="module")
def node(tiny_checkpoint, tmp_path_factory):
    process = NodeProcess(
        synthetic_bag_params(tiny_checkpoint)
        | {
            "rate_hz": RATE_HZ,
            "action_joint_names": ACTION_JOINTS,
            "action_horizon": HORIZON,
            "action_dt": DT,
            "max_observation_age_s": 1.0,
            "narration_period_s": 1.0,
            "narration_max_tokens": 6,
            "answer_max_tokens": 6,
            "task": "pick up the red block",
            "kv_capacity_tokens": 1024,  # room for short texts only: a 4096-token answer is refused
        },
        tmp_path_factory.mktemp("node"),
    )
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture(scope="module")
def probe(node, synthetic_bag):
    with playing_probe(node, synthetic_bag, SYNTHETIC_INPUT_TOPICS) as probe:
        yield probe


def test_chunks_arrive_with_configured_joints_horizon_and_observation_stamps(probe):
    since = time.monotonic()
    assert wait_for(lambda: len(probe.chunks_since(since)) >= 10, 20), (
        "fewer than 10 chunks in 20 s"
    )
    time.sleep(0.2)  # let the inputs of the last chunk be recorded
    chunks = probe.chunks_since(since)
    for chunk in chunks:
        assert list(chunk.joint_names) == ACTION_JOINTS
        assert (chunk.horizon, chunk.action_dim) == (HORIZON, len(ACTION_JOINTS))
        assert len(chunk.actions) == HORIZON * len(ACTION_JOINTS)
        assert all(math.isfinite(a) for a in chunk.actions)
        assert chunk.dt == pytest.approx(DT)
        assert chunk.prefill_ms > 0 and chunk.action_ms > 0 and chunk.frame_ms >= chunk.prefill_ms
        assert 0.0 <= chunk.observation_age < 1.0
    with probe.lock:
        inputs = set(probe.input_stamps)
    stamps = [stamp_ns(c.header.stamp) for c in chunks]
    assert set(stamps) <= inputs, "a chunk's stamp is not the stamp of an input message"
    frame_ids = [c.frame_id for c in chunks]
    assert frame_ids == sorted(frame_ids) and len(set(frame_ids)) == len(frame_ids)


def test_joint_trajectory_matches_the_chunk(probe):
    since = time.monotonic()
    assert wait_for(lambda: len(probe.trajectories_since(since)) >= 5, 20)
    trajectories = probe.trajectories_since(since)
    # each trajectory is published just before its chunk: let the last chunks arrive
    time.sleep(0.3)
    chunk_stamps = {stamp_ns(c.header.stamp) for c in probe.chunks_since(since - 1.0)}
    for trajectory in trajectories:
        assert list(trajectory.joint_names) == ACTION_JOINTS
        assert len(trajectory.points) == HORIZON
        for i, point in enumerate(trajectory.points):
            assert len(point.positions) == len(ACTION_JOINTS)
            assert (
                point.time_from_start.sec + point.time_from_start.nanosec * 1e-9
                == pytest.approx((i + 1) * DT)
            )
        assert stamp_ns(trajectory.header.stamp) in chunk_stamps


def test_narration_streams_deltas_then_a_final(probe):
    def finished_narration():
        with probe.lock:
            finals = [n for n in probe.narrations if n.kind == "narration" and n.final]
        return finals[0] if finals else None

    assert wait_for(lambda: finished_narration() is not None, 20), "no narration finished"
    final = finished_narration()
    with probe.lock:
        stream = [n for n in probe.narrations if n.request_id == final.request_id]
        texts = list(probe.texts)
    assert stream[-1].final and not any(n.final for n in stream[:-1])
    assert len(stream) >= 2 and all(not n.finish_reason for n in stream[:-1])
    assert final.finish_reason in ("eos", "length", "stop")
    assert [n.token_count for n in stream] == sorted(n.token_count for n in stream)
    assert stamp_ns(final.header.stamp) > 0
    full = "".join(n.delta for n in stream)
    assert f"[narration] {full}" in texts


def test_ask_gets_an_answer(probe):
    probe.ask.publish(String(data="what is on the table?"))

    def answer():
        with probe.lock:
            return [n for n in probe.narrations if n.kind == "answer" and n.final]

    assert wait_for(lambda: answer(), 20), "no answer to ~/ask"
    assert answer()[0].finish_reason in ("eos", "length", "stop")
    assert wait_for(lambda: any(t.startswith("[answer] ") for t in list(probe.texts)), 5)


def test_a_request_too_big_for_kv_memory_is_refused_with_a_reason(probe):
    before = probe.counter("requests_refused")
    assert probe.set("answer_max_tokens", 4096).successful
    try:
        probe.ask.publish(String(data="describe everything in detail"))

        def refused():
            with probe.lock:
                return [
                    n
                    for n in probe.narrations
                    if n.kind == "answer" and n.finish_reason == "refused"
                ]

        assert wait_for(lambda: refused(), 20), "the oversized answer was not refused"
        assert refused()[0].final
        assert wait_for(
            lambda: any(t.startswith("[answer] (refused: needs") for t in list(probe.texts)), 5
        )
        assert probe.counter("requests_refused") == before + 1
    finally:
        assert probe.set("answer_max_tokens", 6).successful


def test_diagnostics_report_loop_language_memory_inputs(probe):
    values = probe.fresh_diagnostics()
    for key in (
        "state",
        "frame_rate_hz",
        "deadline_misses",
        "action_latency_p50_ms",
        "action_latency_p99_ms",
        "prefill_ms_p50",
        "tokens_per_s",
        "active_requests",
        "queued_requests",
        "kv_bytes_in_use",
        "kv_peak_bytes",
        "kv_capacity_bytes",
        "tick_overruns",
        "late_ticks",
        "requested_rate_hz",
        "effective_rate_hz",
        "warmup_tick_ms",
        "rate_feasible",
        "consecutive_failures",
        "publish_ms_per_delta",
        "captures_during_frames",
        "static_fallbacks",
        *(
            f"input_age_s {topic}"
            for topic in ("/camera/base/image_raw", "/camera/wrist/image_raw", "joint_states")
        ),
    ):
        assert key in values, f"/diagnostics lacks {key!r}: {sorted(values)}"
    assert values["state"] == "active"
    # rates and ages are the machine's to set: reported, finite and non-negative (no timing here)
    for key in ("frame_rate_hz", "input_age_s joint_states"):
        assert math.isfinite(float(values[key])) and float(values[key]) >= 0.0, (key, values[key])
    assert int(values["kv_capacity_bytes"]) >= int(values["kv_peak_bytes"]) > 0
    assert int(values["captures_during_frames"]) == 0  # warm-up captured every bucket a tick uses


def test_instruction_sets_the_task(probe):
    probe.instruction.publish(String(data="stack the green cups"))
    assert wait_for(lambda: probe.get_parameter("task") == "stack the green cups", 10)
    assert wait_for(lambda: probe.fresh_diagnostics().get("task") == "stack the green cups", 10)


def test_invalid_parameters_are_rejected_with_a_reason(probe):
    result = probe.set("rate_hz", 500.0)
    assert not result.successful and "rate_hz" in result.reason and "200" in result.reason
    result = probe.set("rate_hz", 0.5)
    assert not result.successful and "rate_hz" in result.reason
    result = probe.set("joint_lower_limits", [-1.0, -1.0])
    assert not result.successful and "joint_lower_limits has 2 values" in result.reason
    result = probe.set("camera_slots", ["base_0_rgb", "elbow_rgb"])
    assert not result.successful and "elbow_rgb" in result.reason
    result = probe.set("checkpoint_dir", "/elsewhere")
    assert not result.successful and "unconfigured" in result.reason
    result = probe.set("temperature", -1.0)
    assert not result.successful and "temperature" in result.reason
    result = probe.set("task", "   ")
    assert not result.successful and "task" in result.reason
    assert probe.get_parameter("rate_hz") == RATE_HZ


def test_valid_rate_change_is_applied(probe):
    assert probe.set("rate_hz", 10).successful  # an integer is accepted for a float parameter
    assert probe.get_parameter("rate_hz") == 10
    since = time.monotonic()
    assert wait_for(lambda: len(probe.chunks_since(since)) >= 5, 10)
    assert probe.set("rate_hz", RATE_HZ).successful


def test_lifecycle_deactivate_stops_output_and_activate_resumes(probe):
    assert probe.change_state(Transition.TRANSITION_DEACTIVATE)
    assert probe.get_state() == STATE_INACTIVE
    time.sleep(0.3)  # chunks already on the wire
    since = time.monotonic()
    time.sleep(1.5)
    assert probe.chunks_since(since) == []
    assert probe.fresh_diagnostics()["state"] == "inactive"
    assert probe.change_state(Transition.TRANSITION_ACTIVATE)
    assert probe.get_state() == STATE_ACTIVE
    since = time.monotonic()
    assert wait_for(lambda: len(probe.chunks_since(since)) >= 5, 15), (
        "no chunks after re-activation"
    )
