"""GPU fast path, checked on the CPU: the fixed-shape steps (engine/static_paths.py) equal the
dynamic paths — prefill, action chunk, text steps, whole engines — the pool receives exactly the
valid K/V, padding only ever touches scratch slots, and device-side preprocessing matches openpi's
PIL path. The one CUDA-only check (graph replay == eager) is skipped without a GPU."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from engine_checks import check_engine_memory, scaled_policy  # noqa: F401  (autouse: KV invariants after every test)

from oxygen_ros.engine import ENGINES, EngineConfig, OxygenEngine, make_engine
from oxygen_ros.engine.base import make_pool, new_request
from oxygen_ros.engine.frames import act_on_frame, frame_noise, prefill_frame
from oxygen_ros.engine.kv_cache import KVMemoryError, KVPool
from oxygen_ros.engine.language import LanguageDecoder
from oxygen_ros.engine.requests import LanguageRequest, SamplingParams
from oxygen_ros.engine.static_paths import (
    StaticActionChunk,
    StaticRunner,
    TextRow,
    bucket_for,
    chunk_kind,
    next_power_of_two,
    prompt_buckets,
    round_up,
)
from oxygen_ros.engine.types import Observation, TextDelta
from oxygen_ros.model.layers import attention_bias
from oxygen_ros.model.rtc import RTCGuidance, TrainedPrefix, prefix_weights
from oxygen_ros.policy_io.preprocess import resize_with_pad, to_model_range
from oxygen_ros.policy_io.preprocess_torch import resize_geometry, resize_with_pad_torch

STATIC = EngineConfig(static_shapes=True)
BASE, LEFT, RIGHT = "base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"


@pytest.fixture(scope="module")
def policy(tiny_checkpoint):
    return scaled_policy(tiny_checkpoint)


def observation(
    i: int,
    slots: Sequence[str] = (BASE, LEFT),
    prompt: str = "pick up the red cup",
    size=(240, 320),
) -> Observation:
    rng = np.random.default_rng(i)
    images = {slot: rng.integers(0, 256, (*size, 3), dtype=np.uint8) for slot in slots}
    return Observation(images, rng.uniform(-1, 1, 7), prompt, stamp=float(i))


def pool_slots(pool: KVPool, segment) -> torch.Tensor:
    return pool.slots(segment, 0, segment.length)


# -- helpers and model switches -------------------------------------------------------------------


def test_buckets():
    assert prompt_buckets(200) == (16, 32, 64, 128, 200)
    assert prompt_buckets(96) == (16, 32, 64, 96)
    assert bucket_for(17, (16, 32)) == 32 and bucket_for(16, (16, 32)) == 16
    with pytest.raises(ValueError, match="exceeds"):
        bucket_for(33, (16, 32))
    assert [next_power_of_two(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    assert [round_up(n, 128) for n in (0, 1, 128, 129)] == [128, 128, 128, 256]


def test_attention_bias_can_skip_the_host_sync():
    allowed = torch.ones(1, 3, 5, dtype=torch.bool)
    assert attention_bias(allowed, 2, torch.float32) is None  # inspects the mask (a sync)
    bias = attention_bias(allowed, 2, torch.float32, dense=False)  # never inspects it
    assert bias.shape == (1, 1, 6, 5) and not bias.any()
    assert attention_bias(allowed & False, 2, torch.float32, dense=True) is None


def test_scratch_slots_sit_outside_the_accounting():
    pool = KVPool(
        num_layers=1, kv_heads=1, head_dim=2, capacity_tokens=32, block_size=8, scratch_tokens=5
    )
    plain = KVPool(num_layers=1, kv_heads=1, head_dim=2, capacity_tokens=32, block_size=8)
    assert pool.capacity_bytes == plain.capacity_bytes and pool.keys.shape[1] == 37
    assert pool.scratch_slots(7).tolist() == [32, 33, 34, 35, 36, 32, 33]
    segment = pool.allocate(10, "x")
    assert (
        pool.next_slots(segment, 10).tolist() == pool.slots(segment, 0, 10).tolist()
        and segment.length == 0
    )
    pool.claim(segment, 10)  # counted as written only now
    assert segment.length == 10
    with pytest.raises(KVMemoryError, match="past its reserved"):
        pool.next_slots(segment, 7)  # 16 reserved
    with pytest.raises(ValueError, match="no scratch"):
        plain.scratch_slots(1)


# -- prefill + action chunk
# -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "slots, prompt",
    [
        ((BASE,), "pick up the red cup"),
        ((BASE, RIGHT), "pick up the red cup"),  # masked middle camera: positions shift
        ((BASE, LEFT, RIGHT), "pick up the red cup"),
        ((BASE, LEFT), "go"),  # short prompt: most of the bucket is padding
        ((LEFT,), "put the towel in the basket, then close the drawer slowly"),
    ],
)
def test_static_action_path_equals_dynamic(policy, slots, prompt):
    pool = make_pool(policy, STATIC)
    runner = StaticRunner(policy, pool)
    obs = observation(1, slots, prompt)
    dynamic = prefill_frame(policy, pool, obs, 1)
    static = prefill_frame(policy, pool, obs, 2, runner)
    assert (
        static.length
        == dynamic.length
        == len(slots) * policy.config.image_tokens
        + int(policy.prompt_tokens(obs.state, prompt)[1].sum())
    )
    keys_d, keys_s = (
        pool.keys[:, pool_slots(pool, dynamic.segment)],
        pool.keys[:, pool_slots(pool, static.segment)],
    )
    values_d, values_s = (
        pool.values[:, pool_slots(pool, dynamic.segment)],
        pool.values[:, pool_slots(pool, static.segment)],
    )
    # fp32; the only difference is the summation order over padded (masked) columns
    torch.testing.assert_close(keys_s, keys_d, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(values_s, values_d, atol=2e-5, rtol=1e-5)
    noise = frame_noise(policy.config, 0, 1, policy.device)
    actions_d = act_on_frame(policy, pool, dynamic, noise, 10)
    actions_s = act_on_frame(policy, pool, static, noise, 10, runner)
    assert actions_d.abs().mean() > 0.1
    torch.testing.assert_close(actions_s, actions_d, atol=5e-5, rtol=1e-5)


def unpadded_frames(policy):
    """A pool, a runner whose buckets fit the frame exactly (prompt bucket = its prompt, context
    bucket 1), and the same observation prefilled eagerly and on the static path."""
    pool = make_pool(policy, STATIC)
    runner = StaticRunner(policy, pool, context_bucket=1)
    obs = observation(2, (BASE, RIGHT))
    n_tokens = int(policy.prompt_tokens(obs.state, obs.prompt)[1].sum())
    runner.prompt_buckets = (n_tokens,) + runner.prompt_buckets
    return (
        pool,
        runner,
        prefill_frame(policy, pool, obs, 1),
        prefill_frame(policy, pool, obs, 2, runner),
    )


def test_static_action_path_is_bit_exact_without_padding(policy):
    """With no padding (prompt exactly a bucket, context bucket 1) nothing is reordered: the fixed
    shapes, explicit masks and static slot list compute exactly what the dynamic path does."""
    pool, runner, dynamic, static = unpadded_frames(policy)
    assert torch.equal(
        pool.keys[:, pool_slots(pool, static.segment)],
        pool.keys[:, pool_slots(pool, dynamic.segment)],
    )
    noise = frame_noise(policy.config, 0, 2, policy.device)
    assert torch.equal(
        act_on_frame(policy, pool, static, noise, 10, runner),
        act_on_frame(policy, pool, dynamic, noise, 10),
    )


def test_a_static_chunk_follows_a_weight_change_in_its_step_conditionings(tiny_checkpoint):
    """The static chunk keeps every step's adaRMS conditioning in buffers of its own (a captured
    graph reads them). After an in-place change to a weight they are made of, its next chunk uses
    the new values: bit for bit the eager chunk's."""
    policy = scaled_policy(tiny_checkpoint)  # its own copy: this test changes a weight
    pool, runner, dynamic, static = unpadded_frames(policy)
    noise = frame_noise(policy.config, 0, 2, policy.device)
    before = act_on_frame(policy, pool, static, noise, 10, runner)
    with torch.no_grad():
        policy.model.expert.layers[0].post_attention_layernorm.dense.bias.add_(0.5)
    after = act_on_frame(policy, pool, static, noise, 10, runner)
    assert runner.fallbacks == 0
    assert torch.equal(after, act_on_frame(policy, pool, dynamic, noise, 10))
    assert not torch.allclose(after, before)


def test_a_static_trained_chunk_follows_a_weight_change_in_time_zeros_conditioning(
    tiny_checkpoint,
):
    """A trained static chunk reads every step's conditioning and time 0's (its frozen tokens)
    from buffers of its own; after an in-place change to a weight they are made of, its next
    chunk is bit for bit the eager trained chunk."""
    policy = scaled_policy(tiny_checkpoint)  # its own copy: this test changes a weight
    pool, runner, dynamic, static = unpadded_frames(policy)
    previous = act_on_frame(policy, pool, dynamic, frame_noise(policy.config, 0, 9, "cpu"), 10)
    trained = TrainedPrefix(previous[None], torch.arange(policy.config.action_horizon) < 3)
    noise = frame_noise(policy.config, 0, 2, policy.device)
    before = act_on_frame(policy, pool, static, noise, 10, runner, trained)
    assert torch.equal(before, act_on_frame(policy, pool, dynamic, noise, 10, guidance=trained))
    with torch.no_grad():
        policy.model.time_mlp_out.bias.add_(0.5)
    after = act_on_frame(policy, pool, static, noise, 10, runner, trained)
    assert runner.fallbacks == 0
    assert torch.equal(after, act_on_frame(policy, pool, dynamic, noise, 10, guidance=trained))
    assert not torch.allclose(after, before)


def snapshot(pool: KVPool) -> tuple[torch.Tensor, torch.Tensor]:
    return pool.keys.clone(), pool.values.clone()


def changed_slots(pool: KVPool, before: tuple[torch.Tensor, torch.Tensor]) -> set:
    diff = (pool.keys != before[0]).flatten(2).any(-1).any(0) | (pool.values != before[1]).flatten(
        2
    ).any(-1).any(0)
    return set(torch.nonzero(diff).flatten().tolist())


def test_prefill_writes_exactly_the_valid_prefix_columns(policy):
    pool = make_pool(policy, STATIC)
    runner = StaticRunner(policy, pool)
    obs = observation(3, (BASE, RIGHT), "go")
    before = snapshot(pool)
    frame = prefill_frame(policy, pool, obs, 1, runner)
    scratch = set(range(pool.scratch_start, pool.scratch_start + pool.scratch_tokens))
    valid = set(pool_slots(pool, frame.segment).tolist())
    assert frame.segment.length == 2 * policy.config.image_tokens + int(
        policy.prompt_tokens(obs.state, "go")[1].sum()
    )
    written = changed_slots(pool, before)
    assert valid <= written and written - valid <= scratch  # padding went to scratch, nowhere else
    assert pool.bytes_in_use == pool.segment_bytes(frame.segment) and pool.live_segments == 1
    action = act_on_frame(
        policy, pool, frame, frame_noise(policy.config, 0, 1, policy.device), 10, runner
    )
    # the chunk only reads
    assert changed_slots(pool, (pool.keys.clone(), pool.values.clone())) == set()
    assert action.shape == (policy.config.action_horizon, policy.config.action_dim)


# -- text steps
# ---------------------------------------------------------------------------------------


def make_requests(
    policy, specs: Sequence[tuple[str, str, int]], first_id: int = 1
) -> list[LanguageRequest]:
    return [
        new_request(policy, STATIC, first_id + i, kind, text, SamplingParams(max_tokens=n))
        for i, (kind, text, n) in enumerate(specs)
    ]


def test_static_text_step_logits_and_kv_equal_the_eager_step(policy):
    """One ragged batch (rows from two frames of different lengths, padded to a bucket of 4): the
    same logits, the same greedy tokens, the same K/V written; padding rows write only scratch."""
    pools = [make_pool(policy, STATIC) for _ in range(2)]
    frames = [
        [
            prefill_frame(policy, pool, observation(f, slots), f)
            for f, slots in ((1, (BASE,)), (2, (BASE, LEFT, RIGHT)))
        ]
        for pool in pools
    ]
    owns = [[pool.allocate(12, f"request {i}") for i in range(3)] for pool in pools]
    texts = [[5, 9, 200], [17], [3, 4]]  # ragged new tokens: a kind prompt prefill of mixed lengths
    parents = [0, 1, 1]

    # eager: gather + forward_text, row by row lengths padded to the widest
    pool, frame = pools[0], frames[0]
    model = policy.model
    width = max(map(len, texts))
    tokens = torch.zeros(3, width, dtype=torch.long)
    valid = torch.zeros(3, width, dtype=torch.bool)
    for i, t in enumerate(texts):
        tokens[i, : len(t)] = torch.tensor(t)
        valid[i, : len(t)] = True
    context = pool.gather([[(frame[p].segment, frame[p].length)] for p in parents])
    positions = torch.tensor([[frame[p].length + j for j in range(width)] for p in parents])
    out = model.forward_text(context, tokens, positions, valid)
    eager_logits = model.logits(
        out.hidden[torch.arange(3), torch.tensor([len(t) - 1 for t in texts])]
    )
    for i, t in enumerate(texts):
        pool.write(
            owns[0][i], [k[i, : len(t)] for k in out.keys], [v[i, : len(t)] for v in out.values]
        )

    # static
    pool, frame = pools[1], frames[1]
    runner = StaticRunner(policy, pool)
    before = snapshot(pool)
    rows = [
        TextRow([(frame[p].segment, frame[p].length)], t, frame[p].length, owns[1][i])
        for i, (t, p) in enumerate(zip(texts, parents, strict=False))
    ]
    greedy, logits = runner.text(rows, [True, True, True])
    assert runner.text_buckets == [(4, 4, 256)]  # 3 rows of <= 3 tokens over <= 238 slots, bucketed
    vocab = policy.tokenizer.vocab_size
    assert greedy.tolist() == eager_logits[:, :vocab].argmax(-1).tolist()
    torch.testing.assert_close(
        torch.stack([logits[i] for i in range(3)]), eager_logits, atol=1e-4, rtol=1e-4
    )
    for i, t in enumerate(texts):
        assert owns[1][i].length == owns[0][i].length == len(t)
        torch.testing.assert_close(
            pools[1].keys[:, pool_slots(pools[1], owns[1][i])],
            pools[0].keys[:, pool_slots(pools[0], owns[0][i])],
            atol=2e-5,
            rtol=1e-5,
        )
        torch.testing.assert_close(
            pools[1].values[:, pool_slots(pools[1], owns[1][i])],
            pools[0].values[:, pool_slots(pools[0], owns[0][i])],
            atol=2e-5,
            rtol=1e-5,
        )
    written = changed_slots(pools[1], before)
    own_slots = set().union(*(set(pool_slots(pools[1], own).tolist()) for own in owns[1]))
    assert own_slots <= written and written - own_slots <= set(
        range(pools[1].scratch_start, pools[1].keys.shape[1])
    )


def run_decoder(policy, static: bool, steps: int) -> tuple[list[list[int]], dict[int, str]]:
    """Attach requests of mixed kinds and lengths to two frames, then decode them together; the
    batch shrinks as requests finish (different buckets). Returns tokens per step and texts."""
    pool = make_pool(policy, STATIC)
    decoder = LanguageDecoder(policy, pool, StaticRunner(policy, pool) if static else None)
    frames = [
        prefill_frame(policy, pool, observation(f, slots), f)
        for f, slots in ((1, (BASE,)), (2, (BASE, RIGHT)))
    ]
    first = make_requests(policy, [("narration", "", 9), ("memory", "", 4)])
    second = make_requests(
        policy,
        [("answer", "where is the cup?", 12), ("narration", "", 3), ("answer", "what next?", 7)],
        first_id=3,
    )
    texts: dict[int, str] = {}

    def collect(deltas: list[TextDelta]) -> list[int]:
        for d in deltas:
            texts[d.request_id] = texts.get(d.request_id, "") + d.text
        return [d.request_id for d in deltas]

    trace = [collect(decoder.attach(first, frames[0])), collect(decoder.attach(second, frames[1]))]
    active = first + second
    for _ in range(steps):
        active = [r for r in active if r.state.value == "active"]
        if not active:
            break
        collect(decoder.step(active))
        trace.append([r.tokens[-1] if r.tokens else -1 for r in active])
    for r in first + second:
        decoder.release(r)
    for f in frames:
        pool.release(f.segment)
    assert pool.bytes_in_use == 0
    return trace, texts


def test_static_decoding_equals_dynamic_decoding_across_frames(policy):
    dynamic = run_decoder(policy, static=False, steps=14)
    static = run_decoder(policy, static=True, steps=14)
    assert static == dynamic
    assert len(set(dynamic[1].values())) == 5  # the requests really produce different texts


# -- whole engines
# --------------------------------------------------------------------------------------


def drive(
    policy, name: str, config: EngineConfig, frames: int = 5
) -> tuple[list[np.ndarray], dict[int, str]]:
    engine = make_engine(name, policy, config)
    texts: dict[int, str] = {}
    actions = []
    submissions = {
        0: [("narration", "", 6, 0.0), ("memory", "", 3, 0.0)],
        1: [("answer", "where is the cup?", 5, 0.0)],
        2: [("narration", "", 4, 0.8)],
    }
    try:
        for f in range(frames):
            for kind, text, n, temperature in submissions.get(f, []):
                engine.submit(
                    kind, text, SamplingParams(max_tokens=n, temperature=temperature, seed=7)
                )
            result = engine.step(observation(f, (BASE, LEFT) if f % 2 else (BASE,)))
            actions.append(result.action.actions)
            deltas = result.deltas
            for d in deltas:
                texts[d.request_id] = texts.get(d.request_id, "") + d.text
        if isinstance(engine, OxygenEngine):
            tail = engine.decode(max_steps=50)
        else:  # the sequential baselines finish within the frame; naive-parallel's worker may not
            tail = engine.drain() if hasattr(engine, "drain") else []
        for d in tail:
            texts[d.request_id] = texts.get(d.request_id, "") + d.text
    finally:
        engine.close()
    assert engine.memory()["bytes_in_use"] == 0
    return actions, texts


@pytest.mark.parametrize("name", list(ENGINES))
def test_engines_with_static_shapes_match_the_default_paths(policy, name):
    fixed = dict(decode_mode="fixed", decode_steps_per_frame=2, seed=3)
    default_actions, default_texts = drive(policy, name, EngineConfig(**fixed))
    static_actions, static_texts = drive(policy, name, EngineConfig(**fixed, static_shapes=True))
    for a, b in zip(static_actions, default_actions, strict=False):
        np.testing.assert_allclose(a, b, atol=2e-4, rtol=1e-5)  # robot units (unnormalised)
    assert static_texts == default_texts and len(default_texts) == 4


def test_cuda_graphs_need_cuda_and_gpu_preprocess_needs_static_paths(policy):
    if policy.device.type != "cuda":
        with pytest.raises(ValueError, match="needs the model on a CUDA device"):
            OxygenEngine(policy, EngineConfig(cuda_graphs=True))
    with pytest.raises(ValueError, match="gpu_preprocess=True works on the static paths"):
        EngineConfig(gpu_preprocess=True)
    assert EngineConfig(cuda_graphs=True).uses_static_paths


def test_warm_up_prepares_every_bucket_a_workload_uses_and_leaves_the_pool_empty(policy):
    config = EngineConfig(
        decode_mode="fixed",
        decode_steps_per_frame=1,
        static_shapes=True,
        max_active_requests=6,
        default_max_tokens=8,
    )
    engine = OxygenEngine(policy, config)
    before = snapshot(engine.pool)
    created = engine._prepare_buckets(observation(0))  # warm-up's first part alone
    assert created == engine.runner.num_paths > 0
    assert changed_slots(engine.pool, before) <= set(
        range(engine.pool.scratch_start, engine.pool.keys.shape[1])
    )
    report = engine.warm_up(observation(0))  # + decode timing at batch 1, 2, 4, 6 and frames
    assert report.buckets_created == 0  # everything already existed
    assert {1, 2, 4, 6} <= set(engine.timer.measured_sizes())  # the frames may add more
    assert engine.memory()["bytes_in_use"] == 0 and engine.memory()["live_segments"] == 0
    assert engine.memory()["peak_bytes"] == 0 and engine.frame_count == 0
    most = 0
    for f in range(12):
        engine.submit("narration")
        most = max(most, engine.step(observation(f)).stats.active_requests)
    assert most >= 3  # several batch buckets were used
    assert engine.runner.num_paths == created  # nothing new to create (or capture) mid-run
    engine.close()


# -- preprocessing on the device
# ----------------------------------------------------------------------


def test_gpu_preprocessing_matches_openpi_pil_path(record_property):
    rng = np.random.default_rng(0)
    square = rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)
    reference = to_model_range(resize_with_pad(square, 224, 224))
    # bit-exact
    assert np.array_equal(
        resize_with_pad_torch(torch.from_numpy(square), 224, 224)[0].numpy(), reference
    )
    worst = {}
    for shape in [(240, 320), (480, 640), (720, 1280), (100, 150), (300, 200), (112, 112)]:
        y, x = np.mgrid[0 : shape[0], 0 : shape[1]]
        smooth = np.stack(
            [x * 255 // shape[1], y * 255 // shape[0], (x + y) * 127 // sum(shape)], -1
        ).astype(np.uint8)
        for name, image in (
            ("noise", rng.integers(0, 256, (*shape, 3), dtype=np.uint8)),
            ("smooth", smooth),
        ):
            cpu = to_model_range(resize_with_pad(image, 224, 224))
            gpu = resize_with_pad_torch(torch.from_numpy(image), 224, 224)[0].numpy()
            diff = np.abs(cpu - gpu)
            worst[f"{shape[0]}x{shape[1]} {name}"] = float(diff.max())
            height, width, top, left = resize_geometry(*shape, 224, 224)
            bars = np.ones((224, 224), dtype=bool)
            bars[top : top + height, left : left + width] = False
            assert (cpu[:, bars] == -1).all() and (gpu[:, bars] == -1).all()  # the same black bars
            assert diff.max() <= 2 / 255 + 1e-6 and diff.mean() < 3e-3  # within one uint8 level
    print("GPU vs PIL preprocessing, max |diff| in [-1, 1] units:", worst)
    record_property("max_abs_diff", max(worst.values()))


def test_engine_with_gpu_preprocessing_gives_identical_actions_for_224_images(policy):
    def actions(gpu_preprocess: bool) -> np.ndarray:
        engine = OxygenEngine(
            policy, EngineConfig(static_shapes=True, gpu_preprocess=gpu_preprocess)
        )
        chunk = engine.step(observation(4, (BASE, LEFT), size=(224, 224))).action.actions
        engine.close()
        return chunk

    assert np.array_equal(actions(True), actions(False))


# -- CUDA only
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graph_replay_equals_eager_static_paths(tiny_checkpoint):
    """On a GPU: CUDA-graph replay gives what the same fixed-shape steps give eagerly (same kernels,
    so bit-for-bit up to scheduling), and both track the dynamic eager path."""
    policy = scaled_policy(tiny_checkpoint, device="cuda")
    results = {}
    for path in ("dynamic", "static", "graphs"):
        config = EngineConfig(
            decode_mode="fixed",
            decode_steps_per_frame=3,
            seed=3,
            static_shapes=path != "dynamic",
            cuda_graphs=path == "graphs",
            gpu_preprocess=path != "dynamic",
        )
        engine = OxygenEngine(policy, config)
        engine.warm_up(observation(0, size=(224, 224)))
        texts: dict[int, str] = {}
        chunks = []
        for f in range(4):
            engine.submit("narration", sampling=SamplingParams(max_tokens=6))
            # 224 px: GPU preprocessing is exact
            result = engine.step(observation(f, size=(224, 224)))
            chunks.append(result.action.actions)
            for d in result.deltas:
                texts[d.request_id] = texts.get(d.request_id, "") + d.text
        engine.close()
        results[path] = chunks, texts
        if path != "dynamic":
            assert engine.runner.paths and all(
                p.step.captured == (path == "graphs") for p in engine.runner.paths
            )
    for eager, replayed, dynamic in zip(
        results["static"][0], results["graphs"][0], results["dynamic"][0], strict=False
    ):
        np.testing.assert_allclose(replayed, eager, atol=1e-5, rtol=1e-6)
        # other kernels (masked SDPA)
        np.testing.assert_allclose(replayed, dynamic, atol=2e-3, rtol=1e-4)
    assert results["graphs"][1] == results["static"][1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize(
    "continuity",
    [dict(rtc_guidance="identity"), dict(rtc_training_max_delay=3)],
    ids=["identity", "trained"],
)
def test_cuda_graphs_replay_rtc_chunks(tiny_checkpoint, continuity):
    """On a GPU: identity-guided and trained chunks are captured like the plain chunk (no
    capture inside a frame, no eager fallback) and replay what the eager static steps compute."""
    from oxygen_ros.tools.benches.continuity_workload import moving_scene

    policy = scaled_policy(tiny_checkpoint, device="cuda")
    chunks = {}
    for path in ("static", "graphs"):
        config = EngineConfig(
            chunk_continuity="rtc",
            action_dt=0.02,
            seed=3,
            static_shapes=True,
            cuda_graphs=path == "graphs",
            **continuity,
        )
        engine = OxygenEngine(policy, config)
        engine.warm_up(moving_scene(0.0, 2, size=224))
        chunks[path] = []
        for k in range(4):
            chunks[path].append(engine.act(moving_scene(0.05 * k, 2, size=224)).actions)
            engine.continuity.latency_s = 0.03 + 0.02 * (k % 2)
        engine.close()
        assert engine.captures_during_frames == 0 and engine.static_fallbacks == 0
        if path == "graphs":
            assert all(p.step.captured for p in engine.runner.paths)
    for eager, replayed in zip(chunks["static"], chunks["graphs"], strict=True):
        np.testing.assert_allclose(replayed, eager, atol=1e-5, rtol=1e-6)


# -- frozen after warm-up: no capture inside a frame
# ------------------------------------------------------


def test_after_warm_up_no_bucket_is_created_inside_a_frame(policy):
    """Warm up on two cameras and the usual task, then run frames with a masked camera, a third
    camera, a much longer task and a long question: no bucket is created (no CUDA graph would be
    captured mid-run), the uncaptured shapes run on a larger bucket or eagerly, and actions and
    texts equal the eager engine's."""
    fixed = dict(
        decode_mode="fixed",
        decode_steps_per_frame=2,
        seed=3,
        max_active_requests=4,
        default_max_tokens=6,
    )
    static = OxygenEngine(policy, EngineConfig(**fixed, static_shapes=True))
    eager = OxygenEngine(policy, EngineConfig(**fixed))
    created = static.warm_up(observation(0)).buckets_created
    assert created > 0 and static.runner.frozen
    long_task = (
        "put the towel in the basket, then close the drawer slowly and wave goodbye to the camera "
        "twice"
    )
    frames = [
        observation(1),
        observation(2, (BASE,)),  # a camera masked mid-run
        observation(3, prompt=long_task),  # a longer task
        observation(4, (BASE, LEFT, RIGHT)),  # a camera more than at warm-up
        observation(5),
    ]
    asks = {
        0: "",
        1: "where is the cup and what colour is the towel next to the drawer?",
        3: "why?",
    }
    texts: dict[str, dict[int, str]] = {"static": {}, "eager": {}}
    try:
        for f, obs in enumerate(frames):
            for engine in (static, eager):
                if f in asks:
                    engine.submit(
                        "answer" if asks[f] else "narration", asks[f], SamplingParams(max_tokens=5)
                    )
            results = {
                name: engine.step(obs) for name, engine in (("static", static), ("eager", eager))
            }
            np.testing.assert_allclose(
                results["static"].action.actions,
                results["eager"].action.actions,
                atol=2e-4,
                rtol=1e-5,
            )
            for name, result in results.items():
                for d in result.deltas:
                    texts[name][d.request_id] = texts[name].get(d.request_id, "") + d.text
        for name, engine in (("static", static), ("eager", eager)):
            for d in engine.decode(max_steps=20):
                texts[name][d.request_id] = texts[name].get(d.request_id, "") + d.text
    finally:
        static.close()
        eager.close()
    assert static.captures_during_frames == 0 and static.runner.num_paths == created
    # at least the (base) and (base, left, right) prefills ran eagerly
    assert static.static_fallbacks >= 2
    assert texts["static"] == texts["eager"] and len(texts["eager"]) == 3


def test_a_bucket_created_after_freezing_is_counted(policy):
    pool = make_pool(policy, STATIC)
    runner = StaticRunner(policy, pool)
    runner.warm_up(observation(0), num_steps=2)
    runner.freeze()
    assert runner.captures_during_frames == 0
    runner.action_path(1000, 3)  # a shape warm-up never saw, created anyway: counted
    assert runner.captures_during_frames == 1
    segment = pool.allocate(1000, "x")
    pool.claim(segment, 1000)
    assert (
        runner.act(
            segment, torch.zeros(1, policy.config.action_horizon, policy.config.action_dim), 5
        )
        is None
    )  # no 5-step bucket
    pool.release(segment)


# -- real-time chunking on the static path
# ---------------------------------------------------------


def _rtc_guidances(policy, previous: torch.Tensor) -> dict[str, object]:
    """Identity guidance and a trained prefix over ``previous``, at two delays each."""
    cfg = policy.config
    out = {}
    for d in (2, 4):
        weights = prefix_weights(cfg.action_horizon, d, 8, "exp")[:, None].expand(
            -1, cfg.action_dim
        )
        out[f"identity d={d}"] = RTCGuidance(previous, weights.contiguous(), 5.0, "identity")
        out[f"trained d={d}"] = TrainedPrefix(previous, torch.arange(cfg.action_horizon) < d)
    return out


def test_static_rtc_chunks_are_bit_exact_and_the_delay_is_data(policy):
    """Identity-guided and trained chunks on the fixed-shape path equal the eager sampler bit for
    bit without padding; one bucket per kind serves every delay (buffers, not shapes); vjp stays
    eager."""
    pool, runner, dynamic, static = unpadded_frames(policy)
    previous = act_on_frame(policy, pool, dynamic, frame_noise(policy.config, 0, 9, "cpu"), 10)
    noise = frame_noise(policy.config, 0, 2, policy.device)
    plain = act_on_frame(policy, pool, dynamic, noise, 10)
    for name, guidance in _rtc_guidances(policy, previous[None]).items():
        eager = act_on_frame(policy, pool, dynamic, noise, 10, guidance=guidance)
        fixed = act_on_frame(policy, pool, static, noise, 10, runner, guidance)
        assert torch.equal(fixed, eager), name
        assert (eager - plain).abs().max() > 1e-2, name  # the guidance did act
    kinds = sorted(path.kind[0] for path in runner.paths if isinstance(path, StaticActionChunk))
    assert kinds == ["identity", "trained"]
    # a plain chunk after a guided one: the guidance buffers are cleared
    assert torch.equal(act_on_frame(policy, pool, static, noise, 10, runner), plain)
    vjp = RTCGuidance(previous[None], torch.ones(policy.config.action_horizon, 1), 5.0, "vjp")
    assert chunk_kind(vjp) is None
    with pytest.raises(ValueError, match="eager"):
        runner.act(static.segment, noise, 10, vjp)
    for frame in (dynamic, static):
        pool.release(frame.segment)


@pytest.mark.parametrize(
    "continuity",
    [dict(rtc_guidance="identity"), dict(rtc_training_max_delay=3)],
    ids=["identity", "trained"],
)
def test_engines_run_rtc_on_the_static_path_without_captures_in_frames(policy, continuity):
    """After warm-up, a moving scene replanned with RTC: the static engine equals the eager one,
    creates no bucket inside a frame and never falls back to the eager chunk."""
    from oxygen_ros.tools.benches.continuity_workload import moving_scene

    config = dict(chunk_continuity="rtc", action_dt=0.02, seed=2, **continuity)
    static = OxygenEngine(policy, EngineConfig(**config, static_shapes=True))
    eager = OxygenEngine(policy, EngineConfig(**config))
    static.warm_up(moving_scene(0.0, 2, state_dim=7))
    created = static.runner.num_paths
    try:
        for k in range(4):
            scene = moving_scene(0.05 * k, 2, state_dim=7)
            a, b = static.act(scene), eager.act(scene)
            static.continuity.latency_s = eager.continuity.latency_s = 0.03 + 0.02 * (k % 2)
            np.testing.assert_allclose(a.actions, b.actions, atol=2e-4, rtol=1e-5)
    finally:
        static.close()
        eager.close()
    assert static.captures_during_frames == 0 and static.runner.num_paths == created
    assert static.static_fallbacks == 0
