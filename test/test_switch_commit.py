"""`engine.switch_commit.SwitchCommitment`: a gripper switch a chunk plans ahead runs at the time
it was first planned for, even while each new chunk plans it ahead again; a sooner plan brings it
forward, a switch no longer planned is dropped, and a switch made holds."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from oxygen_ros.engine.counters import Counters
from oxygen_ros.engine.switch_commit import HOLD_S, SwitchCommitment
from oxygen_ros.engine.types import ActionChunk, Observation

DT = 0.1
HORIZON = 10
ARM = 2  # two arm dims, then the gripper


def chunk(open_at: int | None, closed: bool = True) -> np.ndarray:
    """A chunk whose gripper is ``closed`` (1) until step ``open_at`` switches it (None: never)."""
    before, after = (1.0, 0.0) if closed else (0.0, 1.0)
    actions = np.full((HORIZON, ARM + 1), 0.3)
    actions[:, ARM] = before
    if open_at is not None:
        actions[open_at:, ARM] = after
    return actions


def commitment(**kwargs) -> SwitchCommitment:
    return SwitchCommitment((ARM,), 0.5, DT, **kwargs)


def firsts(commit: SwitchCommitment, plans: list[int | None]) -> list[float]:
    """The gripper's first step of each frame's chunk (one frame per DT) after the commitment."""
    return [commit.apply(chunk(k), frame * DT)[0, ARM] for frame, k in enumerate(plans)]


def test_a_switch_planned_ahead_every_frame_runs_when_first_planned():
    # each frame plans the opening 3 steps ahead: on its own the gripper never opens
    # (planned on frame 1 for step 3: 0.1 + 4 * 0.1 s, the first step of frame 4)
    assert firsts(commitment(), [None] + [3] * 6) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    commit = commitment()
    commit.apply(chunk(None), 0.0)
    kept = commit.apply(chunk(3), DT)  # the switch is due at step 3's time: 0.1 + 4 * 0.1
    assert list(kept[:, ARM]) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    later = commit.apply(chunk(5), 2 * DT)  # planned later: the kept time still holds
    assert list(later[:, ARM][:4]) == [1.0, 1.0, 0.0, 0.0]
    assert commit.switches == 0
    np.testing.assert_array_equal(later[:, :ARM], 0.3)  # the arm is the chunk's own


def test_a_sooner_plan_brings_the_switch_forward():
    commit = commitment()
    commit.apply(chunk(None), 0.0)
    commit.apply(chunk(6), DT)
    assert commit.apply(chunk(0), 2 * DT)[0, ARM] == 0.0  # planned now: now


def test_a_switch_no_longer_planned_is_dropped():
    # planned once, then not on two frames in a row: the gripper stays closed
    assert firsts(commitment(), [None, 2, None, None, None, None]) == [1.0] * 6
    # one frame without it is not enough to drop it
    assert firsts(commitment(), [None, 2, None, 5])[-1] == 0.0


def test_a_switch_made_holds_then_the_policy_decides_again():
    commit = commitment()
    commit.apply(chunk(None), 0.0)
    commit.apply(chunk(1), DT)
    assert commit.apply(chunk(4), 2 * DT)[0, ARM] == 0.0  # due: open
    assert commit.switches == 1  # sooner than the chunk in hand planned
    held = round(HOLD_S / DT)
    frames = range(3, 3 + held + 1)
    again = [commit.apply(chunk(0, closed=False), frame * DT) for frame in frames]
    # the chunks plan closing at once, but the opening holds for HOLD_S
    assert [c[0, ARM] for c in again[: held - 1]] == [0.0] * (held - 1)
    assert again[-1][0, ARM] == 1.0


def test_the_chunk_passed_in_is_left_as_it_was():
    commit = commitment()
    commit.apply(chunk(None), 0.0)
    raw = chunk(1).astype(np.float32)
    kept = commit.apply(raw, 10 * DT)
    assert kept.dtype == np.float32 and raw[0, ARM] == 1.0
    assert commit.apply(chunk(None), 11 * DT)[0, ARM] == 0.0  # ... while its switch was kept


def test_reset_forgets_a_kept_switch():
    commit = commitment()
    commit.apply(chunk(None), 0.0)
    commit.apply(chunk(2), DT)
    commit.reset()
    assert commit.apply(chunk(None), 0.0)[0, ARM] == 1.0
    assert commit.apply(chunk(None), DT)[0, ARM] == 1.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(dims=()), "at least one gripper dim"),
        (dict(level=float("nan")), "finite"),
        (dict(action_dt=0.0), "action_dt"),
        (dict(hold_s=-1.0), "hold_s"),
        (dict(misses=0), "misses"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    settings = dict(dims=(ARM,), level=0.5, action_dt=DT) | kwargs
    with pytest.raises(ValueError, match=message):
        SwitchCommitment(**settings)


def test_a_chunk_without_the_gripper_dim_is_refused():
    with pytest.raises(ValueError, match="does not hold gripper dims"):
        commitment().apply(np.zeros((HORIZON, ARM)), 0.0)


# -- in the node's action path (gripper_commit) ---------------------------------------------------


class RecedingEngine:
    """An engine whose every chunk plans to open the gripper 3 steps ahead."""

    policy = SimpleNamespace(published_horizon=HORIZON)

    def __init__(self) -> None:
        self.published: list[np.ndarray | None] = []

    def set_action_dt(self, action_dt: float) -> None:
        pass

    def act(self, observation: Observation) -> ActionChunk:
        return ActionChunk(len(self.published), observation.stamp, chunk(3), 1.0, 1.0)

    def chunk_published(self, frame_id: int, actions, delay_s: float) -> None:
        self.published.append(actions)


def test_the_nodes_loop_keeps_the_switch_publishes_it_and_counts_it():
    from tick_helpers import KeptOutputs, tick_loop

    from oxygen_ros.ros.observation import NS_PER_S
    from oxygen_ros.ros.params import PARAMETERS, NodeSettings

    counters = Counters()
    clock = {"ns": 0}
    loop = tick_loop(10.0, lambda: clock["ns"], counters)
    loop.outputs = KeptOutputs()
    values = {spec.name: spec.default for spec in PARAMETERS}
    joints = ["shoulder", "elbow", "gripper"]
    values.update(joint_names=joints, gripper_joint_names=["gripper"], action_dt=DT)
    engine = RecedingEngine()

    def gripper_sent(settings: NodeSettings, frames: range) -> list[float]:
        for frame in frames:
            clock["ns"] = stamp_ns = frame * NS_PER_S // 10
            state = np.array([0.3, 0.3, 1.0])
            assert loop._act(engine, settings, Observation({}, state, "", frame * DT), stamp_ns, 0)
        return [float(c.actions[0, ARM]) for c in loop.outputs.commands[-len(frames) :]]

    alone = NodeSettings.from_values(values)
    assert gripper_sent(alone, range(0, 5)) == [1.0] * 5  # planned ahead every tick: never
    kept = NodeSettings.from_values({**values, "gripper_commit": True})
    assert gripper_sent(kept, range(5, 10)) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert counters.get("gripper_switches_kept") == 1
    np.testing.assert_array_equal(engine.published[-1][:, ARM], 0.0)  # RTC follows the switch
    loop.forget_gripper_switches()  # a fresh run: the hold is gone, the switch planned anew
    assert gripper_sent(kept, range(10, 11)) == [1.0]
