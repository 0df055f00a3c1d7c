"""``oxygen-bench sim-policy``'s real-time chunking under a simulated delay, with the shipped
checkpoint (models/sim_so101, trained with training-time RTC) on held-out layouts.

A chunk reaches the controllers ``D`` frames after its observation, and the arm executes the
chunk it has meanwhile; RTC freezes exactly those ``D`` steps (the engine's `ChunkContinuity`,
told the delay as the node tells it); ``guided`` runs guided RTC on a checkpoint trained for RTC.
"""

from __future__ import annotations

import os

os.environ.setdefault("MUJOCO_GL", "egl")  # before mujoco's first import, as oxygen_ros.sim does


import numpy as np  # noqa: E402
import pytest  # noqa: E402
from sim_policy_helpers import (  # noqa: E402
    CHECKPOINT,
    FORMAT,
    HELDOUT_SEED,
    bench_args,
    touch_simulation,
)

from oxygen_ros.engine.runtime import ModelSpec, load_policy  # noqa: E402
from oxygen_ros.tools.benches import sim_policy  # noqa: E402
from oxygen_ros.tools.benches.closed_loop import round_task  # noqa: E402
from oxygen_ros.tools.benches.subtask_modes import Continuity, PromptedChunks  # noqa: E402

DT = 0.1


@pytest.fixture(scope="module")
def policy():
    return load_policy(ModelSpec(checkpoint_dir=str(CHECKPOINT)))


@pytest.fixture()
def sim():
    sim = touch_simulation()
    yield sim
    sim.world.close()


class Told:
    """A source's `published` calls, counted."""

    def __init__(self) -> None:
        self.calls = 0

    def published(self) -> None:
        self.calls += 1


def arm_reference(sim) -> np.ndarray:
    from oxygen_ros.sim.episode import ARM_CONTROLLER

    return sim.controllers[ARM_CONTROLLER].sample(sim.now_s)[0]


def run_frames(sim, frames: int) -> None:
    for _ in range(round(frames * DT / sim.control_dt)):
        sim.control_step()


def test_a_late_chunk_is_taken_up_at_its_step_and_the_old_one_runs_meanwhile(sim):
    from oxygen_ros.sim.scene import ARM_JOINTS

    task, seed = round_task(0, HELDOUT_SEED, "touch")
    sim.reset(task, seed)
    start = np.append(sim.world.arm_positions(), sim.world.gripper_opening())
    ramp = np.arange(1, 11)[:, None] * 0.02
    old = (start + ramp).astype(np.float32)  # point i: the start + 0.02 (i + 1) rad
    new = (start - ramp).astype(np.float32)
    told = Told()
    delivery = sim_policy.Delivery(DT)
    delivery.start(0, 0, sim.now_s, old)
    delivery.arrive(sim, told, 0)  # no delay: sent at once
    run_frames(sim, 1)
    delivery.start(1, 2, sim.now_s, new)  # observed at frame 1, due at frame 3
    delivery.arrive(sim, told, 1)
    assert told.calls == 1 and delivery.in_flight is not None
    run_frames(sim, 2)  # frames 1 and 2 execute the old chunk: its points 1 and 2 at 0.2, 0.3 s
    arm = len(ARM_JOINTS)
    assert np.allclose(arm_reference(sim), old[2, :arm], atol=1e-6)
    delivery.arrive(sim, told, 3)
    assert told.calls == 2 and delivery.in_flight is None
    # the new chunk, stamped at its observation (0.1 s), is taken up at its step 2 (0.3 s) ...
    assert np.allclose(arm_reference(sim), new[1, :arm], atol=1e-6)
    # ... a switch of the old chunk's 0.06 rad above the start to the new one's 0.04 below
    assert delivery.jumps() == [pytest.approx(0.10, abs=1e-5)]


def test_rtc_freezes_the_steps_the_delay_runs_of_the_executed_chunk(policy, sim):
    task, seed = round_task(1, HELDOUT_SEED, "touch")
    frozen = 2
    chunks = {}
    for continuity in ("trained", "none"):
        source = PromptedChunks(
            policy, FORMAT, "oracle", 10, Continuity(continuity), DT, frozen * DT
        )
        sim.reset(task, seed)
        source.start(sim, seed)
        first = source.chunk(sim, sim_policy.observe(sim))
        source.published()
        sim_policy.send(sim, first.actions, DT)
        run_frames(sim, frozen)  # the next observation, two frames on
        chunks[continuity] = (first.actions, source.chunk(sim, sim_policy.observe(sim)).actions)
        assert (
            source.continuity is None
            if continuity == "none"
            else source.continuity.mode == ("trained")
        )
    first, second = chunks["trained"]
    # the frozen steps are the executed chunk's steps 2 and 3 (due at 0.3 and 0.4 s) ...
    assert np.allclose(second[:frozen], first[frozen : 2 * frozen], atol=1e-4)
    # ... which a chunk from fresh noise does not reproduce
    plain_first, plain_second = chunks["none"]
    assert np.array_equal(plain_first, first)  # the same noise, no previous chunk yet
    assert not np.allclose(plain_second[:frozen], first[frozen : 2 * frozen], atol=1e-3)


def test_guided_rtc_runs_on_a_checkpoint_trained_for_rtc(policy, sim):
    source = PromptedChunks(policy, FORMAT, "oracle", 10, Continuity("guided"), DT, DT)
    task, seed = round_task(2, HELDOUT_SEED, "touch")
    sim.reset(task, seed)
    source.start(sim, seed)
    assert policy.rtc_training_max_delay > 0 and source.continuity.mode == "identity"
    assert source.continuity.execution_horizon == 0  # the whole overlap


def test_the_rtc_flags_reach_the_engines_continuity(policy, sim):
    """--rtc-guidance-weight and --rtc-execution-horizon set the guided continuity the chunk
    source builds (the node's rtc_max_guidance_weight and rtc_execution_horizon)."""
    args = bench_args(
        "--continuity", "guided", "--rtc-guidance-weight", "2.5", "--rtc-execution-horizon", "3"
    )
    continuity = sim_policy.continuity_of(args)
    assert continuity == Continuity("guided", 2.5, 3)
    source = PromptedChunks(policy, FORMAT, "oracle", 10, continuity, DT, DT)
    sim.reset(*round_task(3, HELDOUT_SEED, "touch"))
    source.start(sim, 0)
    assert source.continuity.execution_horizon == 3
    assert source.continuity.max_guidance_weight == 2.5
    assert Continuity("none").engine_fields() == {"chunk_continuity": "none"}
    with pytest.raises(ValueError, match="continuity must be one of"):
        Continuity("smooth")
    with pytest.raises(ValueError, match="execution horizon must be >= 0"):
        Continuity("guided", execution_horizon=-1)
    bad = bench_args("--rtc-execution-horizon", "-1")
    with pytest.raises(SystemExit, match="--rtc-execution-horizon must be >= 0"):
        sim_policy.check_arguments(bad)


def test_the_delay_mode_runs_episodes_and_reports_the_switches():
    args = bench_args(
        "--subtask", "oracle", "--continuity", "trained", "--delay-steps", "2",
        "--seed", str(HELDOUT_SEED), "--episodes", "2", "--timeout-s", "0.8",
        "--noise-layouts", "0",
    )  # fmt: skip
    result = sim_policy.run(args)
    assert (result["continuity"], result["delay_steps"], result["execute_steps"]) == (
        "trained",
        2,
        2,
    )
    for run in result["runs"]:
        # observations at 0, 0.2, 0.4 and 0.6 s, each chunk arriving 0.2 s later: three arrive
        # before the 0.8 s timeout, two switches
        assert len(run["switch_jumps_rad"]) == 2, run
        assert run["last_second_motion_rad"] >= 0 and np.isfinite(run["jerk_rms"])
    # the first two frozen steps continue the executed chunk: no jump at the switch
    assert result["switch_jump_rad_p95"] < 0.01


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--delay-steps", "2", "--execute-steps", "1"), "--execute-steps"),
        (("--delay-steps", "-1"), "--delay-steps"),
    ],
)
def test_a_delay_no_pipeline_can_run_is_refused(flags, message):
    with pytest.raises(SystemExit, match=message):
        sim_policy.check_arguments(bench_args(*flags))


# Measured with the shipped checkpoint on these 8 layouts, 3 steps late: guided RTC (the shipped
# configs' mode) 5 successes, 1 timeout, 2 wrong cubes; its training-time RTC 2 successes and 5
# timeouts (the arm stops short of the cube behind its own prefix: docs/rtc.md); none 6.
GUIDED_SUCCESSES_AT_LEAST, GUIDED_TIMEOUTS_AT_MOST = 4, 2


def test_the_shipped_checkpoint_behind_a_prefix_reaches_the_cube():
    """Guided RTC three steps late on eight held-out touch layouts: each chunk's first three steps
    are the executed chunk's, and the arm still gets to the cube (no stall behind the prefix)."""
    args = bench_args(
        "--subtask", "oracle", "--continuity", "guided", "--delay-steps", "3",
        "--seed", str(HELDOUT_SEED), "--episodes", "8", "--noise-layouts", "0",
    )  # fmt: skip
    result = sim_policy.run(args)
    statuses = [run["status"] for run in result["runs"]]
    assert result["switch_jump_rad_p95"] < 0.01  # the switch lands on the executed chunk
    assert result["successes"] >= GUIDED_SUCCESSES_AT_LEAST, statuses
    assert result["timeouts"] <= GUIDED_TIMEOUTS_AT_MOST, statuses
