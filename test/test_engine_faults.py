"""Faults inside the engine (issues 11 and 18): an exception at any stage — prefill, action,
admission, decode step, detokenising, a static-shape replay — leaves no KV behind, answers every
request with exactly one final delta, and the next frames act as if nothing happened. Faults are
raised by the real `FaultInjector` at the real call sites, and by whole stage methods replaced with
ones that raise (outside every guard but the engine's boundary); the reference is the same run
without faults."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_checks import check_engine_memory, scaled_policy  # noqa: F401  (autouse: KV invariants after every test)

from oxygen_ros.engine import EngineConfig, OxygenEngine, make_engine
from oxygen_ros.engine.faults import NO_FAULTS, FaultInjector, InjectedFault
from oxygen_ros.engine.language import LanguageDecoder
from oxygen_ros.engine.requests import SamplingParams
from oxygen_ros.engine.static_paths import StaticRunner
from oxygen_ros.engine.types import Observation, TextDelta

FIXED = EngineConfig(decode_mode="fixed", decode_steps_per_frame=2, seed=3, max_active_requests=4)
FRAMES = 7  # one request submitted before each of the first SUBMITTED frames
SUBMITTED = 5
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def policy(tiny_checkpoint):
    return scaled_policy(tiny_checkpoint)


def observation(state_seed: int = 0) -> Observation:
    """One scene for every frame: a request's text then does not depend on which frame admitted it,
    so a request delayed by a failed frame must still produce the reference text."""
    rng = np.random.default_rng(0)
    images = {
        "base_0_rgb": rng.integers(0, 256, (240, 320, 3), dtype=np.uint8),
        "left_wrist_0_rgb": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
    }
    return Observation(
        images, np.random.default_rng(state_seed).uniform(-1, 1, 7), "pick up the red cup"
    )


@dataclasses.dataclass
class Run:
    actions: dict[int, np.ndarray]  # frame index -> robot actions (frames whose act succeeded)
    act_errors: dict[int, BaseException]  # frame index -> what act raised
    deltas: dict[int, list[TextDelta]]  # request id -> every delta it got, close() included
    faults_by_stage: dict[str, int]
    memory_after_close: dict[str, int]

    def text(self, request_id: int) -> str:
        return "".join(d.text for d in self.deltas[request_id])

    def final(self, request_id: int) -> TextDelta:
        return self.deltas[request_id][-1]


def run(
    policy, config: EngineConfig, faults: FaultInjector = NO_FAULTS, frames: int = FRAMES
) -> Run:
    """Drive act + decode like the node does (a failed act is caught, decode still runs); check
    the pool's invariants after every frame; finish with a long decode and close()."""
    engine = OxygenEngine(policy, config, faults=faults)
    out = Run({}, {}, {}, {}, {})

    def collect(deltas: list[TextDelta]) -> None:
        for d in deltas:
            out.deltas.setdefault(d.request_id, []).append(d)

    submitted: list[int] = []
    for f in range(frames):
        if f < SUBMITTED:
            submitted.append(
                engine.submit("narration", sampling=SamplingParams(max_tokens=MAX_TOKENS))
            )
        try:
            out.actions[f] = engine.act(observation()).actions
        except InjectedFault as error:
            out.act_errors[f] = error
        collect(engine.decode())
        engine.check_memory()
    collect(engine.decode(max_steps=50))
    collect(engine.close())
    out.faults_by_stage = dict(engine.faults_by_stage)
    out.memory_after_close = engine.memory()
    assert sorted(out.deltas) == submitted
    return out


@pytest.fixture(scope="module")
def reference(policy) -> Run:
    return run(policy, FIXED)


def check_recovered(
    faulted: Run, reference: Run, stage: str, injector: FaultInjector, atol: float = 1e-5
) -> list[int]:
    """The common outcome of any injected fault; returns the ids of the requests that failed."""
    assert injector.total_raised >= 1, "the schedule never fired: the test would prove nothing"
    return check_outcome(
        faulted,
        reference,
        {stage: injector.raised[stage]},
        f"InjectedFault: injected fault in {stage} (call ",
        atol,
    )


def check_outcome(
    faulted: Run, reference: Run, faults: dict[str, int], detail: str, atol: float = 1e-5
) -> list[int]:
    """The common outcome of any fault: KV all back, the faults counted by stage as ``faults``,
    one final per request (its last delta), failed requests cut short (their detail starting with
    ``detail``) and the others served exactly as without the fault, every successful frame's
    actions as the reference's. Returns the ids of the requests that failed."""
    assert (
        faulted.memory_after_close["bytes_in_use"] == 0
        and faulted.memory_after_close["live_segments"] == 0
    )
    assert faulted.faults_by_stage == faults
    for request_id, deltas in faulted.deltas.items():
        assert [d.final for d in deltas].count(True) == 1 and deltas[-1].final, (
            f"request {request_id}: {deltas}"
        )
    failed = [r for r in faulted.deltas if faulted.final(r).finish_reason == "failed"]
    for request_id in faulted.deltas:
        final = faulted.final(request_id)
        if request_id in failed:
            assert final.detail.startswith(detail), final.detail
            # cut short, never wrong
            assert reference.text(request_id).startswith(faulted.text(request_id))
        else:  # untouched requests are served exactly as without the fault
            assert faulted.text(request_id) == reference.text(request_id), request_id
            assert final.finish_reason == reference.final(request_id).finish_reason
    # Every frame whose act succeeded gives the reference's actions (same frame id, same noise).
    assert set(faulted.actions) | set(faulted.act_errors) == set(range(FRAMES))
    for f, actions in faulted.actions.items():
        np.testing.assert_allclose(
            actions, reference.actions[f], atol=atol, rtol=1e-5, err_msg=f"frame {f}"
        )
    return failed


def test_reference_run_is_meaningful(reference):
    assert len(reference.deltas) == SUBMITTED and not reference.act_errors
    assert all(reference.final(r).finish_reason in ("length", "eos") for r in reference.deltas)
    assert len({reference.text(r) for r in reference.deltas}) >= 1 and any(
        reference.text(r) for r in reference.deltas
    )


@pytest.mark.parametrize("stage", ["prefill", "action"])
def test_a_fault_in_the_action_path_returns_the_frames_kv_and_reraises(policy, reference, stage):
    injector = FaultInjector(at={stage: {3}})  # frame index 2
    faulted = run(policy, FIXED, injector)
    assert list(faulted.act_errors) == [2]
    error = faulted.act_errors[2]
    # the original exception
    assert isinstance(error, InjectedFault) and error.stage == stage and error.call == 3
    failed = check_recovered(faulted, reference, stage, injector)
    # requests never see an action-path fault: the one due at frame 2 waits a frame
    assert failed == []


@pytest.mark.parametrize(
    "stage, expected_failed",
    [
        ("admission", [2]),  # the 2nd admission call attaches the request submitted before frame 1
        ("detokenise", None),  # one request, whichever accepted the 3rd token
        ("decode_step", None),  # every request of the 3rd batched step
    ],
)
def test_a_fault_in_a_language_stage_fails_only_the_requests_it_hit(
    policy, reference, stage, expected_failed
):
    injector = FaultInjector(at={stage: {3}} if stage != "admission" else {stage: {2}})
    faulted = run(policy, FIXED, injector)
    assert not faulted.act_errors
    failed = check_recovered(faulted, reference, stage, injector)
    if expected_failed is not None:
        assert failed == expected_failed
    elif stage == "detokenise":
        assert len(failed) == 1
    else:
        assert len(failed) >= 1
    assert len(failed) < SUBMITTED  # the others went on


def test_graph_replay_faults_on_the_static_path(policy, reference):
    """Every 5th fixed-shape replay fails — it lands in prefills, action chunks, admissions and
    decode steps alike; the eager reference is matched within the static-vs-eager tolerance."""
    injector = FaultInjector(every={"graph_replay": 5})
    faulted = run(policy, dataclasses.replace(FIXED, static_shapes=True), injector)
    assert injector.raised["graph_replay"] >= 4
    assert all(e.stage == "graph_replay" for e in faulted.act_errors.values())
    failed = check_recovered(faulted, reference, "graph_replay", injector, atol=2e-4)
    assert failed or faulted.act_errors


def test_a_real_error_in_the_prefill_is_counted_and_the_previous_frame_stays_alive(policy):
    engine = OxygenEngine(policy, FIXED)
    engine.act(observation())
    rid = engine.submit("narration", sampling=SamplingParams(max_tokens=20))
    engine.decode(max_steps=1)  # admitted onto frame 1, reads its prefix
    prefix = engine._active[0].prefix
    bad = dataclasses.replace(observation(), state=np.full(7, np.nan))
    with pytest.raises(ValueError, match="non-finite"):
        engine.act(bad)
    assert engine.faults_by_stage == {"prefill": 1}
    assert prefix.ref_count == 1  # the engine let go of frame 1; the request still reads it
    engine.check_memory()
    deltas = engine.decode(max_steps=3)  # the request goes on over frame 1's prefix
    assert deltas and {d.request_id for d in deltas} == {rid}
    assert engine.act(observation()).actions.shape == (policy.config.action_horizon, 7)
    finals = [d for d in deltas + engine.close() if d.final]
    assert (
        len(finals) == 1
        and finals[0].request_id == rid
        and finals[0].finish_reason in ("cancelled", "eos")
    )
    assert engine.memory()["bytes_in_use"] == 0 and engine.memory()["live_segments"] == 0


def test_repeated_faults_do_not_accumulate_leaks(policy):
    injector = FaultInjector(
        every={"prefill": 7, "action": 9, "admission": 4, "decode_step": 5, "detokenise": 11}
    )
    config = dataclasses.replace(FIXED, max_active_requests=6)
    engine = OxygenEngine(policy, config, faults=injector)
    finals: dict[int, int] = {}
    submitted: list[int] = []
    act_failures = 0
    for f in range(50):
        submitted.append(engine.submit("narration", sampling=SamplingParams(max_tokens=MAX_TOKENS)))
        try:
            engine.act(observation(f))
        except InjectedFault:
            act_failures += 1
        for d in engine.decode():
            finals[d.request_id] = finals.get(d.request_id, 0) + d.final
        engine.check_memory()
    while engine.active_requests or engine.queued_requests:
        for d in engine.decode(max_steps=10):
            finals[d.request_id] = finals.get(d.request_id, 0) + d.final
    assert (
        injector.total_raised >= 20
        and act_failures == injector.raised["prefill"] + injector.raised["action"]
    )
    assert engine.faults_by_stage == injector.raised
    assert all(finals.get(r) == 1 for r in submitted), {
        r: finals.get(r) for r in submitted if finals.get(r) != 1
    }
    live = engine.memory()
    frame = engine._frame
    if frame is None:  # the last act failed: nothing at all is left
        assert live["bytes_in_use"] == 0 and live["live_segments"] == 0
    else:  # only the newest frame's prefix
        assert live["live_segments"] == 1 and live["bytes_in_use"] == engine.pool.segment_bytes(
            frame.segment
        )
    assert engine.close() == []
    assert engine.memory()["bytes_in_use"] == 0


def test_close_answers_every_request_still_queued_or_active(policy):
    engine = OxygenEngine(policy, dataclasses.replace(FIXED, max_active_requests=1))
    ids = [engine.submit("narration", sampling=SamplingParams(max_tokens=30)) for _ in range(3)]
    engine.act(observation())
    first = engine.decode(max_steps=1)
    assert {d.request_id for d in first} == {ids[0]} and engine.queued_requests == 2
    finals = engine.close()
    assert sorted((d.request_id, d.finish_reason, d.final) for d in finals) == [
        (i, "cancelled", True) for i in ids
    ]
    assert engine.close() == []  # idempotent, nothing answered twice


# -- whole stages that raise (issue 18) ---------------------------------------------------------
# The injector's hooks sit inside each stage's own guards. These tests replace whole stage methods
# with ones that raise (a bug, or a CUDA error in code those guards do not cover), so only the
# engine's boundary (`EngineBase._serve`) stands between the fault and the caller.


class StageBroke(RuntimeError):
    """What a replaced stage raises."""


def break_stage(monkeypatch, owner: type, name: str, calls: set[int], after: bool = False) -> dict:
    """Replace ``owner.name`` by a method that raises :class:`StageBroke` on the given 1-based
    calls: before the real method runs, or (``after``) once it has done its work, so that whatever
    it produced (deltas, finished requests, written KV) is lost with it. Returns a live count
    ``{"calls": n, "raised": n}``."""
    real = getattr(owner, name)
    seen = {"calls": 0, "raised": 0}

    def broken(self, *args, **kwargs):
        seen["calls"] += 1
        call = seen["calls"]
        if call in calls and not after:
            seen["raised"] += 1
            raise StageBroke(f"{owner.__name__}.{name} broke (call {call})")
        result = real(self, *args, **kwargs)
        if call in calls:
            seen["raised"] += 1
            raise StageBroke(f"{owner.__name__}.{name} broke after its work (call {call})")
        return result

    monkeypatch.setattr(owner, name, broken)
    return seen


# (owner, method, calls that raise, after its work, static shapes, stages it may be counted under)
WHOLE_STAGES = {
    "decoder step": (LanguageDecoder, "step", {3}, False, False, ("decode_step",)),
    "decoder step, after its work": (LanguageDecoder, "step", {3}, True, False, ("decode_step",)),
    "admission": (LanguageDecoder, "attach", {2}, False, False, ("admission",)),
    "admission, after its work": (LanguageDecoder, "attach", {2}, True, False, ("admission",)),
    "detokenising a whole batch": (
        LanguageDecoder,
        "_accept",
        {4},
        False,
        False,
        ("admission", "decode_step"),
    ),
    "retiring finished requests": (
        OxygenEngine,
        "_retire_finished",
        {4},
        False,
        False,
        ("admission", "decode_step", "scheduler"),
    ),
    "stall check": (OxygenEngine, "_finish_stalled", {2}, False, False, ("scheduler",)),
    "static text step": (StaticRunner, "text", {3}, False, True, ("admission", "decode_step")),
    "decoder step, static path": (LanguageDecoder, "step", {2}, True, True, ("decode_step",)),
}


@pytest.mark.parametrize("case", list(WHOLE_STAGES))
def test_a_whole_language_stage_that_raises_never_escapes_decode(
    policy, reference, monkeypatch, case
):
    owner, name, calls, after, static, stages = WHOLE_STAGES[case]
    broke = break_stage(monkeypatch, owner, name, calls, after)
    config = dataclasses.replace(FIXED, static_shapes=static)
    faulted = run(policy, config)  # decode() never raises here, or run() would
    assert broke["raised"] == 1, "the stage never broke: the test would prove nothing"
    (stage,) = faulted.faults_by_stage  # counted once, under the stage that raised
    assert stage in stages
    assert not faulted.act_errors  # the action path never saw the fault
    failed = check_outcome(
        faulted,
        reference,
        {stage: 1},
        f"StageBroke: {owner.__name__}.{name} broke",
        atol=2e-4 if static else 1e-5,
    )
    assert 1 <= len(failed) < SUBMITTED  # the requests of the stage that raised, not the others


def test_deltas_made_earlier_in_the_call_are_returned(policy, monkeypatch):
    """A decode call whose second step raises as a whole still returns its first step's deltas;
    the step's requests then end with one failed final each and their KV is back."""
    engine = OxygenEngine(policy, FIXED)
    ids = [engine.submit("narration", sampling=SamplingParams(max_tokens=20)) for _ in range(3)]
    engine.act(observation())
    first = engine.decode(max_steps=1)  # admission (token 1) and one step (token 2)
    assert [d.token_count for d in first] == [1, 1, 1, 2, 2, 2] and not any(d.final for d in first)
    break_stage(monkeypatch, LanguageDecoder, "step", {2})
    deltas = engine.decode(max_steps=3)
    assert [(d.request_id, d.token_count, d.final) for d in deltas] == [
        *[(r, 3, False) for r in ids],  # the first step of the call: not lost
        *[(r, 3, True) for r in ids],  # then the step that raised: failed finals
    ]
    assert {d.finish_reason for d in deltas if d.final} == {"failed"}
    assert engine.faults_by_stage == {"decode_step": 1}
    assert engine.active_requests == 0 and engine.memory()["live_segments"] == 1  # the frame only
    engine.check_memory()
    assert engine.close() == []


def test_a_queue_the_admission_can_never_take_still_drains(policy, monkeypatch):
    """With every admission raising before it takes anything, queued requests are not left
    waiting forever: they are refused after max_wait_frames like any request that cannot be
    admitted."""
    config = dataclasses.replace(FIXED, max_wait_frames=2)
    engine = OxygenEngine(policy, config)

    def admission_down(self, until, out):
        raise StageBroke("admission is down")

    monkeypatch.setattr(OxygenEngine, "_admit", admission_down)
    rid = engine.submit("narration", sampling=SamplingParams(max_tokens=4))
    finals = []
    for _ in range(4):
        engine.act(observation())
        finals += [d for d in engine.decode() if d.final]
    assert [(d.request_id, d.finish_reason) for d in finals] == [(rid, "refused")]
    assert engine.faults_by_stage == {"admission": 4}
    assert engine.queued_requests == 0


@pytest.mark.parametrize("after", [False, True], ids=["before-its-work", "after-its-work"])
@pytest.mark.parametrize("name", ["isolated-sequential", "shared-kv", "naive-parallel"])
def test_a_baseline_step_survives_a_request_that_raises_as_a_whole(
    policy, monkeypatch, name, after
):
    """The baselines decode each request to completion inside the frame (or the language worker):
    one whose decoding raises as a whole fails alone (or, when it raised after its final delta was
    handed over, keeps that final and gets no second one); the frame still acts and all KV goes
    back."""
    broke = break_stage(monkeypatch, LanguageDecoder, "run_to_completion", {2}, after)
    engine = make_engine(name, policy, FIXED)
    ids = [engine.submit("narration", sampling=SamplingParams(max_tokens=3)) for _ in range(3)]
    deltas = []
    for _ in range(2):
        result = engine.step(observation())
        assert result.action is not None
        deltas += result.deltas
    if name == "naive-parallel":
        deltas += engine.drain()
    deltas += engine.close()
    finals = {d.request_id: d for d in deltas if d.final}
    assert sorted(finals) == ids and sum(d.final for d in deltas) == len(ids)
    failed = [r for r in ids if finals[r].finish_reason == "failed"]
    if after:
        assert failed == [] and finals[ids[1]].finish_reason in ("eos", "length")
    else:
        assert failed == [ids[1]]
        assert finals[ids[1]].detail.startswith("StageBroke: LanguageDecoder.run_to_completion")
    assert broke["raised"] == 1 and engine.faults_by_stage == {"decode_step": 1}
    assert engine.memory()["bytes_in_use"] == 0
