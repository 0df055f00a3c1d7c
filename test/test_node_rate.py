"""The node's bookkeeping without ROS: the rate a tick cost can hold, the adaptive replanning rate,
the publish-cost estimate, and language streams that always close (failed finals free their kind).

Expected numbers are worked out by hand in the comments from the module constants: a quarter of the
period kept for language (LANGUAGE_SHARE 0.25), lower below 0.95x over one window, raise above 1.25x
over three windows, new rates 1.1x under the holdable one, rounded down to 0.1 Hz; rates are judged
by the 10th percentile of the holdable rates (numpy's linear interpolation).
"""

from __future__ import annotations

import math

import pytest

from oxygen_ros.engine.types import TextDelta
from oxygen_ros.ros.params import SPECS, SettingsError, check_value
from oxygen_ros.ros.rate_control import RateGovernor, TickCost
from oxygen_ros.ros.text_streams import LanguageStreams, PublishCost


def _cost(action_ms: float, step_ms: float = 2.0, margin_ms: float = 3.0) -> TickCost:
    return TickCost(action_ms * 1e-3, step_ms * 1e-3, margin_ms * 1e-3)


def test_holdable_rate_keeps_a_quarter_of_the_period_and_one_language_step():
    # 30 ms action path: 30 / 0.75 = 40 ms > 30 + 2 + 3 = 35 ms -> 25 Hz
    assert _cost(30).holdable_hz() == pytest.approx(25.0)
    # 6 ms action path, 8 ms step: 6 / 0.75 = 8 ms < 6 + 8 + 3 = 17 ms -> 58.82 Hz
    assert _cost(6, step_ms=8).holdable_hz() == pytest.approx(1000 / 17)
    assert _cost(6, step_ms=8).total_s == pytest.approx(0.017)
    assert _cost(0, 0, 0).holdable_hz() == math.inf


def test_the_governor_lowers_to_what_ticks_hold_and_waits_a_full_window_first():
    governor = RateGovernor(60.0, adapt=True, window=4)
    assert [governor.record(_cost(30)) for _ in range(3)] == [None, None, None]
    # holdable 25 Hz < 0.95 * 60 -> 25 / 1.1 = 22.72 -> 22.7 Hz
    assert governor.record(_cost(30)) == pytest.approx(22.7)
    assert governor.effective_hz == pytest.approx(22.7)
    assert governor.effective_period_s == pytest.approx(1 / 22.7)
    # a fresh window is needed after a change: three bad ticks decide nothing
    assert [governor.record(_cost(100)) for _ in range(3)] == [None, None, None]


def test_the_governor_holds_inside_its_hysteresis_band_and_climbs_back_to_rate_hz():
    governor = RateGovernor(60.0, adapt=True, window=4)
    for _ in range(4):
        governor.record(_cost(30))
    assert governor.effective_hz == pytest.approx(22.7)
    # 27 Hz holdable (action 0.75 / 27 s): above 0.95 * 22.7 = 21.6, below 1.25 * 22.7 = 28.4 ->
    # stays
    steady = TickCost(0.75 / 27, 0.0, 0.0)
    assert [governor.record(steady) for _ in range(8)] == [None] * 8
    assert governor.holdable_hz == pytest.approx(27.0)
    # 10 ms action: max(13.3, 10 + 2 + 3 = 15) ms -> 66.7 Hz. Raising looks at 3 windows = 12 ticks:
    # after k cheap ticks they hold [27] * (12 - k) + [66.7] * k, whose 10th percentile (position
    # 1.1)
    # stays 27 < 1.25 * 22.7 = 28.4 while k <= 9; at k = 10 it is 27 + 0.1 * 39.7 = 30.97 Hz
    # -> 30.97 / 1.1 = 28.15 -> 28.1 Hz. Then 12 ticks at the new rate: 66.7 >= 1.25 * 28.1
    # -> min(60, 66.7 / 1.1 = 60.6) = 60 Hz.
    results = [governor.record(_cost(10)) for _ in range(22)]
    expected = [None] * 22
    expected[9], expected[21] = pytest.approx(28.1), 60.0
    assert results == expected
    assert governor.effective_hz == 60.0


def test_the_governor_uses_the_slow_tail_of_the_window():
    governor = RateGovernor(60.0, adapt=True, window=10)
    # nine cheap ticks (66.7 Hz) and one 60 ms tick (0.06 / 0.75 = 80 ms, 12.5 Hz): the 10th
    # percentile of the holdable rates lies 0.9 of the way from 12.5 to 66.7 Hz = 61.3 Hz -> no
    # change
    for _ in range(9):
        governor.record(_cost(10))
    assert governor.record(_cost(60)) is None
    # two slow ticks in ten: the 10th percentile is 12.5 Hz -> 12.5 / 1.1 = 11.36 -> 11.3 Hz
    governor = RateGovernor(60.0, adapt=True, window=10)
    for _ in range(8):
        governor.record(_cost(10))
    governor.record(_cost(60))
    assert governor.record(_cost(60)) == pytest.approx(11.3)


def test_skip_keeps_rate_hz_and_reset_starts_at_the_warm_up_rate():
    governor = RateGovernor(60.0, adapt=False, window=2)
    assert [governor.record(_cost(100)) for _ in range(6)] == [None] * 6
    assert governor.effective_hz == 60.0
    governor.reset(60.0, adapt=True, start_hz=32.35)
    assert governor.effective_hz == pytest.approx(32.3)
    governor.reset(60.0, adapt=False, start_hz=32.35)  # skip ignores the warm-up rate
    assert governor.effective_hz == 60.0
    governor.reset(30.0, adapt=True, start_hz=45.0)  # a feasible rate starts at rate_hz
    assert governor.effective_hz == 30.0
    governor.reset(30.0, adapt=True, start_hz=0.2)  # never below the lowest rate_hz
    assert governor.effective_hz == 1.0


def test_an_injected_delay_plans_the_rate_as_a_slower_model_would():
    """The warm-up measured the model without the bench's injected delay; the rate is planned
    with it, so a delayed node starts at a rate that leaves language its quarter of the period
    (not at rate_hz, starving every subtask until a window of late ticks has passed)."""
    from tick_helpers import tick_loop

    from oxygen_ros.ros.params import PARAMETERS, NodeSettings

    loop = tick_loop(10.0)
    loop.warm_up_cost = _cost(45)  # 45 ms + a 2 ms step + 3 ms margin: 16 Hz holds at 10 Hz
    defaults = {spec.name: spec.default for spec in PARAMETERS}
    values = {**defaults, "rate_hz": 10.0, "overrun_policy": "adapt"}
    loop.plan_rate(NodeSettings.from_values(values))
    assert loop.governor.effective_hz == 10.0
    # 300 ms more: the action path 345 ms is 3/4 of a 460 ms period: 2.17 Hz, rounded down
    loop.plan_rate(NodeSettings.from_values({**values, "inject_inference_delay_ms": 300.0}))
    assert loop.governor.effective_hz == pytest.approx(2.1)
    assert loop.warm_up_cost == _cost(45)  # the measurement itself is kept as measured


def test_publish_cost_is_cost_per_delta_times_deltas_per_tick():
    cost = PublishCost(alpha=0.2)
    assert cost.expected_s() == 0.0
    cost.record(4, 0.002)  # 0.5 ms per delta (first sample); deltas per tick 0 + 0.2 * 4 = 0.8
    assert cost.per_delta_s == pytest.approx(0.0005)
    assert cost.expected_s() == pytest.approx(0.0005 * 0.8)
    # a tick without text: 0.8 + 0.2 * (0 - 0.8) = 0.64 deltas, cost per delta kept
    cost.record(0, 0.0)
    assert cost.expected_s() == pytest.approx(0.0005 * 0.64)
    # 2 ms per delta: 0.5 + 0.2 * 1.5 = 0.8 ms; 0.64 + 0.2 * 1.36 = 0.912 deltas
    cost.record(2, 0.004)
    assert cost.per_delta_s == pytest.approx(0.0008)
    assert cost.expected_s() == pytest.approx(0.0008 * 0.912)
    seeded = PublishCost()
    seeded.seed(0.001)
    seeded.record(1, 0.003)  # 1 + 0.2 * (3 - 1) = 1.4 ms
    assert seeded.per_delta_s == pytest.approx(0.0014)


def test_a_failed_final_frees_its_kind_and_says_why():
    streams = LanguageStreams()
    streams.opened(7, "narration")
    assert streams.busy("narration")
    streams.update(TextDelta(7, "narration", "the "), None)
    update = streams.update(
        TextDelta(7, "narration", "", final=True, finish_reason="failed", detail="decode fault"),
        None,
    )
    assert not streams.busy("narration")
    assert update.full_text == "[narration] (failed: decode fault)"


def test_the_new_parameters_are_checked():
    assert SPECS["overrun_policy"].default == "adapt"
    check_value("overrun_policy", "skip")
    with pytest.raises(SettingsError, match="overrun_policy must be one of adapt, skip"):
        check_value("overrun_policy", "sometimes")
    with pytest.raises(
        SettingsError, match=r"max_consecutive_failures must be within \[1, 1e\+06\]"
    ):
        check_value("max_consecutive_failures", 0)
    with pytest.raises(SettingsError, match="max_text_chars"):
        check_value("max_text_chars", 0)
