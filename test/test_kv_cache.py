"""Unified KV pool: allocation, reference counting, zero-copy views, ragged gathers, accounting."""

from __future__ import annotations

import pytest
import torch

from oxygen_ros.engine.kv_cache import KVInvariantError, KVMemoryError, KVPool


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
    # a view into the pool
    assert ctx.keys[0].data_ptr() == p.keys[0, seg.blocks[0] * p.block_size].data_ptr()
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


def test_an_allocation_takes_the_first_free_run_long_enough():
    """Past a hole too short for it, a segment takes the start of the first run that holds it
    (and a one-block segment fills the first hole)."""
    p = pool(capacity=128, block=8)  # 16 blocks
    first = p.allocate(8, "a")
    hole = p.allocate(16, "b")  # blocks 1-2
    p.allocate(8, "c")  # block 3
    p.release(hole)  # free: 1, 2, 4..15
    assert p.allocate(24, "d").blocks == [4, 5, 6]  # the 2-block hole is too short
    assert p.allocate(8, "e").blocks == [1]
    assert p.allocate(16, "f").blocks == [7, 8]  # block 2 alone is too short
    assert first.blocks == [0]


def test_check_passes_a_consistent_pool_and_names_unowned_or_miscounted_segments():
    p = pool()  # 16 blocks of 8
    frame = p.allocate(20, "frame 1 prefix")  # 3 blocks
    own = p.allocate(9, "request 1")  # 2 blocks
    p.retain(frame)  # the request reads the prefix
    p.check()
    p.check({frame.segment_id: 2, own.segment_id: 1})
    with pytest.raises(
        KVInvariantError,
        match=r"segment 1 \(request 1\) is live but owned by no live frame or request",
    ):
        p.check({frame.segment_id: 2})  # the request was forgotten: its KV leaked
    with pytest.raises(
        KVInvariantError, match=r"segment 0 \(frame 1 prefix\): ref_count 2, 1 known references"
    ):
        p.check({frame.segment_id: 1, own.segment_id: 1})
    with pytest.raises(KVInvariantError, match=r"segments \[7\] are referenced but already freed"):
        p.check({frame.segment_id: 2, own.segment_id: 1, 7: 1})


def test_check_finds_a_block_owned_twice_or_both_used_and_free():
    p = pool()
    a = p.allocate(8, "a")
    b = p.allocate(8, "b")
    # corrupt: one block in two segments (and b's capacity no longer matches)
    b.blocks.append(a.blocks[0])
    with pytest.raises(KVInvariantError, match=r"segment 1 \(b\): block 0 also in segment 0 \(a\)"):
        p.check()
    b.blocks.pop()
    p._free.append(a.blocks[0])  # corrupt: a used block on the free list
    with pytest.raises(
        KVInvariantError, match=r"blocks \[0\] are both free and in segments \['0 \(a\)'\]"
    ) as error:
        p.check()
    assert "2 blocks in use + 15 free != 16 blocks" in str(error.value)  # 2 used, 14 + 1 free
    p._free.remove(a.blocks[0])
    a.length = 9  # corrupt: more written than reserved
    with pytest.raises(KVInvariantError, match=r"segment 0 \(a\): length 9, capacity 8"):
        p.check()
    a.length = 0
    p.check()
    p.release(a)
    p.release(b)
    p.check({})
    assert p.free_blocks == 16
