"""Unified KV pool: allocation, reference counting, zero-copy views, ragged gathers, accounting."""

from __future__ import annotations

import pytest
import torch

from oxygen_ros.engine.kv_cache import KVMemoryError, KVPool


def pool(capacity: int = 128, block: int = 8) -> KVPool:
    return KVPool(num_layers=2, kv_heads=1, head_dim=4, capacity_tokens=capacity, block_size=block)


def tokens(n: int, start: float) -> list:
    base = torch.arange(n * 4, dtype=torch.float32).reshape(n, 1, 4) + start
    return [base, base + 1000]  # two layers, distinguishable


def test_refcount_frees_only_after_last_release():
    p = pool()
    seg = p.allocate(20, "frame 1 prefix")
    assert p.bytes_in_use == 3 * p.block_bytes  # 20 tokens -> 3 blocks of 8
    p.retain(seg)  # a language request starts reading it
    assert not p.release(seg)  # the action is done: still referenced
    assert p.bytes_in_use == 3 * p.block_bytes
    assert p.release(seg)  # the request finished
    assert p.bytes_in_use == 0 and p.live_segments == 0
    assert p.peak_bytes == 3 * p.block_bytes
    with pytest.raises(AssertionError):
        p.release(seg)


def test_allocation_failure_is_a_clear_error():
    p = pool(capacity=32)
    p.allocate(24, "a")
    with pytest.raises(KVMemoryError, match="needs 2 blocks"):
        p.allocate(9, "b")


def test_contiguous_segment_view_is_zero_copy_and_exact():
    p = pool()
    seg = p.allocate(12, "prefix")
    keys, values = tokens(12, 0.0), tokens(12, 0.5)
    p.write(seg, keys, values)
    ctx = p.view(seg)
    assert ctx.keys[0].data_ptr() == p.keys[0, seg.blocks[0] * p.block_size].data_ptr()  # a view into the pool
    torch.testing.assert_close(ctx.keys[1][0], keys[1])
    torch.testing.assert_close(ctx.values[0][0], values[0])
    assert ctx.valid.all() and ctx.length == 12


def test_gather_concatenates_segments_per_row_and_pads():
    p = pool()
    prefix = p.allocate(10, "prefix")
    p.write(prefix, tokens(10, 0.0), tokens(10, 0.0))
    own_a = p.allocate(5, "request a")
    p.write(own_a, tokens(3, 500.0), tokens(3, 500.0))
    own_b = p.allocate(5, "request b")
    ctx = p.gather([[(prefix, 10), (own_a, own_a.length)], [(prefix, 10), (own_b, own_b.length)]])
    assert ctx.valid.sum(1).tolist() == [13, 10]
    torch.testing.assert_close(ctx.keys[0][0, 10:13], tokens(3, 500.0)[0])
    torch.testing.assert_close(ctx.keys[0][1, :10], tokens(10, 0.0)[0])


def test_fragmented_pool_still_serves_reads_correctly():
    p = pool(capacity=64, block=8)
    p.allocate(8, "a")
    b = p.allocate(8, "b")
    p.allocate(8, "c")
    p.release(b)  # leave a hole, so the next 16-token segment cannot be contiguous
    p.allocate(32, "d")  # blocks 3-6
    seg = p.allocate(16, "e")  # the hole (block 1) + block 7: non-contiguous
    assert seg.blocks == [1, 7]
    data = tokens(16, 7.0)
    p.write(seg, data, data)
    torch.testing.assert_close(p.view(seg).keys[0][0], data[0])
    with pytest.raises(KVMemoryError, match="past its reserved"):
        p.write(seg, tokens(1, 0.0), tokens(1, 0.0))
    assert {s for s in p.usage_by_owner()} == {"a", "c", "d", "e"}
