"""The subtask loop: the conditioned prefill equals appending the subtask to the shared KV, the
subtask decodes exactly as the published format's greedy decode, a chunk carries a subtask only
from the frame after it finished, a changed task restarts it, and formats that need state bins
refuse robots without them."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from engine_checks import check_engine_memory, scaled_policy  # noqa: F401  (autouse: KV invariants after every test)

from oxygen_ros.engine import EngineConfig, OxygenEngine
from oxygen_ros.engine.base import make_pool
from oxygen_ros.engine.frames import act_on_frame, frame_noise, prefill_frame
from oxygen_ros.engine.kv_cache import KVPool
from oxygen_ros.engine.requests import LanguageRequest, SamplingParams
from oxygen_ros.engine.static_paths import StaticRunner
from oxygen_ros.engine.subtasks import HeldGate, PhaseOrder, SubtaskLoop
from oxygen_ros.engine.types import Observation
from oxygen_ros.model.mot import KVContext
from oxygen_ros.model.pi05 import Prefix
from oxygen_ros.policy_io.policy import load_policy
from oxygen_ros.policy_io.prompts import FramePrompt, PromptFormatError, SubtaskText, preset


@pytest.fixture(scope="module")
def policy(tiny_checkpoint):
    return scaled_policy(tiny_checkpoint)


def observation(i: int, task: str = "pick up the red cup") -> Observation:
    rng = np.random.default_rng(i)
    images = {
        "base_0_rgb": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
        "left_wrist_0_rgb": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8),
    }
    return Observation(images, rng.uniform(-1, 1, 7), task, stamp=float(i))


class FakeClock:
    """Advances only when told: every decision of the engine is deterministic."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pool_for(policy) -> KVPool:
    cfg = policy.config.backbone
    return KVPool(cfg.depth, cfg.num_kv_heads, cfg.head_dim, 4096, 16)


def kv_append_chunk(policy, obs, prompt: FramePrompt, noise) -> torch.Tensor:
    """The KV-append formulation (BrunoFANG, OpenTau): prefill the shared head, then run the
    subtask tail as text tokens over its KV (positions continuing) and act on both."""
    pool = pool_for(policy)
    causal = prompt.causal_from if prompt.causal_from < prompt.shared else None  # brunofang's
    head = FramePrompt(prompt.ids[: prompt.shared], prompt.shared, causal)
    frame = prefill_frame(policy, pool, obs, 1, prompt=head)
    context = pool.view(frame.segment)
    n = frame.length
    tail = prompt.ids[prompt.shared :]
    out = policy.model.forward_text(
        context, torch.tensor([list(tail)]), (n + torch.arange(len(tail)))[None]
    )
    keys = [torch.cat([k, new], dim=1) for k, new in zip(context.keys, out.keys, strict=True)]
    values = [torch.cat([v, new], dim=1) for v, new in zip(context.values, out.values, strict=True)]
    valid = torch.ones(1, n + len(tail), dtype=torch.bool)
    prefix = Prefix(KVContext(keys, values, valid), torch.tensor([n + len(tail)]))
    actions = policy.model.sample_actions(prefix, noise, 10)[0]
    pool.release(frame.segment)
    return actions


@pytest.mark.parametrize("name", ["openpi_subtask", "opentau", "brunofang"])
def test_the_conditioned_prefill_equals_kv_append_and_the_uncached_reference(policy, name):
    """The frame's one prefill of a subtask-conditioned prompt (head unmasked, causal tail), on the
    eager and the static path, equals appending the subtask's tokens to the shared prefix's KV
    and openpi's one pass over everything."""
    fmt = preset(name)
    obs = observation(1)
    subtask = SubtaskText(tuple(policy.tokenizer.encode_text("grasp the cup")), "grasp the cup", 1)
    prompt = policy.frame_prompt(obs.state, obs.prompt, fmt, True, subtask)
    assert prompt.causal_from is not None
    pool = make_pool(policy, EngineConfig(static_shapes=True))
    runner = StaticRunner(policy, pool)
    noise = frame_noise(policy.config, 0, 1, policy.device)
    chunks = {}
    for path, static in (("eager", None), ("static", runner)):
        frame = prefill_frame(policy, pool, obs, 1, static, prompt=prompt)
        assert frame.length == 2 * policy.config.image_tokens + len(prompt.ids)
        chunks[path] = act_on_frame(policy, pool, frame, noise, 10, static)
        pool.release(frame.segment)
    assert runner.num_paths == 2 and runner.fallbacks == 0  # the static path ran the causal tail
    chunks["kv_append"] = kv_append_chunk(policy, obs, prompt, noise)
    inputs = policy.encode(obs.images, obs.state, obs.prompt, prompt)
    reference = policy.model.sample_actions_uncached(
        inputs.images,
        inputs.image_masks,
        inputs.tokens,
        inputs.token_masks,
        noise[None] if noise.dim() == 2 else noise,
        10,
        inputs.token_causal,
    )[0]
    torch.testing.assert_close(chunks["eager"], chunks["kv_append"], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(chunks["static"], chunks["eager"], atol=2e-5, rtol=1e-4)
    # one pass over everything (openpi's masks) vs cached: the scaled weights amplify rounding
    torch.testing.assert_close(chunks["eager"], reference, atol=5e-4, rtol=1e-3)
    # the causal tail matters: a bidirectional prompt with the same ids gives another chunk
    inputs_bi = policy.encode(
        obs.images, obs.state, obs.prompt, prompt.__class__(prompt.ids, len(prompt.ids))
    )
    other = policy.model.sample_actions_uncached(
        inputs_bi.images, inputs_bi.image_masks, inputs_bi.tokens, inputs_bi.token_masks, noise, 10
    )[0]
    assert (other - reference).abs().max() > 1e-2


def greedy_reference(policy, obs, prompt_ids, steps: int) -> list[int]:
    """The published way: the shared prompt prefilled bidirectionally, then greedy tokens decoded
    causally on top of it, every logit recomputed from scratch (openpi's masks)."""
    inputs = policy.encode(obs.images, obs.state, obs.prompt)
    tokens = torch.tensor([list(prompt_ids)])
    generated: list[int] = []
    for _ in range(steps):
        text = torch.tensor([generated], dtype=torch.int64)
        logits = policy.model.text_logits_uncached(
            inputs.images,
            inputs.image_masks,
            tokens,
            torch.ones_like(tokens, dtype=torch.bool),
            text,
        )
        generated.append(int(logits[0, -1, : policy.tokenizer.vocab_size].argmax()))
    return generated


def hierarchy_engine(policy, mode="same_frame", name="openpi_subtask", clock=None, **overrides):
    settings = {
        "decode_mode": "fixed",
        "decode_steps_per_frame": 2,
        "prompt_format": name,
        "subtask_conditioning": mode,
        "subtask_period_s": 0.0,
        "subtask_max_tokens": 5,
    }
    config = EngineConfig(**(settings | overrides))
    return OxygenEngine(policy, config, clock=clock or FakeClock())


def run(engine, frames, task="pick up the red cup", start=0):
    results = []
    for f in range(start, start + frames):
        results.append(engine.step(observation(f, task)))
    return results


def test_subtask_decodes_exactly_as_the_published_greedy_decode(policy):
    engine = hierarchy_engine(policy)
    try:
        results = run(engine, 4)
        finals = [d for r in results for d in r.deltas if d.kind == "subtask" and d.final]
        assert finals and finals[0].finish_reason in ("eos", "length")
        subtask = engine.subtasks.current
        assert subtask.frame_id == 1
    finally:
        engine.close()
    obs = observation(0)
    shared = policy.frame_prompt(obs.state, obs.prompt, preset("openpi_subtask"), True)
    ids = shared.ids[: shared.shared]  # "<bos>Task: ..., State: ...;\nSubtask: "
    reference = greedy_reference(policy, obs, ids, len(subtask.text.ids) + 1)
    eos = policy.tokenizer.eos_id
    expected = reference[: reference.index(eos)] if eos in reference else reference[:5]
    assert list(subtask.text.ids) == expected[:5]


def test_the_action_changes_to_the_subtask_on_the_frame_after_it_finished(policy):
    engine = hierarchy_engine(policy)
    try:
        results = run(engine, 6)
    finally:
        engine.close()
    finished = [
        i
        for i, r in enumerate(results)
        if any(
            d.kind == "subtask" and d.final and d.finish_reason in ("eos", "length")
            for d in r.deltas
        )
    ]
    assert finished, "the subtask must finish within 6 frames (5 tokens, 2 steps per frame)"
    first = finished[0]
    ids = [r.action.subtask_id for r in results]
    assert ids[: first + 1] == [0] * (first + 1)  # not before, not in the frame it finished in
    assert all(i == 1 for i in ids[first + 1 :])  # every chunk after it is conditioned
    assert results[first + 1].action.subtask == engine.subtasks.current.text.text
    # the conditioned chunk is not the one the same frame gives with an empty subtask
    obs = observation(first + 1)
    empty = policy.frame_prompt(obs.state, obs.prompt, preset("openpi_subtask"), True)
    pool = pool_for(policy)
    frame = prefill_frame(policy, pool, obs, first + 2, prompt=empty)
    noise = frame_noise(policy.config, 0, first + 2, policy.device)
    unconditioned = policy.robot_actions(act_on_frame(policy, pool, frame, noise, 10), obs.state)
    pool.release(frame.segment)
    assert np.abs(unconditioned - results[first + 1].action.actions).max() > 1e-3


def test_prompt_and_same_frame_engines_act_alike(policy):
    chunks = {}
    for mode in ("prompt", "same_frame"):
        engine = hierarchy_engine(policy, mode)
        try:
            results = run(engine, 6)
            chunks[mode] = [(r.action.subtask_id, r.action.actions) for r in results]
        finally:
            engine.close()
    for (id_a, a), (id_b, b) in zip(chunks["prompt"], chunks["same_frame"], strict=True):
        assert id_a == id_b
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)  # robot units: rounding scaled


def test_a_subtask_waits_for_slack_and_never_delays_a_chunk(policy):
    clock = FakeClock()
    engine = hierarchy_engine(policy, clock=clock, decode_mode="deadline")
    try:
        for f in range(3):
            chunk = engine.act(observation(f))
            assert chunk.frame_id == f + 1 and chunk.subtask_id == 0
            assert engine.decode(until=clock.now) == []  # no slack at all: nothing runs
        assert engine.queued_requests == 1 and engine.active_requests == 0
        deltas = engine.decode(until=clock.now + 10.0)  # slack: admitted and decoded
        assert any(d.kind == "subtask" for d in deltas)
    finally:
        engine.close()


def test_a_new_task_restarts_the_subtask(policy):
    clock = FakeClock()
    engine = hierarchy_engine(policy, clock=clock)
    try:
        run(engine, 6)
        assert engine.subtasks.current is not None and engine.subtasks.refreshes == 1
        results = run(engine, 2, task="open the drawer", start=6)
        assert results[0].action.subtask_id == 0  # never the old task's subtask
        restarted = engine.subtasks.in_flight or engine.subtasks.current
        assert restarted is not None and engine.subtasks.task == "open the drawer"
        requests = [d for r in results for d in r.deltas if d.kind == "subtask"]
        assert requests and all(d.request_id > 1 for d in requests)
    finally:
        engine.close()


def test_subtask_period_refreshes(policy):
    clock = FakeClock()
    engine = hierarchy_engine(policy, clock=clock, subtask_period_s=1.0)
    try:
        for f in range(12):
            clock.now = f * 0.5
            engine.step(observation(f))
        assert engine.subtasks.refreshes >= 3
        assert (
            sum(engine.subtasks.chunks_by_subtask.values()) + engine.subtasks.unconditioned_chunks
            == 12
        )
    finally:
        engine.close()


def test_formats_refuse_modes_they_cannot_serve(policy):
    with pytest.raises(PromptFormatError, match="re-prefills"):
        EngineConfig(prompt_format="pi052", subtask_conditioning="same_frame")
    with pytest.raises(PromptFormatError, match="has none"):
        EngineConfig(prompt_format="openpi", subtask_conditioning="prompt")
    with pytest.raises(PromptFormatError, match="unknown prompt format"):
        EngineConfig(prompt_format="openpi_v2")
    engine = hierarchy_engine(policy)
    try:
        with pytest.raises(ValueError, match="unknown language kind 'subtask'"):
            OxygenEngine(policy, EngineConfig(prompt_format="openpi_subtask")).submit("subtask")
    finally:
        engine.close()


def test_state_bin_formats_refuse_a_robot_without_them(tiny_checkpoint):
    libero = load_policy(tiny_checkpoint, robot="libero")
    with pytest.raises(PromptFormatError, match="without state bins.*libero"):
        OxygenEngine(libero, EngineConfig(prompt_format="pi052", subtask_conditioning="prompt"))
    with pytest.raises(PromptFormatError, match="without state bins"):
        OxygenEngine(libero, EngineConfig(prompt_format="opentau"))
    engine = OxygenEngine(
        libero, EngineConfig(prompt_format="openpi_subtask", subtask_conditioning="same_frame")
    )
    engine.close()  # #942 has a state-free prompt


def finished_request(policy, request_id: int, text: str) -> LanguageRequest:
    request = LanguageRequest(
        request_id, "subtask", [], SamplingParams(max_tokens=20), policy.tokenizer
    )
    request.frame_id = 1
    for token in policy.tokenizer.encode_text(text):
        request.accept(token)
    request.finish("eos")
    return request


def subtask_decoder(policy, loop: SubtaskLoop):
    """A function that finishes one subtask request with ``text`` at ``now`` (and the gripper in
    ``state``, when given) and returns the subtask conditioning the next frame."""
    ids = itertools.count(1)

    def decode(text: str, now: float, state: np.ndarray | None = None) -> str:
        if state is not None:
            loop.observe_state(state)
        request = finished_request(policy, next(ids), text)
        loop.submitted(request, now - 0.1)
        loop.finished([request.finish("eos")], now)
        return loop.conditioning().text

    return decode


def test_pi052_memory_note_when_the_subtask_changes_chained_with_the_previous(policy):
    loop = SubtaskLoop(preset("pi052"), period_s=1.0)
    loop.observe_task("tidy up")

    def finish(request, now):
        loop.submitted(request, now - 0.1)
        return loop.finished([request.finish("eos")], now)

    assert finish(finished_request(policy, 1, "open the drawer"), 1.0) is None  # the first
    assert finish(finished_request(policy, 2, "open the drawer"), 2.0) is None  # unchanged
    fields = finish(finished_request(policy, 3, "put the cup in"), 3.0)
    assert fields == {"task": "tidy up", "memory": "", "previous": "open the drawer"}
    note = finished_request(policy, 4, "drawer open")
    note.kind = "memory"
    loop.memory_submitted(note)
    loop.finished([note.finish("eos")], 3.5)
    assert loop.memory_note == "drawer open"
    fields = finish(finished_request(policy, 5, "close the drawer"), 4.0)
    assert fields == {"task": "tidy up", "memory": "drawer open", "previous": "put the cup in"}
    assert loop.refreshes == 4 and loop.current.text.subtask_id == 3


def test_a_subtask_is_capped_to_what_the_prompt_leaves_of_max_token_len(policy):
    """The cap is what the prompt leaves with the longest state text: any later frame's prompt
    carries the whole subtask, whatever its state (a cap from this frame's state alone left a
    longer state text one token short, and the task was shortened)."""
    engine = hierarchy_engine(policy, subtask_max_tokens=4096)
    try:
        obs = observation(0)
        engine.step(obs)
        request = engine.subtasks.in_flight
        fmt = preset("openpi_subtask")
        longest = policy.longest_prompt(obs.prompt, len(obs.state), fmt, True)
        assert request.sampling.max_tokens == policy.config.max_token_len - longest > 0
        tokens = tuple(range(300, 300 + request.sampling.max_tokens))
        for state in (obs.state, -obs.state, np.full(7, 0.999), np.full(7, -0.999)):
            conditioned = policy.frame_prompt(
                state, obs.prompt, fmt, True, SubtaskText(tokens, "x", 1)
            )
            assert len(conditioned.ids) <= policy.config.max_token_len
    finally:
        engine.close()


def test_a_subtask_without_words_is_counted(policy):
    """An untrained model can finish a subtask of spaces (~/subtask then says ''): diagnostics
    count it as subtasks_empty."""
    loop = SubtaskLoop(preset("openpi_subtask"), period_s=0.0)
    loop.observe_task("tidy up")
    blank = finished_request(policy, 1, "   ")
    assert blank.tokens, "the tokenizer must give the spaces tokens"
    loop.submitted(blank, 0.0)
    loop.finished([blank.finish("eos")], 1.0)
    assert loop.current.text.text == "" and loop.empty_subtasks == 1 and loop.refreshes == 1
    worded = finished_request(policy, 2, "open the drawer")
    loop.submitted(worded, 2.0)
    loop.finished([worded.finish("eos")], 3.0)
    assert loop.stats(3.0)["subtasks_empty"] == 1 and loop.refreshes == 2


def test_questions_use_the_formats_question_turn(policy):
    engine = OxygenEngine(policy, EngineConfig(prompt_format="pi052"))
    try:
        engine.submit("answer", "where is the cup?")
        (request,) = list(engine._queue)
        assert request.prompt == policy.tokenizer.encode_text("User: where is the cup?\nAssistant:")
        assert request.sampling.max_tokens <= 128 and not request.reads_shared
    finally:
        engine.close()


@pytest.mark.parametrize("path", ["dynamic", "static"])
def test_bench_hierarchy_writes_every_mode(tmp_path, path):
    from oxygen_ros.tools import bench

    out = tmp_path / "hierarchy.json"
    args = ["hierarchy", "--frames", "6", "--warmup", "1", "--steps", "2"]
    if path == "static":  # every mode's warm-up captures what its frames use
        args.append("--static-shapes")
    # 12 tokens: a conditioned prompt outgrows the unconditioned one's prompt bucket
    assert bench.main([*args, "--subtask-tokens", "12", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    modes = result["modes"]
    assert set(modes) == {"none", "per_call", "oxygen"}
    assert all(mode["frames_per_s"] > 0 for mode in modes.values())
    assert modes["per_call"]["subtasks"] == 6 and modes["none"]["subtasks"] == 0
    assert modes["per_call"]["mean_subtask_tokens"] <= 12
    assert all(mode["static_fallbacks"] == 0 for mode in modes.values())
    if modes["oxygen"]["subtasks"]:
        assert modes["oxygen"]["conditioned_after_first"] == 1.0


def test_the_static_paths_run_the_subtask_loop_as_the_eager_ones(policy):
    runs = {}
    for static in (False, True):
        engine = hierarchy_engine(policy, static_shapes=static)
        try:
            if static:  # captures every prompt bucket a conditioned prompt may need, then freezes
                engine.warm_up(observation(0))
            results = run(engine, 6)
            runs[static] = (
                [(r.action.subtask_id, r.action.actions) for r in results],
                engine.subtasks.current.text.ids,
            )
            if static:
                assert engine.runner.frozen and engine.captures_during_frames == 0
                assert engine.static_fallbacks == 0
        finally:
            engine.close()
    assert runs[True][1] == runs[False][1]  # the same subtask tokens
    for (id_a, a), (id_b, b) in zip(runs[False][0], runs[True][0], strict=True):
        assert id_a == id_b
        # padded prompt buckets reorder the sums; the scaled weights and robot units amplify it
        np.testing.assert_allclose(a, b, atol=5e-4, rtol=1e-4)


def test_a_changed_subtask_conditions_the_chunks_only_once_decoded_k_times_in_a_row(policy):
    loop = SubtaskLoop(preset("openpi_subtask"), period_s=1.0, confirmations=2)
    loop.observe_task("put the red cube on the green pad")
    decode = subtask_decoder(policy, loop)

    reach, grasp = "reach the red cube, far left", "grasp the red cube"
    assert decode(reach, 1.0) == reach  # the task's first: at once
    assert decode(grasp, 2.0) == reach  # a change decoded once is held back ...
    assert loop.latest.text.text == grasp and loop.changes_held == 1
    assert decode(reach, 3.0) == reach  # ... and forgotten when the decode flickers back
    assert decode(grasp, 4.0) == reach
    assert decode(grasp, 5.0) == grasp  # twice in a row: adopted, a new subtask id
    assert loop.current.text.subtask_id == 2 and loop.changes_held == 2
    assert loop.stats(5.0)["subtask_changes_held"] == 2
    # one confirmation: every decoded change at once, as before
    eager = SubtaskLoop(preset("openpi_subtask"), period_s=1.0)
    eager.observe_task("put the red cube on the green pad")
    eager_decode = subtask_decoder(policy, eager)
    assert eager_decode(reach, 1.0) == reach and eager_decode(grasp, 2.0) == grasp
    assert eager.changes_held == 0
    with pytest.raises(ValueError, match="confirmations"):
        SubtaskLoop(preset("openpi_subtask"), period_s=1.0, confirmations=0)


def test_a_held_objects_subtask_waits_for_the_gripper_to_hold(policy):
    gate = HeldGate(r"^(carry|release) ", dims=(5,), low=0.25, high=0.8)
    loop = SubtaskLoop(preset("openpi_subtask"), period_s=1.0, confirmations=2, held_gate=gate)
    loop.observe_task("put the red cube on the green pad")
    decode = subtask_decoder(policy, loop)
    open_hand, holding = np.zeros(6), np.array([0, 0, 0, 0, 0, 0.5])
    closed_on_nothing = np.array([0, 0, 0, 0, 0, 1.0])

    reach, carry = "reach the red cube, far left", "carry the red cube to the green pad, far right"
    assert decode(reach, 1.0, open_hand) == reach
    assert decode(carry, 2.0, open_hand) == reach  # once: not confirmed
    assert decode(carry, 3.0, open_hand) == reach  # confirmed, but nothing is held yet
    assert decode(carry, 3.5, closed_on_nothing) == reach  # the fingers met: nothing between
    assert (loop.changes_held, loop.changes_gated) == (1, 2)
    assert loop.stats(3.5)["subtask_changes_gated"] == 2
    assert decode(carry, 4.0, holding) == carry  # the confirmation kept: adopted once it holds
    # the current subtask decoded again stays, whatever the gripper does (the release opens it)
    assert decode(carry, 5.0, open_hand) == carry
    assert decode(reach, 6.0, open_hand) == carry  # a change to reach is not gated, only confirmed
    assert decode(reach, 7.0, open_hand) == reach


def test_a_held_object_gate_reads_every_gripper_dim_and_refuses_bad_settings():
    gate = HeldGate("^carry", dims=(1, 3), low=0.25)
    assert gate.allows("reach the red cube", np.zeros(4))
    assert gate.allows("carry the red cube", np.array([0, 0.5, 0, 1.0]))  # no high: any closed
    assert not gate.allows("carry the red cube", np.array([0, 0.5, 0, 0.1]))  # one still open
    assert not gate.allows("carry the red cube", np.array([0, 0.5]))  # no such dim: not holding
    assert not HeldGate("^carry", (1,), 0.25, 0.8).allows("carry it", np.array([0, 1.0]))
    for pattern, dims, low, high, match in (
        ("", (5,), 0.25, 0.8, "needs a pattern"),
        ("(carry", (5,), 0.25, 0.8, "pattern"),
        ("^carry", (), 0.25, 0.8, "dims"),
        ("^carry", (-1,), 0.25, 0.8, "dims"),
        ("^carry", (5,), float("nan"), 0.8, "finite"),
        ("^carry", (5,), 0.25, 0.25, "above"),
    ):
        with pytest.raises(ValueError, match=match):
            HeldGate(pattern, dims, low, high)


def test_a_later_phase_is_adopted_at_once_and_a_step_back_waits_for_confirmations(policy):
    order = PhaseOrder(("^reach ", "^grasp ", "^carry "))
    loop = SubtaskLoop(preset("openpi_subtask"), period_s=1.0, confirmations=3, phase_order=order)
    loop.observe_task("put the red cube on the green pad")
    decode = subtask_decoder(policy, loop)

    reach, other = "reach the red cube, far left", "reach the blue cube, far right"
    grasp, carry = "grasp the red cube", "carry the red cube to the green pad"
    assert decode(reach, 1.0) == reach
    assert decode(other, 2.0) == reach  # the same phase, another cube: held back
    assert decode(grasp, 3.0) == grasp  # the next phase: at once
    assert decode(reach, 4.0) == grasp  # back a phase: held back ...
    assert decode(reach, 5.0) == grasp
    assert decode(carry, 6.0) == carry  # ... and a later phase at once, skipping none it knows
    assert decode("wave at the camera", 7.0) == carry  # no phase: confirmations, as without order
    assert loop.changes_held == 4 and loop.current.text.subtask_id == 3
    assert not order.advances("wave", "carry it") and not order.advances("carry it", "grasp it")
    for patterns, match in ((("^reach ",), "two phases"), (("^reach ", ""), "empty"),
                            (("^reach ", "(grasp"), "grasp")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            PhaseOrder(patterns)


@pytest.mark.parametrize("gripper, adopted", [(0.0, False), (0.5, True)])
def test_the_engine_gates_a_subtask_on_its_frames_gripper_state(policy, gripper, adopted):
    gate = HeldGate("(?s).*", dims=(6,), low=0.25, high=0.8)  # every subtask needs a held object
    engine = hierarchy_engine(policy, subtask_held_gate=gate)
    try:
        results = []
        for f in range(6):
            frame = observation(f)
            frame.state[6] = gripper
            results.append(engine.step(frame))
        assert engine.subtasks.refreshes >= 1  # subtasks finished either way
        conditioned = [r.action.subtask_id for r in results if r.action.subtask_id]
        assert bool(conditioned) == adopted
        assert (engine.subtasks.changes_gated > 0) != adopted
    finally:
        engine.close()
