"""oxygen_ros.ros.params: single-value checks and cross-parameter consistency (no DDS needed)."""

from __future__ import annotations

import pytest
from rcl_interfaces.msg import ParameterType

from oxygen_ros.ros.params import PARAMETERS, SPECS, NodeSettings, SettingsError, check_value

DEFAULTS = {spec.name: spec.default for spec in PARAMETERS}


def settings(**changes) -> NodeSettings:
    return NodeSettings.from_values({**DEFAULTS, **changes})


def test_defaults_are_valid():
    s = settings()
    assert [c.slot for c in s.cameras] == ["base_0_rgb", "left_wrist_0_rgb"]
    assert s.action_joint_names == s.joint_names and s.period_s == pytest.approx(1 / 60)


def test_every_parameter_has_a_description_and_numbers_have_ranges():
    for spec in PARAMETERS:
        descriptor = spec.descriptor()
        assert len(descriptor.description) > 20, spec.name
        if spec.type in (ParameterType.PARAMETER_INTEGER, ParameterType.PARAMETER_DOUBLE):
            assert descriptor.integer_range or descriptor.floating_point_range, spec.name
    assert SPECS["autostart"].descriptor().read_only
    assert SPECS["rate_hz"].range == (1.0, 200.0) and SPECS["rate_hz"].default == 60.0


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(camera_slots=["base_0_rgb"]), "1 entries for 2 camera_topics"),
        (dict(camera_slots=["base_0_rgb", "base_0_rgb"]), "unique"),
        (dict(camera_slots=["base_0_rgb", "top_rgb"]), "top_rgb"),
        (dict(camera_compressed=[True]), "camera_compressed has 1"),
        (dict(action_joint_names=["joint_1", "gripper"]), "gripper"),
        (dict(joint_lower_limits=[0.0] * 3), "joint_lower_limits has 3 values but there are 7"),
        (dict(joint_lower_limits=[1.0] * 7, joint_upper_limits=[0.0] * 7), "exceed"),
        (dict(max_joint_velocity=[0.0] * 7), "positive"),
        (dict(rate_hz=0.5), "rate_hz must be within [1, 200]"),
        (dict(rate_hz="fast"), "rate_hz must be a number"),
        (dict(joint_names=[]), "at least one joint"),
        (dict(task=" "), "task must not be empty"),
        (dict(dtype="int8"), "dtype must be one of"),
    ],
)
def test_inconsistent_parameters_are_refused_with_a_reason(changes, message):
    with pytest.raises(SettingsError, match=None) as error:
        settings(**changes)
    assert message in str(error.value)


def test_integers_are_accepted_for_float_parameters_and_empty_yaml_lists_for_arrays():
    s = settings(rate_hz=20, joint_lower_limits=None, action_joint_names=None)
    assert s.rate_hz == 20.0 and isinstance(s.rate_hz, float)
    assert s.joint_lower_limits == () and s.action_joint_names == s.joint_names


def test_compressed_transport_is_inferred_from_the_topic_name():
    s = settings(camera_topics=["/a/image_raw/compressed", "/b/image_raw"])
    assert [c.compressed for c in s.cameras] == [True, False]


def test_check_value_checks_one_value_alone():
    check_value("rate_hz", 30.0)
    with pytest.raises(SettingsError, match="numbers"):
        check_value("joint_upper_limits", ["a"])


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(prompt_format="openpi2"), "unknown prompt format 'openpi2'"),
        (dict(subtask_conditioning="always"), "subtask_conditioning must be one of"),
        (dict(subtask_conditioning="prompt"), "'openpi' has none"),
        (
            dict(prompt_format="pi052", subtask_conditioning="same_frame"),
            "use subtask_conditioning prompt",
        ),
        (
            dict(prompt_format="mine", prompt_format_custom='{"name": "mine", "action": "{tsk}"}'),
            r"unknown field\(s\) \['tsk'\]",
        ),
        (
            dict(
                prompt_format="opentau",
                robot="libero",
                joint_names=[f"j{i}" for i in range(8)],
                action_joint_names=[f"a{i}" for i in range(7)],
                camera_slots=["base_0_rgb", "left_wrist_0_rgb"],
            ),
            "without state bins",
        ),
    ],
)
def test_prompt_formats_are_checked_at_configure(changes, message):
    with pytest.raises(SettingsError, match=message):
        settings(**changes)


def test_a_custom_prompt_format_from_the_params_yaml():
    custom = "name: mine\nbase: openpi_subtask\nkinds:\n  subtask: {max_tokens: 8}\n"
    s = settings(
        prompt_format="mine", prompt_format_custom=custom, subtask_conditioning="same_frame"
    )
    assert s.format.name == "mine" and s.format.kind("subtask").max_tokens == 8


def test_gripper_commit_needs_gripper_dims():
    with pytest.raises(SettingsError, match="gripper_commit needs gripper dims"):
        settings(gripper_commit=True)  # generic robot, no gripper_joint_names
    joints = ["shoulder", "elbow", "gripper"]
    s = settings(gripper_commit=True, joint_names=joints, gripper_joint_names=["gripper"])
    assert s.gripper_commit and s.gripper_dims == (2,) and s.gripper_switch_level == 0.5


def test_the_held_object_gate_reads_the_gripper_joints_state_and_is_checked():
    assert settings().held_gate is None  # no pattern: no gate
    joints = ["shoulder", "gripper", "elbow"]
    s = settings(
        joint_names=joints,
        action_joint_names=["shoulder", "elbow", "gripper"],  # the gripper: action dim 2, state 1
        gripper_joint_names=["gripper"],
        subtask_held_pattern="^(carry|release) ",
        subtask_held_range=[0.25, 0.8],
    )
    gate = s.held_gate
    assert (gate.dims, gate.low, gate.high) == ((1,), 0.25, 0.8)
    held = dict(joint_names=joints, gripper_joint_names=["gripper"])
    for changes, message in (
        (dict(subtask_held_pattern="^carry"), "needs subtask_held_range"),
        (dict(subtask_held_pattern="^carry", subtask_held_range=[0.2], **held), "low, high"),
        (dict(subtask_held_pattern="^carry", subtask_held_range=[0.2, 0.8]), "gripper dims"),
        (dict(subtask_held_pattern="(carry", subtask_held_range=[0.2, 0.8], **held), "pattern"),
        (dict(subtask_held_pattern="^carry", subtask_held_range=[0.8, 0.2], **held), "above"),
    ):
        with pytest.raises(SettingsError, match=message):
            settings(**changes)


def test_the_phase_order_is_built_from_its_patterns_and_checked():
    assert settings().phase_order is None  # none given: every change waits for confirmations
    phases = ["^reach ", "^grasp ", "^carry ", "^release "]
    order = settings(subtask_phase_order=phases).phase_order
    assert order.patterns == tuple(phases) and order.advances("reach a", "carry a to b")
    for phases, message in ((["^reach "], "two phases"), (["^reach ", "(grasp"], "grasp")):
        with pytest.raises(SettingsError, match=f"subtask_phase_order: .*{message}"):
            settings(subtask_phase_order=phases)
