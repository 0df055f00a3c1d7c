"""pi0.5's hierarchy in the real node over DDS: the current subtask on ~/subtask (transient-local,
so a subscriber that joins late still gets it), every chunk after it carries it, /diagnostics shows
the loop, and ~/instruction starts a new subtask at once."""

from __future__ import annotations

import pytest
from node_harness import (
    SYNTHETIC_INPUT_TOPICS,
    NodeProcess,
    playing_probe,
    synthetic_bag_params,
    wait_for,
)
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
from std_msgs.msg import String

from oxygen_ros.tools.make_bag import joint_names

pytestmark = [pytest.mark.ros, pytest.mark.slow]

LATCHED = QoSProfile(
    depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL
)


@pytest.fixture(scope="module")
def node(tiny_checkpoint, tmp_path_factory):
    process = NodeProcess(
        synthetic_bag_params(tiny_checkpoint)
        | {
            "rate_hz": 10.0,
            "action_joint_names": joint_names(6),
            "action_horizon": 5,
            "max_observation_age_s": 1.0,
            "narration_period_s": 0.0,
            "task": "pick up the red block",
            "prompt_format": "openpi_subtask",
            "subtask_conditioning": "same_frame",
            "subtask_period_s": 0.0,  # one subtask per task: ~/instruction alone starts new ones
            "subtask_max_tokens": 4,
        },
        tmp_path_factory.mktemp("node"),
    )
    yield process
    assert process.stop() == 0, process.log()[-3000:]


@pytest.fixture(scope="module")
def probe(node, synthetic_bag):
    with playing_probe(node, synthetic_bag, SYNTHETIC_INPUT_TOPICS) as probe:
        yield probe


def subtask_chunks(probe):
    with probe.lock:
        return [msg for _, msg in probe.chunks if msg.subtask_id > 0]


def test_subtask_is_published_latched_and_conditions_every_following_chunk(probe):
    assert wait_for(lambda: len(subtask_chunks(probe)) >= 3, 60), "no conditioned chunk"
    # a subscriber that joins now still receives the current subtask (transient-local)
    received: list[str] = []
    probe.node.create_subscription(
        String, f"/{probe.target}/subtask", lambda m: received.append(m.data), LATCHED
    )
    assert wait_for(lambda: received, 10), "~/subtask delivered nothing to a late subscriber"
    chunks = subtask_chunks(probe)
    assert all(msg.subtask == received[-1] for msg in chunks[-2:])
    with probe.lock:
        ids = [msg.subtask_id for _, msg in probe.chunks]
    first = ids.index(chunks[0].subtask_id)
    assert all(i > 0 for i in ids[first:]), "a chunk after the first subtask was unconditioned"


def test_diagnostics_show_the_subtask_loop(probe):
    assert wait_for(lambda: "subtask_refreshes" in probe.fresh_diagnostics(), 20)
    values = probe.fresh_diagnostics()
    for key in ("subtask", "subtask_age_s", "subtask_decode_ms", "chunks_per_subtask"):
        assert key in values, f"/diagnostics lacks {key!r}"
    assert int(values["subtask_refreshes"]) >= 1
    assert float(values["subtask_age_s"]) >= 0.0 and float(values["subtask_decode_ms"]) > 0.0
    assert values["chunks_per_subtask"].startswith("1:")


def test_instruction_starts_a_new_subtask(probe):
    before = int(probe.fresh_diagnostics()["subtask_refreshes"])
    with probe.lock:
        seen = len(probe.chunks)
    probe.instruction.publish(String(data="open the drawer"))
    assert wait_for(
        lambda: int(probe.fresh_diagnostics().get("subtask_refreshes", 0)) > before, 60
    ), "~/instruction did not start a new subtask"
    with probe.lock:
        after = [msg for _, msg in probe.chunks[seen:]]
    # the new task's first chunks are not conditioned on the old task's subtask
    assert any(msg.subtask_id == 0 for msg in after)
