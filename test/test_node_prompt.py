"""Set-time checks of the real node (in-process rclpy, tiny checkpoint; issue 18): a task whose
prompt cannot fit the model's ``max_token_len`` with the robot's state is refused with a reason
naming the limit — as the ``task`` parameter, on ``~/instruction`` (over DDS) and in the
parameters ``configure`` reads — and ``device: cuda`` on a torch without CUDA fails ``configure``
saying what was asked, what this torch has and the fix, leaving the node alive and
unconfigured."""

from __future__ import annotations

import threading

import pytest
import rclpy
import torch
from node_harness import wait_for
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter
from std_msgs.msg import String

from oxygen_ros.policy_io.prompts import MIN_SUBTASK_TOKENS, preset
from oxygen_ros.policy_io.tokenizer import Pi05Tokenizer
from oxygen_ros.ros.node import OxygenNode

pytestmark = [pytest.mark.ros]

JOINTS = [f"j{i}" for i in range(1, 8)]
# ~430 characters: well over the tiny model's 96 prompt tokens, under max_text_chars (500)
LONG_TASK = "pick up the red cup and place it on the tray next to the green bowl, " * 6
SHORT_TASK = "stack the blue block on the red one"


def make_node(name: str, context, tiny_checkpoint, **overrides) -> OxygenNode:
    values = {
        "checkpoint_dir": str(tiny_checkpoint),
        "camera_topics": [f"/{name}/camera"],
        "camera_slots": ["base_0_rgb"],
        "joint_names": JOINTS,
        "narration_period_s": 0.0,
        "rate_hz": 10.0,
        "autostart": False,
        **overrides,
    }
    return OxygenNode(
        name,
        context=context,
        parameter_overrides=[Parameter(key, value=value) for key, value in values.items()],
    )


@pytest.fixture(scope="module")
def active(tiny_checkpoint):
    context = rclpy.Context()
    rclpy.init(context=context)
    node = make_node("oxygen_prompt_test", context, tiny_checkpoint)
    assert node.start(), node._last_error
    talker = rclpy.create_node("prompt_test_talker", context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    executor.add_node(talker)
    thread = threading.Thread(target=executor.spin, daemon=True)
    thread.start()
    yield node, talker
    executor.shutdown()
    thread.join(timeout=5)
    node.release()
    node.destroy_node()
    talker.destroy_node()
    context.try_shutdown()


def test_a_task_parameter_whose_prompt_cannot_fit_is_refused_naming_the_limit(active):
    node, _ = active
    result = node.set_parameters([Parameter("task", value=LONG_TASK)])[0]
    assert not result.successful
    assert result.reason.startswith(f"task refused ({len(LONG_TASK)} characters)")
    assert "7-value robot state" in result.reason and "max_token_len 96" in result.reason
    assert node.get_parameter("task").value != LONG_TASK
    assert node.set_parameters([Parameter("task", value=SHORT_TASK)])[0].successful


def test_a_long_instruction_is_refused_over_dds(active):
    node, talker = active
    publisher = talker.create_publisher(String, "/oxygen_prompt_test/instruction", 10)
    assert wait_for(lambda: publisher.get_subscription_count() >= 1, 10)
    before = node._counters.get("instruction_rejected_invalid")
    publisher.publish(String(data=LONG_TASK))
    assert wait_for(lambda: node._counters.get("instruction_rejected_invalid") == before + 1, 10)
    assert node.get_parameter("task").value != LONG_TASK
    publisher.publish(String(data="open the drawer"))
    assert wait_for(lambda: node.get_parameter("task").value == "open the drawer", 10)
    assert node._counters.get("instruction_rejected_invalid") == before + 1


def test_configure_refuses_a_task_that_cannot_fit_and_the_node_stays_up(tiny_checkpoint):
    context = rclpy.Context()
    rclpy.init(context=context)
    node = make_node("oxygen_long_task_test", context, tiny_checkpoint, task=LONG_TASK)
    try:
        assert node.trigger_configure().name == "FAILURE"
        assert node.state_label == "unconfigured" and node._engine is None
        assert "task refused" in node._last_error and "max_token_len 96" in node._last_error
        assert node.set_parameters([Parameter("task", value=SHORT_TASK)])[0].successful
        assert node.trigger_configure().name == "SUCCESS", node._last_error
    finally:
        node.release()
        node.destroy_node()
        context.try_shutdown()


def task_leaving_a_subtask(tiny_checkpoint, room: int) -> str:
    """A task whose subtask-conditioned openpi_subtask prompt (7-value state, worst case) leaves a
    subtask exactly ``room`` of the tiny model's 96 tokens."""
    tokenizer = Pi05Tokenizer(tiny_checkpoint / "tokenizer.model")
    fmt = preset("openpi_subtask")
    for repeats in range(60):
        for ending in ("", " a", " up a", " cup"):
            task = "pick" + " up" * repeats + ending
            if tokenizer.longest_prompt(task, 7, fmt, True) == 96 - room:
                return task
    raise AssertionError(f"no task leaves a subtask {room} tokens")


def test_configure_refuses_a_task_that_leaves_a_subtask_no_room(tiny_checkpoint):
    """openpi_subtask, same_frame: a task whose prompt fits but leaves a subtask fewer tokens than
    it can say anything with is refused with the numbers; one that leaves enough configures."""
    cramped = task_leaving_a_subtask(tiny_checkpoint, MIN_SUBTASK_TOKENS - 1)
    context = rclpy.Context()
    rclpy.init(context=context)
    node = make_node(
        "oxygen_subtask_room_test",
        context,
        tiny_checkpoint,
        task=cramped,
        prompt_format="openpi_subtask",
        subtask_conditioning="same_frame",
    )
    try:
        assert node.trigger_configure().name == "FAILURE"
        error = node._last_error
        assert "task refused" in error
        assert f"leaves a subtask {MIN_SUBTASK_TOKENS - 1} of the model's max_token_len 96" in error
        assert f"a subtask needs at least {MIN_SUBTASK_TOKENS}" in error
        roomy = task_leaving_a_subtask(tiny_checkpoint, MIN_SUBTASK_TOKENS)
        assert node.set_parameters([Parameter("task", value=roomy)])[0].successful
        assert node.trigger_configure().name == "SUCCESS", node._last_error
        # and when the task is set on the configured node
        refused = node.set_parameters([Parameter("task", value=cramped)])[0]
        assert not refused.successful and "a subtask needs at least" in refused.reason
    finally:
        node.release()
        node.destroy_node()
        context.try_shutdown()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot use CUDA")
def test_configure_with_cuda_on_a_torch_without_it_says_what_torch_has_and_the_fix(
    tiny_checkpoint,
):
    context = rclpy.Context()
    rclpy.init(context=context)
    node = make_node("oxygen_no_cuda_test", context, tiny_checkpoint, device="cuda")
    try:
        assert node.trigger_configure().name == "FAILURE"
        assert node.state_label == "unconfigured" and node._engine is None
        error = node._last_error
        assert error.startswith("configure failed: DeviceUnavailable: device 'cuda' was asked for")
        assert f"torch {torch.__version__} cannot use CUDA" in error
        assert "torch.cuda.is_available() is False" in error
        assert "device:=cpu" in error and "install a CUDA build of torch" in error
        # alive: fixed by the parameter the message names
        assert node.set_parameters([Parameter("device", value="cpu")])[0].successful
        assert node.trigger_configure().name == "SUCCESS", node._last_error
    finally:
        node.release()
        node.destroy_node()
        context.try_shutdown()
