"""Unified KV memory: one preallocated, paged pool for every task of every frame.

The pool holds backbone keys/values for all layers in fixed-size blocks. A *segment* is a list of
blocks with a reference count:

* a frame's prefix (images + prompt) is written into one segment exactly once; the action expert and
  every language request of that frame read it through references, never copies;
* a language request owns one more segment for its own tokens (kind text + generated tokens),
  reserved at admission for its maximum length so decoding can never run out of memory midway.

A segment returns its blocks to the free list when its last reference is released. Reads are either
zero-copy views (a contiguous segment, the action path) or a per-step gather of several segments
into a padded batch (ragged language decoding); the gather is scratch compute memory, the stored KV
is never duplicated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from ..model.mot import KVContext


class KVMemoryError(RuntimeError):
    """The pool has not enough free blocks for an allocation."""


class KVInvariantError(RuntimeError):
    """`KVPool.check` found the pool's bookkeeping broken (a leak, a double owner, a bad count)."""


@dataclasses.dataclass(eq=False)
class KVSegment:
    """Blocks holding one run of tokens. ``length`` tokens are written, ``capacity`` reserved."""

    segment_id: int
    owner: str
    blocks: list[int]
    capacity: int
    length: int = 0
    ref_count: int = 1
    # Pool slot of each reserved token, in order (host int64): reads and writes index it directly.
    slot_table: np.ndarray = dataclasses.field(
        default_factory=lambda: np.zeros(0, dtype=np.int64), repr=False
    )


class KVPool:
    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        capacity_tokens: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        scratch_tokens: int = 0,
    ) -> None:
        """scratch_tokens: extra slots after the managed blocks, outside all accounting, where
        fixed-shape steps (``engine.static_paths``) send the K/V of their padding tokens."""
        if capacity_tokens < block_size or block_size < 1:
            raise ValueError(
                f"KV pool needs capacity >= block size >= 1, got {capacity_tokens=} {block_size=}"
            )
        if scratch_tokens < 0:
            raise ValueError(f"scratch_tokens must be >= 0, got {scratch_tokens}")
        self.block_size = block_size
        self.num_blocks = capacity_tokens // block_size
        slots = self.num_blocks * block_size
        self.scratch_start = slots
        self.scratch_tokens = scratch_tokens
        self.keys = torch.zeros(
            num_layers, slots + scratch_tokens, kv_heads, head_dim, dtype=dtype, device=device
        )
        self.values = torch.zeros_like(self.keys)
        self.bytes_per_token = 2 * num_layers * kv_heads * head_dim * self.keys.element_size()
        # kept sorted: lowest ids first -> contiguous runs
        self._free = list(range(self.num_blocks))
        self._segments: dict[int, KVSegment] = {}
        self._next_id = 0
        self.peak_bytes = 0

    # -- accounting ----------------------------------------------------------------------------
    def reset_peak(self) -> None:
        """Count the peak afresh from the bytes in use now (after a warm-up, say)."""
        self.peak_bytes = self.bytes_in_use

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def bytes_in_use(self) -> int:
        return (self.num_blocks - len(self._free)) * self.block_bytes

    @property
    def free_bytes(self) -> int:
        return len(self._free) * self.block_bytes

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def segment_bytes(self, segment: KVSegment) -> int:
        return len(segment.blocks) * self.block_bytes

    def usage_by_owner(self) -> dict[str, int]:
        """Bytes reserved per live segment owner (e.g. ``frame 12 prefix``, ``request 3``)."""
        return {s.owner: self.segment_bytes(s) for s in self._segments.values()}

    @property
    def live_segments(self) -> int:
        return len(self._segments)

    # -- allocation ----------------------------------------------------------------------------
    def allocate(self, tokens: int, owner: str) -> KVSegment:
        """Reserve blocks for ``tokens`` tokens (one reference held by the caller).

        Prefers a contiguous run of blocks so the segment can later be read as a zero-copy view.
        Raises KVMemoryError when the pool cannot hold it.
        """
        need = self.blocks_for(max(tokens, 1))
        if need > len(self._free):
            raise KVMemoryError(
                f"KV pool full: {owner} needs {need} blocks ({tokens} tokens), {len(self._free)} "
                f"of {self.num_blocks} free"
            )
        blocks = self._take_contiguous(need) or self._take_lowest(need)
        table = (
            np.asarray(blocks, dtype=np.int64)[:, None] * self.block_size
            + np.arange(self.block_size)
        ).reshape(-1)
        segment = KVSegment(
            self._next_id, owner, blocks, capacity=need * self.block_size, slot_table=table
        )
        self._next_id += 1
        self._segments[segment.segment_id] = segment
        self.peak_bytes = max(self.peak_bytes, self.bytes_in_use)
        return segment

    def _take_contiguous(self, need: int) -> list[int] | None:
        """The first ``need`` blocks of the first run of consecutive free blocks that has them,
        taken from the (sorted) free list; None when no run is long enough. Stops as soon as a run
        is long enough, so a mostly free pool is not scanned to its end."""
        free = self._free
        run_start = 0
        for i in range(len(free)):
            if i > run_start and free[i] != free[i - 1] + 1:
                run_start = i
            if i + 1 - run_start == need:
                blocks = free[run_start : i + 1]
                del free[run_start : i + 1]
                return blocks
        return None

    def _take_lowest(self, need: int) -> list[int]:
        blocks, self._free = self._free[:need], self._free[need:]
        return blocks

    def retain(self, segment: KVSegment) -> KVSegment:
        """Take one more reference to a live segment (a task starts reading it)."""
        assert segment.ref_count > 0 and segment.segment_id in self._segments, (
            "retain of a freed segment"
        )
        segment.ref_count += 1
        return segment

    def release(self, segment: KVSegment) -> bool:
        """Drop one reference; returns True when this freed the segment's blocks."""
        assert segment.ref_count > 0 and segment.segment_id in self._segments, (
            "double release of a KV segment"
        )
        segment.ref_count -= 1
        if segment.ref_count:
            return False
        del self._segments[segment.segment_id]
        self._free.extend(segment.blocks)
        self._free.sort()
        return True

    def segments(self) -> list[KVSegment]:
        """The live segments, oldest first."""
        return list(self._segments.values())

    def check(self, expected_refs: Mapping[int, int] | None = None) -> None:
        """Verify the pool's invariants; raise KVInvariantError naming every offending segment.

        Always checked: each live segment has ref_count >= 1, length <= capacity = its blocks'
        slots; no block belongs to two segments or is both in use and free; blocks in use plus free
        blocks equal the pool's blocks. With ``expected_refs`` (segment id -> references its caller
        knows of, e.g. the engine's live frame and requests), every live segment must be listed with
        exactly that count and every listed one must be live: a segment nobody owns is a leak.
        """
        problems: list[str] = []
        owner_of: dict[int, KVSegment] = {}
        for seg in self._segments.values():
            name = f"segment {seg.segment_id} ({seg.owner})"
            if seg.ref_count < 1:
                problems.append(f"{name}: ref_count {seg.ref_count} < 1")
            if (
                not 0 <= seg.length <= seg.capacity
                or seg.capacity != len(seg.blocks) * self.block_size
            ):
                problems.append(
                    f"{name}: length {seg.length}, capacity {seg.capacity} for {len(seg.blocks)} "
                    "blocks"
                )
            for block in seg.blocks:
                other = owner_of.setdefault(block, seg)
                if other is not seg:
                    problems.append(
                        f"{name}: block {block} also in segment {other.segment_id} ({other.owner})"
                    )
        free = set(self._free)
        if len(free) != len(self._free):
            problems.append("free list holds a block twice")
        both = sorted(free & set(owner_of))
        if both:
            names = sorted({f"{owner_of[b].segment_id} ({owner_of[b].owner})" for b in both})
            problems.append(f"blocks {both[:8]} are both free and in segments {names}")
        if len(owner_of) + len(free) != self.num_blocks:
            problems.append(
                f"{len(owner_of)} blocks in use + {len(free)} free != {self.num_blocks} blocks"
            )
        if expected_refs is not None:
            for seg in self._segments.values():
                want = expected_refs.get(seg.segment_id)
                if want is None:
                    problems.append(
                        f"segment {seg.segment_id} ({seg.owner}) is live but owned by no live "
                        "frame or request"
                    )
                elif want != seg.ref_count:
                    problems.append(
                        f"segment {seg.segment_id} ({seg.owner}): ref_count {seg.ref_count}, "
                        f"{want} known references"
                    )
            gone = sorted(set(expected_refs) - set(self._segments))
            if gone:
                problems.append(f"segments {gone} are referenced but already freed")
        if problems:
            raise KVInvariantError("KV pool invariants broken: " + "; ".join(problems))

    # -- data ----------------------------------------------------------------------------------
    def slots(self, segment: KVSegment, start: int, stop: int) -> Tensor:
        """Pool slot index of the segment's tokens [start, stop)."""
        return torch.from_numpy(segment.slot_table[start:stop]).to(self.keys.device)

    def host_slots(self, segment: KVSegment, start: int, stop: int) -> np.ndarray:
        """`slots` on the host (int64 numpy): for packing into a fixed-shape step's inputs."""
        return segment.slot_table[start:stop]

    def scratch_slots(self, count: int, offset: int = 0) -> np.ndarray:
        """``count`` scratch slots (cycling when count > scratch_tokens): where padding K/V goes."""
        if not self.scratch_tokens:
            raise ValueError("this KV pool has no scratch slots (build it with scratch_tokens > 0)")
        return self.scratch_start + (np.arange(offset, offset + count) % self.scratch_tokens)

    def next_slots(self, segment: KVSegment, tokens: int) -> np.ndarray:
        """Slot ids of the segment's next ``tokens`` unwritten tokens, for a write done elsewhere
        (inside a fixed-shape step); nothing is counted as written until `claim`.

        Raises KVMemoryError when they pass the segment's reserved capacity.
        """
        if segment.length + tokens > segment.capacity:
            raise KVMemoryError(
                f"{segment.owner}: writing {tokens} tokens past its reserved {segment.capacity}"
            )
        return self.host_slots(segment, segment.length, segment.length + tokens)

    def claim(self, segment: KVSegment, tokens: int) -> None:
        """Count the segment's next ``tokens`` slots (see `next_slots`) as written: call it only
        once the step that wrote them succeeded, so a failed step leaves no half-written length.

        Raises KVMemoryError past the reserved capacity.
        """
        if segment.length + tokens > segment.capacity:
            raise KVMemoryError(
                f"{segment.owner}: writing {tokens} tokens past its reserved {segment.capacity}"
            )
        segment.length += tokens

    def write(self, segment: KVSegment, keys: Sequence[Tensor], values: Sequence[Tensor]) -> None:
        """Append tokens to a segment: keys/values per layer, each [T, KVH, D]."""
        t = keys[0].shape[0]
        if segment.length + t > segment.capacity:
            raise KVMemoryError(
                f"{segment.owner}: writing {t} tokens past its reserved {segment.capacity}"
            )
        idx = self.slots(segment, segment.length, segment.length + t)
        for layer, (k, v) in enumerate(zip(keys, values, strict=False)):
            self.keys[layer].index_copy_(0, idx, k.to(self.keys.dtype))
            self.values[layer].index_copy_(0, idx, v.to(self.values.dtype))
        segment.length += t

    def append_one(
        self, segments: Sequence[KVSegment], keys: Sequence[Tensor], values: Sequence[Tensor]
    ) -> None:
        """Append one token to each segment in a single write per layer (a batched decode step).

        keys/values per layer [B, KVH, D], row i belonging to ``segments[i]``.
        """
        for segment in segments:
            if segment.length + 1 > segment.capacity:
                raise KVMemoryError(
                    f"{segment.owner}: writing past its reserved {segment.capacity} tokens"
                )
        idx = torch.cat([self.slots(seg, seg.length, seg.length + 1) for seg in segments])
        for layer, (k, v) in enumerate(zip(keys, values, strict=False)):
            self.keys[layer].index_copy_(0, idx, k.to(self.keys.dtype))
            self.values[layer].index_copy_(0, idx, v.to(self.values.dtype))
        for segment in segments:
            segment.length += 1

    def view(self, segment: KVSegment) -> KVContext:
        """One segment as a batch-of-one context; zero-copy when its blocks are contiguous."""
        first = segment.blocks[0]
        contiguous = segment.blocks == list(range(first, first + len(segment.blocks)))
        if not contiguous:
            return self.gather([[(segment, segment.length)]])
        start = first * self.block_size
        stop = start + segment.length
        keys = [self.keys[layer, start:stop][None] for layer in range(self.keys.shape[0])]
        values = [self.values[layer, start:stop][None] for layer in range(self.values.shape[0])]
        valid = torch.ones(1, segment.length, dtype=torch.bool, device=self.keys.device)
        return KVContext(keys, values, valid)

    def gather(self, rows: Sequence[Sequence[tuple[KVSegment, int]]]) -> KVContext:
        """Batch context: row i is the concatenation of (segment, n_tokens) pieces, right-padded."""
        reads = [
            np.concatenate([seg.slot_table[:n] for seg, n in row]) if row else np.zeros(0, np.int64)
            for row in rows
        ]
        width = max(len(r) for r in reads)
        host_idx = np.zeros((len(rows), width), dtype=np.int64)
        host_valid = np.zeros((len(rows), width), dtype=bool)
        for i, r in enumerate(reads):  # index building stays on the host: a few numpy ops per step
            host_idx[i, : len(r)] = r
            host_valid[i, : len(r)] = True
        idx = torch.from_numpy(host_idx).to(self.keys.device)
        valid = torch.from_numpy(host_valid).to(self.keys.device)
        keys = self.keys[:, idx]  # [L, B, C, KVH, D] scratch copy for this step only
        values = self.values[:, idx]
        return KVContext(list(keys.unbind(0)), list(values.unbind(0)), valid)
