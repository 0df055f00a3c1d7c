"""``oxygen-bench --robot`` (issue 18): a bench runs the model inside a robot's real transforms
(policy_io/robots.py) — its state width and state transform, the state in the prompt or not, its
action width, output transform, camera slots and trained horizon — instead of the generic
pass-through."""

from __future__ import annotations

import json

import numpy as np
import pytest

from oxygen_ros.policy_io.robots import RobotAdapter
from oxygen_ros.tools import bench
from oxygen_ros.tools.benches import common


def _args(*extra: str):
    return bench.parse_args(["action", "--preset", "tiny", *extra])


@pytest.mark.parametrize(
    "robot, state_dim, action_dim, horizon, state_in_prompt",
    [
        ("generic", 7, 7, 10, True),  # the tiny preset's own horizon
        ("droid", 8, 8, 15, True),
        ("libero", 8, 7, 10, False),
    ],
)
def test_the_bench_policy_and_frames_follow_the_robot(
    robot, state_dim, action_dim, horizon, state_in_prompt
):
    args = _args("--robot", robot)
    policy = common.make_policy(args)
    assert policy.robot.name == robot and policy.action_dim == action_dim
    assert policy.config.action_horizon == horizon
    observation = common.make_observations(args, policy)[0]
    assert observation.state.shape == (state_dim,)
    tokens, mask = policy.prompt_tokens(observation.state, observation.prompt)
    text = policy.tokenizer.decode(tokens[mask])
    assert ("State: " in text) is state_in_prompt
    actions = policy.robot_actions(
        np.zeros((horizon, policy.config.action_dim), np.float32), observation.state
    )
    assert actions.shape == (horizon, action_dim)


def test_robot_changes_the_transforms_a_bench_runs(tmp_path, monkeypatch):
    """The same bench command with another --robot runs that robot's transforms (recorded by
    spying on the adapters' state and action transforms)."""
    calls: list[tuple[str, str]] = []
    for name in ("state_to_pi", "actions_from_pi"):
        real = getattr(RobotAdapter, name)

        def spy(self, *args, _real=real, _name=name):
            calls.append((_name, self.name))
            return _real(self, *args)

        monkeypatch.setattr(RobotAdapter, name, spy)
    seen = {}
    for robot in ("generic", "droid", "libero"):
        calls.clear()
        out = tmp_path / f"{robot}.json"
        common = ["--preset", "tiny", "--steps", "2", "--json", str(out)]
        assert (
            bench.main(
                ["action", *common, "--robot", robot, "--repeats", "1", "--warmup", "0"]
                + ["--camera-counts", "1"]
            )
            == 0
        )
        assert json.loads(out.read_text())["robot"] == robot
        seen[robot] = set(calls)
    for robot, transforms in seen.items():
        assert transforms == {("state_to_pi", robot), ("actions_from_pi", robot)}, transforms


def test_a_robot_the_preset_or_cameras_cannot_serve_is_refused_clearly():
    with pytest.raises(SystemExit, match="robot aloha has 14 action dims but preset 'tiny' only 8"):
        common.make_policy(_args("--robot", "aloha"))
    args = _args("--robot", "droid", "--cameras", "3")
    with pytest.raises(SystemExit, match="robot droid was trained with 2 cameras"):
        common.make_observations(args, common.make_policy(args))
