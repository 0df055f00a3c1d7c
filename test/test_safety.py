"""oxygen_ros.ros.safety: position and speed limits, refusal of non-finite chunks."""

from __future__ import annotations

import numpy as np
import pytest

from oxygen_ros.ros.safety import SafetyFilter, UnsafeChunkError


def test_unlimited_filter_passes_the_chunk_through():
    chunk = np.arange(6, dtype=np.float32).reshape(3, 2)
    safe = SafetyFilter(2).apply(chunk, np.zeros(2), 0.1)
    assert safe.clipped == 0 and np.array_equal(safe.actions, chunk)


def test_position_limits_clip_and_count():
    safe = SafetyFilter(2, lower=[-1.0, 0.0], upper=[1.0, 0.5]).apply(
        np.array([[2.0, 0.2], [-3.0, 0.7]]), np.zeros(2), 0.1
    )
    assert safe.actions.tolist() == [[1.0, pytest.approx(0.2)], [-1.0, 0.5]]
    assert safe.clipped == 3


def test_speed_limit_starts_from_the_current_state_and_chains_steps():
    safe = SafetyFilter(1, max_velocity=[1.0]).apply(
        np.array([[1.0], [1.0], [1.0]]), np.array([0.0]), 0.1
    )
    assert safe.actions[:, 0] == pytest.approx([0.1, 0.2, 0.3])
    assert safe.clipped == 3


def test_position_limits_win_over_the_speed_limit():
    safe = SafetyFilter(1, lower=[-0.1], upper=[0.1], max_velocity=[0.5]).apply(
        np.array([[2.0], [2.0]]), np.array([1.0]), 0.1
    )
    assert safe.actions[:, 0].tolist() == pytest.approx([0.1, 0.1])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_chunks_are_refused(bad):
    chunk = np.zeros((2, 2))
    chunk[1, 0] = bad
    with pytest.raises(UnsafeChunkError, match="non-finite"):
        SafetyFilter(2, lower=[-1, -1], upper=[1, 1]).apply(chunk, np.zeros(2), 0.1)


def test_bad_limits_are_rejected():
    with pytest.raises(ValueError, match="needs 3 values"):
        SafetyFilter(3, lower=[0.0, 0.0])
    with pytest.raises(ValueError, match="exceed"):
        SafetyFilter(1, lower=[1.0], upper=[0.0])
    with pytest.raises(ValueError, match="positive"):
        SafetyFilter(1, max_velocity=[0.0])


def test_velocity_command_integrates_from_the_current_state():
    # q = 1.0, v = 0.5 then -1.0 at dt 0.1: positions 1.05, 0.95
    safe = SafetyFilter(1).apply_velocity(np.array([[0.5], [-1.0]]), np.array([1.0]), 0.1)
    assert safe.positions[:, 0] == pytest.approx([1.05, 0.95])
    assert safe.velocities[:, 0] == pytest.approx([0.5, -1.0])
    assert safe.clipped == 0


def test_velocity_limits_clip_speeds_and_position_limits_the_integral():
    # v 3.0 clipped to 1.0 -> 0.1 per step from 0: 0.1, 0.2, then the upper limit 0.25 stops it (v =
    # 0.5)
    safe = SafetyFilter(1, upper=[0.25], max_velocity=[1.0]).apply_velocity(
        np.full((3, 1), 3.0), np.zeros(1), 0.1
    )
    assert safe.positions[:, 0] == pytest.approx([0.1, 0.2, 0.25])
    assert safe.velocities[:, 0] == pytest.approx([1.0, 1.0, 0.5])
    assert safe.clipped == 3


def test_position_dims_of_a_velocity_command_stay_positions():
    safe = SafetyFilter(2).apply_velocity(
        np.array([[1.0, 0.3], [1.0, 0.3]]), np.array([0.0, 0.1]), 0.5, [1]
    )
    assert safe.positions[:, 1] == pytest.approx([0.3, 0.3])
    assert safe.velocities[:, 1] == pytest.approx([0.4, 0.0])  # (0.3 - 0.1) / 0.5, then still
    assert safe.positions[:, 0] == pytest.approx([0.5, 1.0])


def test_velocity_command_refuses_non_finite_values():
    with pytest.raises(UnsafeChunkError, match="non-finite"):
        SafetyFilter(1).apply_velocity(np.array([[np.inf]]), np.zeros(1), 0.1)
