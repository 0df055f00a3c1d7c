"""Parameter changes on a configured node (in-process, tiny checkpoint): the on-set callback only
validates; an accepted change is applied after it, by rclpy's post-set callback where rclpy has
one (Iron and later) or at the start of the next tick / diagnostics period (Humble's way, forced
here with ``post_set=False``). A rejected change leaves the settings, the rate plan and the
parameter itself as they were."""

from __future__ import annotations

import pytest
import rclpy
from rclpy.parameter import Parameter

from oxygen_ros.ros.node import OxygenNode

pytestmark = [pytest.mark.ros]


@pytest.fixture(params=[True, False], ids=["post_set", "next_tick"])
def configured(request, tiny_checkpoint):
    context = rclpy.Context()
    rclpy.init(context=context)
    node = OxygenNode(
        f"oxygen_params_test_{request.param}",
        context=context,
        post_set=request.param,
        parameter_overrides=[
            Parameter("checkpoint_dir", value=str(tiny_checkpoint)),
            Parameter("camera_topics", value=["/params_test/camera"]),
            Parameter("camera_slots", value=["base_0_rgb"]),
            Parameter("joint_names", value=["j1", "j2"]),
            Parameter("narration_period_s", value=0.0),
            Parameter("rate_hz", value=10.0),
            Parameter("autostart", value=False),
        ],
    )
    assert node.trigger_configure().name == "SUCCESS", node._last_error
    yield node, request.param
    node.release()
    node.destroy_node()
    context.try_shutdown()


def test_a_rejected_change_has_no_side_effect(configured):
    node, _ = configured
    settings, requested = node._settings, node._loop.governor.requested_hz
    result = node.set_parameters_atomically(
        [Parameter("rate_hz", value=20.0), Parameter("joint_lower_limits", value=[0.0, 0.0, 0.0])]
    )
    assert not result.successful and "joint_lower_limits has 3 values" in result.reason
    refused = node.set_parameters([Parameter("device", value="cuda")])[0]  # configure-only
    assert not refused.successful and "only change while the node is unconfigured" in refused.reason
    node._sync_parameters()  # what the next tick would do: nothing was accepted
    assert node._settings is settings
    assert node._loop.governor.requested_hz == requested == 10.0
    assert node.get_parameter("rate_hz").value == 10.0
    assert node.get_parameter("device").value == "cpu"


def test_an_accepted_change_applies_after_the_callback(configured):
    node, post_set = configured
    assert node.set_parameters(
        [Parameter("rate_hz", value=20.0), Parameter("max_text_chars", value=42)]
    )[0].successful
    if not post_set:  # Humble: nothing applied until the next tick or diagnostics period
        assert node._settings.max_text_chars == 500 and node._loop.governor.requested_hz == 10.0
        node._sync_parameters()
    assert node._settings.max_text_chars == 42
    assert node._settings.rate_hz == 20.0
    assert node._loop.governor.requested_hz == 20.0


def test_configure_without_a_checkpoint_fails_saying_how_to_make_one():
    context = rclpy.Context()
    rclpy.init(context=context)
    node = OxygenNode(
        "oxygen_no_checkpoint_test",
        context=context,
        parameter_overrides=[Parameter("autostart", value=False)],
    )
    try:
        assert node.trigger_configure().name == "FAILURE"
        assert node.state_label == "unconfigured"
        assert "checkpoint_dir is empty" in node._last_error
        assert "oxygen-make-checkpoint --preset tiny --out DIR" in node._last_error
    finally:
        node.destroy_node()
        context.try_shutdown()
