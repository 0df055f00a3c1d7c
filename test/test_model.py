"""pi0.5 model: cached paths equal openpi's one-pass formulation; mask semantics; numerics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor

from oxygen_ros.model.config import PRESETS, get_preset
from oxygen_ros.model.layers import (
    apply_rope,
    attention_bias,
    causal_tail_bias,
    causal_tail_start,
    rope_tables,
)
from oxygen_ros.model.mot import KVContext, Stream, joint_forward
from oxygen_ros.model.pi05 import Pi05Model, flow_schedule


def random_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> Pi05Model:
    """Tiny model with weights large enough that every path visibly changes the output."""
    torch.manual_seed(seed)
    model = Pi05Model(get_preset("tiny")).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1 if p.dim() == 1 else 0.3)
    return model.to(dtype)


def observation(batch: int = 2, text_len: int = 12, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    cfg = get_preset("tiny")
    images = torch.rand(batch, 3, 3, 224, 224, generator=g) * 2 - 1
    image_masks = torch.tensor([[True, True, False], [True, False, True]][:batch])
    tokens = torch.randint(0, cfg.vocab_size, (batch, text_len), generator=g)
    token_masks = torch.ones(batch, text_len, dtype=torch.bool)
    token_masks[-1, text_len - 4 :] = False  # ragged prompts: last row padded
    noise = torch.randn(batch, cfg.action_horizon, cfg.action_dim, generator=g)
    return images, image_masks, tokens, token_masks, noise


@pytest.fixture(scope="module")
def model() -> Pi05Model:
    return random_model()


def append(ctx: KVContext, keys, values) -> KVContext:
    return KVContext(
        [torch.cat([a, b], 1) for a, b in zip(ctx.keys, keys, strict=False)],
        [torch.cat([a, b], 1) for a, b in zip(ctx.values, values, strict=False)],
        torch.cat(
            [ctx.valid, torch.ones(ctx.valid.shape[0], keys[0].shape[1], dtype=torch.bool)], 1
        ),
    )


def test_cached_actions_equal_uncached_joint_pass(model):
    images, image_masks, tokens, token_masks, noise = observation()
    prefix = model.prefill(images, image_masks, tokens, token_masks)
    cached = model.sample_actions(prefix, noise, num_steps=10)
    reference = model.sample_actions_uncached(
        images, image_masks, tokens, token_masks, noise, num_steps=10
    )
    assert cached.shape == noise.shape
    assert cached.abs().mean() > 0.1  # not a degenerate all-zero output
    torch.testing.assert_close(cached, reference, atol=1e-5, rtol=1e-5)


def test_decode_with_cache_equals_full_sequence_logits(model):
    images, image_masks, tokens, token_masks, _ = observation()
    text = torch.randint(
        0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3)
    )
    reference = model.text_logits_uncached(images, image_masks, tokens, token_masks, text)
    prefix = model.prefill(images, image_masks, tokens, token_masks)
    logits = []  # row 0 of the reference comes from the prefix, which the engine never samples from
    ctx, position = prefix.context, prefix.num_valid.clone()
    for i in range(text.shape[1]):
        out = model.forward_text(ctx, text[:, i : i + 1], position[:, None])
        logits.append(model.logits(out.hidden[:, 0]))
        ctx, position = append(ctx, out.keys, out.values), position + 1
    torch.testing.assert_close(torch.stack(logits, 1), reference[:, 1:], atol=1e-4, rtol=1e-4)


def test_multi_token_text_extension_equals_token_by_token(model):
    """A kind's own prompt text is prefilled in one call; it must equal feeding it token by
    token."""
    images, image_masks, tokens, token_masks, _ = observation()
    text = torch.randint(
        0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(4)
    )
    prefix = model.prefill(images, image_masks, tokens, token_masks)
    positions = prefix.num_valid[:, None] + torch.arange(5)
    together = model.forward_text(prefix.context, text, positions)
    reference = model.text_logits_uncached(images, image_masks, tokens, token_masks, text)
    torch.testing.assert_close(
        model.logits(together.hidden), reference[:, 1:], atol=1e-4, rtol=1e-4
    )


def test_masked_camera_and_prompt_padding_are_invisible(model):
    images, image_masks, tokens, token_masks, noise = observation()
    base = model.sample_actions(model.prefill(images, image_masks, tokens, token_masks), noise)
    images2, tokens2 = images.clone(), tokens.clone()
    images2[0, 2] = -images2[0, 2]  # row 0 masks camera 2
    # row 1 pads its last 4 tokens
    tokens2[1, -4:] = (tokens2[1, -4:] + 7) % model.config.vocab_size
    changed = model.sample_actions(model.prefill(images2, image_masks, tokens2, token_masks), noise)
    torch.testing.assert_close(changed, base, atol=1e-6, rtol=0)


def test_images_and_prompt_attend_bidirectionally(model):
    """Changing the last valid prompt token changes the keys of the FIRST image token (no causal
    mask)."""
    images, image_masks, tokens, token_masks, _ = observation(batch=1)
    a = model.prefill(images, image_masks, tokens, token_masks)
    tokens2 = tokens.clone()
    last_valid = int(token_masks[0].nonzero().max())
    tokens2[0, last_valid] = (tokens2[0, last_valid] + 1) % model.config.vocab_size
    b = model.prefill(images, image_masks, tokens2, token_masks)
    assert not torch.allclose(a.context.keys[-1][:, 0], b.context.keys[-1][:, 0])


def test_the_step_schedule_is_made_once_and_again_when_a_weight_it_reads_changes():
    """Every chunk reuses the first chunk's times and adaRMS conditionings; a weight they read
    that changes in place, or is replaced (moved, cast), makes them again."""
    model = random_model()
    images, image_masks, tokens, token_masks, noise = observation(batch=1)
    prefix = model.prefill(images, image_masks, tokens, token_masks)
    cpu, dt = torch.device("cpu"), torch.tensor(-0.1)
    first = model.step_schedule(10, cpu)
    times = first.times
    assert model.step_schedule(10, cpu) is first
    assert model.step_schedule(5, cpu) is not first

    def check_against_fresh_conditionings() -> Tensor:
        actions = model.sample_actions(prefix, noise, num_steps=10)
        fresh = model.denoise(prefix.context, prefix.num_valid, noise, times, dt)
        torch.testing.assert_close(actions, fresh, atol=0, rtol=0)
        return actions

    before = check_against_fresh_conditionings()
    with torch.no_grad():
        model.expert.layers[0].input_layernorm.dense.weight.mul_(2.0)  # in place
    assert model.step_schedule(10, cpu) is not first
    changed = check_against_fresh_conditionings()
    assert not torch.allclose(changed, before)
    second = model.step_schedule(10, cpu)
    model.time_mlp_in.weight.data = model.time_mlp_in.weight.data * 0.5  # replaced, as a cast
    assert model.step_schedule(10, cpu) is not second
    assert not torch.allclose(check_against_fresh_conditionings(), changed)


def test_prefix_never_attends_to_action_tokens(model):
    """In openpi's joint pass the prefix outputs do not depend on the noisy actions."""
    images, image_masks, tokens, token_masks, noise = observation()
    embs, valid = model.embed_prefix(images, image_masks, tokens, token_masks)
    b, s = valid.shape
    h = noise.shape[1]
    pad = torch.cat([valid, torch.ones(b, h, dtype=torch.bool)], 1)
    ar = torch.zeros_like(pad)
    ar[:, s] = True
    allowed, positions = Pi05Model._openpi_masks(pad, ar)
    assert not allowed[:, :s, s:].any()
    assert allowed[:, s:, s:].all()  # actions see each other in both directions

    def prefix_out(x):
        streams = [
            Stream(model.backbone, embs),
            Stream(model.expert, model.embed_actions(x), model.action_conditioning(torch.ones(b))),
        ]
        return joint_forward(streams, positions, allowed, None, model.config.rope_base).hidden[0][
            valid
        ]

    torch.testing.assert_close(prefix_out(noise), prefix_out(noise * 3 + 1), atol=0, rtol=0)


def test_positions_skip_masked_camera(model):
    """A masked middle camera shifts the prompt's positions: prefix length counts valid tokens
    only."""
    images, image_masks, tokens, token_masks, _ = observation(batch=1)
    prefix = model.prefill(images, image_masks, tokens, token_masks)
    assert int(prefix.num_valid[0]) == 2 * model.config.image_tokens + int(token_masks.sum())
    assert prefix.context.length == int(prefix.num_valid[0])  # masked slot dropped from storage


@pytest.mark.parametrize("row", [0, 1], ids=["adjacent slots", "a gap and padding"])
def test_a_batch_of_one_embeds_exactly_the_columns_a_batch_keeps(model, row):
    """A batch of one embeds only its present images and valid tokens: the same embeddings,
    validity and causal flags, bit for bit, as embedding every slot and dropping the columns
    invalid in the row (row 1: a masked middle camera and a padded prompt)."""
    images, image_masks, tokens, token_masks, _ = observation()
    one = slice(row, row + 1)
    causal = torch.zeros_like(token_masks[one])
    causal[:, 5:] = True  # a causal tail (padding included: dropped with it)
    args = (images[one], image_masks[one], tokens[one], token_masks[one])
    embs, valid = model.embed_prefix(*args)
    flags = torch.cat([torch.zeros_like(valid[:, : -tokens.shape[1]]), causal], 1)
    keep = valid[0]
    got_embs, got_valid, got_causal = model._embed_kept_prefix(
        images[row], image_masks[row], tokens[one], token_masks[one], causal
    )
    torch.testing.assert_close(got_embs, embs[:, keep], atol=0, rtol=0)
    assert got_valid.all() and got_valid.shape == (1, int(keep.sum()))
    assert torch.equal(got_causal, flags[:, keep])
    # and the prefill of the row alone equals that row of the batch's prefill
    alone = model.prefill(*args, causal)
    batch = model.prefill(images, image_masks, tokens, token_masks)
    columns = batch.context.valid[row]
    plain = model.prefill(*args)
    assert int(plain.num_valid[0]) == int(batch.num_valid[row]) == int(alone.num_valid[0])
    for a, b in zip(plain.context.keys, batch.context.keys, strict=True):
        torch.testing.assert_close(a[0], b[row, columns], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(alone.context.keys[-1], plain.context.keys[-1])  # the tail counts


def hugging_face_rope(x, positions, base):
    """transformers' Gemma rotary embedding, written out literally (rotate_half convention)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def test_rope_equals_hugging_face_rotate_half_exactly():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 7, 16, generator=g)  # [B, heads, T, D]
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [5, 9, 200, 201, 202, 1000, 4095]])
    ours = apply_rope(x, *rope_tables(positions, 16, 10_000.0, torch.float32))
    assert torch.equal(ours, hugging_face_rope(x, positions, 10_000.0))


def test_rope_scores_depend_only_on_relative_position():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 1, 1, 16, generator=g), torch.randn(1, 1, 1, 16, generator=g)

    def score(pq: int, pk: int) -> float:
        rq = apply_rope(q, *rope_tables(torch.tensor([[pq]]), 16, 10_000.0, torch.float32))
        rk = apply_rope(k, *rope_tables(torch.tensor([[pk]]), 16, 10_000.0, torch.float32))
        return float((rq * rk).sum())

    assert score(10, 3) == pytest.approx(score(107, 100), rel=1e-4)
    assert score(10, 3) != pytest.approx(score(10, 4), rel=1e-3)


def test_flow_schedule_uses_float32_accumulation():
    times = [float(t) for t in flow_schedule(10)]
    assert len(times) == 10
    assert times[0] == 1.0
    assert times[2] == pytest.approx(0.79999995, abs=1e-8)
    expected = np.float32(1.0)
    for t in times:
        assert t == float(expected)
        expected = np.float32(expected + np.float32(-0.1))


def test_bfloat16_forward_runs_and_tracks_float32():
    images, image_masks, tokens, token_masks, noise = observation()
    fp32 = random_model()
    bf16 = random_model(dtype=torch.bfloat16)
    a32 = fp32.sample_actions(fp32.prefill(images, image_masks, tokens, token_masks), noise)
    a16 = bf16.sample_actions(bf16.prefill(images, image_masks, tokens, token_masks), noise)
    assert a16.dtype == torch.float32 and torch.isfinite(a16).all()
    rel = (a16 - a32).norm() / a32.norm()
    assert rel < 0.1, f"bf16 actions deviate {rel:.3f} relative to fp32"


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_on_meta_device(name):
    with torch.device("meta"):
        model = Pi05Model(get_preset(name))
    assert sum(p.numel() for p in model.parameters()) > 0


def test_a_causal_tail_start_is_found_only_for_one_unpadded_row():
    ones = torch.ones(1, 6, dtype=torch.bool)
    tail = torch.tensor([[False, False, False, False, True, True]])
    assert causal_tail_start(ones, tail) == 4
    assert causal_tail_start(ones, torch.zeros_like(tail)) is None  # nothing causal
    assert causal_tail_start(ones, torch.ones_like(tail)) is None  # no bidirectional head
    gaps = torch.tensor([[False, True, False, False, True, True]])
    assert causal_tail_start(ones, gaps) is None  # a causal token inside the head
    padded = ones.clone()
    padded[0, 3] = False
    assert causal_tail_start(padded, tail) is None
    assert causal_tail_start(ones.expand(2, -1), tail.expand(2, -1)) is None


@pytest.mark.parametrize(("head", "length", "groups"), [(4, 6, 1), (5, 12, 2), (30, 40, 8)])
def test_the_causal_tail_bias_is_the_openpi_mask_of_the_tail_rows(head, length, groups):
    """`causal_tail_bias` holds the tail rows of `attention_bias` over openpi's ar mask (head
    bidirectional, every tail token a causal block of its own)."""
    causal = torch.zeros(1, length, dtype=torch.bool)
    causal[0, head:] = True
    cum = causal.long().cumsum(dim=1)
    allowed = cum[:, None, :] <= cum[:, :, None]
    expected = attention_bias(allowed[:, head:], groups, torch.float32, False)
    got = causal_tail_bias(head, length, groups, torch.float32, torch.device("cpu"))
    assert torch.equal(got, expected)
    assert got is causal_tail_bias(head, length, groups, torch.float32, torch.device("cpu"))


def test_a_prefill_with_a_causal_tail_equals_the_full_mask(model):
    """The split pass (head unmasked, tail rows masked) writes the K/V of the full-mask pass."""
    generator = torch.Generator().manual_seed(0)
    width = model.config.backbone.width
    embs = torch.randn(1, 40, width, generator=generator)
    valid = torch.ones(1, 40, dtype=torch.bool)
    causal = torch.zeros(1, 40, dtype=torch.bool)
    causal[0, 29:] = True
    split = model.prefix_forward(embs, valid, causal=causal)
    full = model.prefix_forward(embs, valid, dense_mask=False, causal=causal)
    bidirectional = model.prefix_forward(embs, valid)
    head_only = model.prefix_forward(embs[:, :29], valid[:, :29])
    assert split.hidden == [] and len(split.keys) == model.config.backbone.depth
    for a, b, h in zip(
        split.keys + split.values,
        full.keys + full.values,
        head_only.keys + head_only.values,
        strict=True,
    ):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)  # kernels differ: rounding
        torch.testing.assert_close(a[:, :29], h, atol=1e-5, rtol=1e-4)  # the head ignores the tail
    # the tail is causal: in the layers after the first its K/V differ from a bidirectional pass
    assert (split.values[-1][:, 29:] - bidirectional.values[-1][:, 29:]).abs().max() > 1e-3
