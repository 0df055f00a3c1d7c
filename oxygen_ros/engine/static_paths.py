"""Fixed-shape versions of the engine's model calls: prefill, action chunk, text step.

The eager paths (``frames``, ``language``) size every tensor to the data: the prompt's length, the
present cameras, the longest request in the batch. That is ideal on a CPU and fatal for CUDA graphs,
which replay fixed kernels on fixed addresses. Each class below owns preallocated input and output
buffers for one *shape bucket* and a ``_forward`` that reads and writes only those buffers and the
KV pool, with no host sync anywhere; `GraphedStep` runs it eagerly (CPU, tests) or captures it once
in a CUDA graph and replays it. Tests check every path against its dynamic counterpart on CPU.

The rule: this module owns buffers, buckets and graphs, never model logic. Every ``_forward``
calls the same `Pi05Model` methods the eager paths call (`Pi05Model.embed_present_images`,
`Pi05Model.prefix_forward`, `Pi05Model.denoise`, `Pi05Model.forward_text`), handing them padded
buffers, explicit validity masks and positions and ``dense_mask=False``; what stays here is
gathering K/V from the pool by slot index, writing new K/V to it and picking the last valid row.
The static paths run when ``EngineConfig.static_shapes`` or ``cuda_graphs`` is set (the GPU
setting); the eager paths run otherwise (the CPU default) and whenever a frozen runner has no
captured bucket for a shape. Both stay because neither is within 10% of the other everywhere on a
CPU (see docs/gpu.md for the measurements).

* `StaticPrefill` (present image slots, prompt bucket): SigLIP on the present slots only (a static
  slot list, so no ``nonzero``), the backbone over [images, prompt padded to the bucket] with an
  explicit mask, and the K/V written straight into the frame's pool segment *inside* the step:
  valid columns go to the segment's slots, padding columns to the pool's scratch slots. The prefix
  is thus written once, where every task reads it, with no staging copy.
* `StaticActionChunk` (context bucket, steps, chunk kind): gathers the prefix K/V from the pool by
  slot index, then runs all flow-matching Euler steps on a precomputed float32 time schedule.
  Reading the pool (not the prefill's outputs) keeps the chunk independent of which prefill bucket
  wrote the prefix, gives prefill and chunk separate timings, and lets baselines replay a prefill
  alone. The kind is a plain chunk or one continuing the previous chunk (real-time chunking):
  identity guidance or training-time RTC, whose previous-chunk, weight and frozen-step buffers
  carry the delay as data (one graph for every delay). VJP guidance needs a backward pass and stays
  on the eager path.
* `StaticTextStep` (batch bucket B, new-token bucket T, context bucket C): gathers each row's
  context (frame prefix + its own tokens, any frames) from the pool by slot index, runs T new tokens
  per row, writes their K/V into the pool (``index_copy_``) and produces logits of each row's last
  new token and the greedy token. T = 1 is the decode step; T > 1 prefills a kind's prompt text at
  admission. Padding rows feed token 0 from an empty context and write to scratch: harmless.

All integer inputs of a step are packed into one int64 buffer (one upload per call) and masks are
derived from lengths on the device. `StaticRunner` owns the buckets of one KV pool, packs inputs on
the host, uploads them through pinned memory, and creates (and on CUDA captures) a bucket on first
use or in `StaticRunner.warm_up`. After `StaticRunner.freeze` (the engines freeze after their
warm-up) no bucket is created any more: a shape not captured then runs on the nearest larger
captured bucket, or the caller's eager path when none fits, so no capture stalls a real-time frame.

Slots written inside a step are counted as written (`KVPool.claim`) only after the step ran, so
a failed step leaves every segment's length as it was.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from ..model.mot import KVContext
from ..model.pi05 import Pi05Model
from ..model.rtc import RTCGuidance, TrainedPrefix
from ..policy_io.policy import Pi05Policy
from .cuda_graphs import GraphedStep, HostStager, new_graph_pool
from .faults import NO_FAULTS, FaultInjector, tag_stage
from .kv_cache import KVPool, KVSegment
from .types import Observation

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
GraphPool = tuple[int, int] | None


def round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n; ValueError when n exceeds the largest."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


def prompt_buckets(max_token_len: int) -> tuple[int, ...]:
    """Powers of two from 16 below max_token_len, then max_token_len (pi05: 16 32 64 128 200)."""
    buckets = [b for b in (16, 32, 64, 128, 256, 512, 1024) if b < max_token_len]
    return tuple(buckets) + (max_token_len,)


class PackedInts:
    """Named int64 inputs of one step in one device buffer, mirrored by a host array to fill."""

    def __init__(self, fields: Sequence[tuple[str, tuple[int, ...]]], device: torch.device) -> None:
        sizes = [math.prod(shape) for _, shape in fields]
        self.host = np.zeros(sum(sizes), dtype=np.int64)
        self.device = torch.zeros(sum(sizes), dtype=torch.int64, device=device)
        self.views: dict[str, Tensor] = {}
        self.host_views: dict[str, np.ndarray] = {}
        start = 0
        for (name, shape), size in zip(fields, sizes, strict=True):
            self.views[name] = self.device[start : start + size].view(shape)
            self.host_views[name] = self.host[start : start + size].reshape(shape)
            start += size

    def __getitem__(self, name: str) -> Tensor:
        return self.views[name]


class _LayerGather(collections.abc.Sequence):
    """``source[layer][index]`` computed when a layer asks for it, so a text step holds one layer's
    gathered context at a time instead of all of them."""

    def __init__(self, source: Tensor, index: Tensor) -> None:
        self.source, self.index = source, index

    def __len__(self) -> int:
        return self.source.shape[0]

    def __getitem__(self, layer: int) -> Tensor:  # type: ignore[override]
        return self.source[layer][self.index]


class _StaticStep:
    """Buffers + a sync-free ``_forward`` + the graph wrapper.

    ``_forward`` only moves data between the buffers, the model's methods and the pool; the model
    computation itself is `Pi05Model`'s, the same the eager paths run.
    """

    def __init__(
        self, model: Pi05Model, pool: KVPool, use_graph: bool, graph_pool: GraphPool
    ) -> None:
        self.model = model
        self.pool = pool
        self.device = pool.keys.device
        self.step = GraphedStep(self._forward, self.device, use_graph, graph_pool)

    def __call__(self) -> None:
        self.step()

    def _forward(self) -> None:
        raise NotImplementedError

    def fill_padding(self) -> None:
        """Fill the host inputs with harmless values: every row reads and writes scratch slots only.
        A call then overwrites the rows it uses; warm-up runs the step on this alone."""
        raise NotImplementedError

    def _write_kv(self, keys: Sequence[Tensor], values: Sequence[Tensor], slots: Tensor) -> None:
        """Write per-layer new K/V [B, T, KVH, D] to pool ``slots`` [B * T] (all layers, one op)."""
        pool = self.pool
        k = torch.stack(list(keys)).flatten(1, 2).to(pool.keys.dtype)  # [L, B*T, KVH, D]
        v = torch.stack(list(values)).flatten(1, 2).to(pool.values.dtype)
        pool.keys.index_copy_(1, slots, k)
        pool.values.index_copy_(1, slots, v)


class StaticPrefill(_StaticStep):
    """Prefix of one observation with the image slots ``slots`` present and the prompt padded to
    ``prompt_len``: S = len(slots) * image_tokens + prompt_len columns, K/V written to the pool."""

    def __init__(
        self,
        model: Pi05Model,
        pool: KVPool,
        images: Tensor,
        slots: tuple[int, ...],
        prompt_len: int,
        use_graph: bool,
        graph_pool: GraphPool,
    ) -> None:
        cfg = model.config
        self.slots = slots
        self.prompt_len = prompt_len
        self.image_columns = len(slots) * cfg.image_tokens
        self.columns = self.image_columns + prompt_len
        device = pool.keys.device
        self.images = images  # [n_present, 3, size, size] float32 in [-1, 1], shared per slot set
        self.inputs = PackedInts(
            [
                ("tokens", (1, prompt_len)),
                ("write", (self.columns,)),
                ("n_tokens", (1,)),
                ("causal_from", (1,)),
            ],
            device,
        )
        self._token_index = torch.arange(prompt_len, device=device)
        self._image_valid = torch.ones(1, self.image_columns, dtype=torch.bool, device=device)
        self._image_causal = torch.zeros_like(self._image_valid)  # images are never causal
        super().__init__(model, pool, use_graph, graph_pool)

    def fill_padding(self) -> None:
        host = self.inputs.host_views
        host["tokens"][:] = 0
        host["write"][:] = self.pool.scratch_slots(self.columns)
        host["n_tokens"][0] = self.prompt_len
        host["causal_from"][0] = self.prompt_len

    def _forward(self) -> None:
        model = self.model
        image_emb = model.embed_present_images(self.images).reshape(1, self.image_columns, -1)
        embs = torch.cat([image_emb, model.embed_tokens(self.inputs["tokens"])], dim=1)
        # the prompt's padding is at its end; its ids from causal_from on are a causal tail
        prompt_valid = self._token_index[None] < self.inputs["n_tokens"][:, None]
        prompt_causal = self._token_index[None] >= self.inputs["causal_from"][:, None]
        out = model.prefix_forward(
            embs,
            torch.cat([self._image_valid, prompt_valid], dim=1),
            dense_mask=False,
            causal=torch.cat([self._image_causal, prompt_causal & prompt_valid], dim=1),
        )
        self._write_kv(out.keys, out.values, self.inputs["write"])


ChunkKind = tuple[str, float]
"""What continues an action chunk on the static path: ("plain", 0.0), ("identity", beta) or
("trained", 0.0) (see `chunk_kind`)."""

PLAIN: ChunkKind = ("plain", 0.0)


def chunk_kind(guidance: RTCGuidance | TrainedPrefix | None) -> ChunkKind | None:
    """The static chunk a guidance runs on; None for one only the eager path runs (vjp)."""
    if guidance is None:
        return PLAIN
    if isinstance(guidance, TrainedPrefix):
        return ("trained", 0.0)
    if guidance.static:
        return ("identity", float(guidance.max_guidance_weight))
    return None


class StaticActionChunk(_StaticStep):
    """Action chunk over a prefix of up to ``context`` tokens read from the pool by slot index.

    ``kind`` (`ChunkKind`): a plain chunk, or one continuing the previous chunk by identity
    guidance (target and weight buffers) or training-time RTC (target and frozen-step buffers).
    The delay and the overlap are data in those buffers, not shapes, so one captured graph serves
    every frame; `load` fills them (`fill_padding` zeroes them: a plain chunk).
    """

    def __init__(
        self,
        model: Pi05Model,
        pool: KVPool,
        context: int,
        num_steps: int,
        use_graph: bool,
        graph_pool: GraphPool,
        kind: ChunkKind = PLAIN,
    ) -> None:
        cfg = model.config
        device = pool.keys.device
        self.context = context
        self.kind = kind
        self.inputs = PackedInts([("gather", (context,)), ("n_valid", (1,))], device)
        self.noise = torch.zeros(
            1, cfg.action_horizon, cfg.action_dim, dtype=torch.float32, device=device
        )
        self.actions = torch.zeros_like(self.noise)
        # The checkpoint framework's times (openpi's float32 accumulation, or LeRobot's), every
        # step's adaRMS conditioning and time 0's (`Pi05Model.step_schedule`), in this chunk's own
        # buffers: a captured graph reads them, so `load` refreshes the conditionings in place
        # when the model remakes them. A trained prefix's frozen tokens select time 0's per step.
        self._schedule_source = model.step_schedule(num_steps, device)
        self._schedule = self._schedule_source.clone()
        self._dt = torch.tensor(-1.0 / num_steps, dtype=torch.float32, device=device)
        self._num_steps = num_steps
        self._context_index = torch.arange(context, device=device)
        # the previous chunk and its mask; built once here, so no check runs inside a capture
        self.target = torch.zeros_like(self.noise)
        self.guidance: RTCGuidance | TrainedPrefix | None = None
        if kind[0] == "identity":
            self.weights = torch.zeros(cfg.action_horizon, cfg.action_dim, device=device)
            self.guidance = RTCGuidance(self.target, self.weights, kind[1], "identity")
            self._schedule.guidance_weights(kind[1])  # made here, not inside a capture
        elif kind[0] == "trained":
            self.frozen = torch.zeros(cfg.action_horizon, dtype=torch.bool, device=device)
            self.guidance = TrainedPrefix(self.target, self.frozen)
        elif kind != PLAIN:
            raise ValueError(f"no static action chunk of kind {kind!r}")
        super().__init__(model, pool, use_graph, graph_pool)

    def fill_padding(self) -> None:
        host = self.inputs.host_views
        host["gather"][:] = self.pool.scratch_start
        host["n_valid"][0] = 1
        if self.guidance is not None:
            self.target.zero_()
            (self.weights if self.kind[0] == "identity" else self.frozen).zero_()

    def load(self, guidance: RTCGuidance | TrainedPrefix | None) -> None:
        """Copy a frame's guidance (of this bucket's kind) into the buffers, and the model's step
        conditionings if it remade them."""
        self._refresh_conditionings()
        if guidance is None:
            return
        self.target.copy_(guidance.target.reshape(self.target.shape))
        if isinstance(guidance, TrainedPrefix):
            self.frozen.copy_(guidance.frozen)
        else:
            self.weights.copy_(guidance.weights.expand_as(self.weights))

    def _refresh_conditionings(self) -> None:
        """Copy the model's step conditionings into this chunk's buffers when it has remade them
        (a weight they read changed)."""
        source = self.model.step_schedule(self._num_steps, self.device)
        if source is not self._schedule_source:
            self._schedule.copy_(source)
            self._schedule_source = source

    def _forward(self) -> None:
        pool, gather, n_valid = self.pool, self.inputs["gather"], self.inputs["n_valid"]
        keys = pool.keys[:, gather][:, None]  # [L, 1, C, KVH, D]: read once, used by every step
        values = pool.values[:, gather][:, None]
        valid = self._context_index[None] < n_valid[:, None]  # [1, C]
        context = KVContext(list(keys.unbind(0)), list(values.unbind(0)), valid)
        self.actions.copy_(
            self.model.denoise(
                context,
                n_valid,
                self.noise,
                self._schedule.times,
                self._dt,
                self.guidance,
                False,
                self._schedule,
            )
        )


class StaticTextStep(_StaticStep):
    """``batch`` rows of ``new_tokens`` text tokens over contexts of up to ``context`` pool
    slots."""

    def __init__(
        self,
        model: Pi05Model,
        pool: KVPool,
        batch: int,
        new_tokens: int,
        context: int,
        vocab_limit: int,
        use_graph: bool,
        graph_pool: GraphPool,
    ) -> None:
        device = pool.keys.device
        self.batch, self.new_tokens, self.context = batch, new_tokens, context
        self.vocab_limit = vocab_limit  # greedy picks only ids the tokenizer can decode
        self.inputs = PackedInts(
            [
                ("gather", (batch, context)),
                ("tokens", (batch, new_tokens)),
                ("write", (batch * new_tokens,)),
                ("context_len", (batch,)),
                ("new_len", (batch,)),
                ("first_pos", (batch,)),
            ],
            device,
        )
        self.logits = torch.zeros(
            batch, model.config.vocab_size, dtype=torch.float32, device=device
        )
        self.greedy = torch.zeros(batch, dtype=torch.int64, device=device)
        self._context_index = torch.arange(context, device=device)
        self._new_index = torch.arange(new_tokens, device=device)
        super().__init__(model, pool, use_graph, graph_pool)

    def fill_padding(self) -> None:
        host = self.inputs.host_views
        host["gather"][:] = self.pool.scratch_start
        host["tokens"][:] = 0
        host["write"][:] = self.pool.scratch_slots(self.batch * self.new_tokens)
        host["context_len"][:] = 0
        host["new_len"][:] = 1  # one token over an empty context, its K/V to scratch
        host["first_pos"][:] = 0

    def _forward(self) -> None:
        model, pool, x = self.model, self.pool, self.inputs
        context_valid = self._context_index[None] < x["context_len"][:, None]  # [B, C]
        context = KVContext(
            _LayerGather(pool.keys, x["gather"]),
            _LayerGather(pool.values, x["gather"]),
            context_valid,
        )
        positions = x["first_pos"][:, None] + self._new_index[None]
        new_valid = self._new_index[None] < x["new_len"][:, None]  # [B, T]
        out = model.forward_text(context, x["tokens"], positions, new_valid, dense_mask=False)
        self._write_kv(out.keys, out.values, x["write"])
        last = (x["new_len"] - 1)[:, None, None].expand(self.batch, 1, out.hidden.shape[-1])
        logits = model.logits(out.hidden.gather(1, last)[:, 0])
        self.logits.copy_(logits)
        self.greedy.copy_(logits[:, : self.vocab_limit].argmax(dim=-1))


@dataclasses.dataclass
class TextRow:
    """One request's part of a text step."""

    context: Sequence[tuple[KVSegment, int]]  # (segment, tokens) pieces read, in order
    tokens: Sequence[int]  # new tokens fed this step
    position: int  # RoPE position of the first new token
    target: KVSegment  # the new tokens' K/V are appended here


class StaticRunner:
    """The static paths of one KV pool: buckets created on first use, inputs packed and uploaded.

    Args:
        policy: the model and its tokenizer/normalisation.
        pool: the engine's KV pool; needs scratch slots (``make_pool`` adds them).
        cuda_graphs: capture every bucket in a CUDA graph (policy on a CUDA device only).
        gpu_preprocess: resize and scale images on the model's device
            (`Pi05Policy.model_image_torch`) instead of on the host (`Pi05Policy.model_image`).
        context_bucket: text and action contexts are padded to a multiple of this many tokens.
        batch_buckets: batch sizes of text steps; larger batches run in several steps.
        faults: checked ("graph_replay") before every step replayed for a frame.
    """

    def __init__(
        self,
        policy: Pi05Policy,
        pool: KVPool,
        *,
        cuda_graphs: bool = False,
        gpu_preprocess: bool = False,
        context_bucket: int = 128,
        batch_buckets: Sequence[int] = BATCH_BUCKETS,
        faults: FaultInjector = NO_FAULTS,
    ) -> None:
        device = policy.device
        if cuda_graphs and device.type != "cuda":
            raise ValueError(
                f"cuda_graphs=True needs the model on a CUDA device, but it is on {device}; "
                "use static_shapes=True alone to run the fixed-shape paths without graphs"
            )
        if pool.scratch_tokens < 1:
            raise ValueError(
                "static paths need a KV pool with scratch slots (KVPool(scratch_tokens=...))"
            )
        if context_bucket < 1 or not batch_buckets:
            raise ValueError("context_bucket must be >= 1 and batch_buckets non-empty")
        self.policy = policy
        self.model = policy.model
        self.pool = pool
        self.device = device
        self.cuda_graphs = cuda_graphs
        self.gpu_preprocess = gpu_preprocess
        self.context_bucket = context_bucket
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.prompt_buckets = prompt_buckets(policy.config.max_token_len)
        self._graph_pool = new_graph_pool(device, cuda_graphs)
        self._stager = HostStager(device)
        self._images: dict[tuple[int, ...], Tensor] = {}
        self._prefills: dict[tuple[tuple[int, ...], int], StaticPrefill] = {}
        self._actions: dict[tuple[int, int, ChunkKind], StaticActionChunk] = {}
        self._texts: dict[tuple[int, int, int], StaticTextStep] = {}
        self.faults = faults
        self.frozen = False  # set by `freeze`: no new bucket from then on
        self.captures_during_frames = 0  # buckets created while frozen (must stay 0)
        self.fallbacks = 0  # frame steps that found no captured bucket and ran eagerly

    def freeze(self) -> None:
        """From now on create no bucket: shapes not captured use the nearest larger captured
        bucket, or the eager path (the `prefill` / `act` / `text` calls return None)."""
        self.frozen = True

    # -- buckets ---------------------------------------------------------------------------------
    @property
    def paths(self) -> list[_StaticStep]:
        """Every bucket created so far (prefills, action chunks, text steps)."""
        return [*self._prefills.values(), *self._actions.values(), *self._texts.values()]

    @property
    def num_paths(self) -> int:
        return len(self._prefills) + len(self._actions) + len(self._texts)

    @property
    def text_buckets(self) -> list[tuple[int, int, int]]:
        """(batch, new tokens, context) of the text steps created so far."""
        return sorted(self._texts)

    def _image_buffer(self, slots: tuple[int, ...]) -> Tensor:
        if slots not in self._images:
            size = self.policy.config.vision.image_size
            self._images[slots] = torch.zeros(
                len(slots), 3, size, size, dtype=torch.float32, device=self.device
            )
        return self._images[slots]

    def _created(self) -> None:
        if self.frozen:
            self.captures_during_frames += 1

    def prefill_path(self, slots: tuple[int, ...], prompt_len: int) -> StaticPrefill:
        """The prefill bucket of these image slots and prompt length (created when missing)."""
        key = (slots, bucket_for(prompt_len, self.prompt_buckets))
        if key not in self._prefills:
            self._created()
            images = self._image_buffer(slots)
            self._prefills[key] = StaticPrefill(
                self.model, self.pool, images, slots, key[1], self.cuda_graphs, self._graph_pool
            )
        return self._prefills[key]

    def action_path(
        self, prefix_len: int, num_steps: int, kind: ChunkKind = PLAIN
    ) -> StaticActionChunk:
        """The action bucket of this prefix length, step count and chunk kind (created when
        missing)."""
        key = (round_up(prefix_len, self.context_bucket), num_steps, kind)
        if key not in self._actions:
            self._created()
            self._actions[key] = StaticActionChunk(
                self.model, self.pool, key[0], num_steps, self.cuda_graphs, self._graph_pool, kind
            )
        return self._actions[key]

    def text_path(self, batch: int, new_tokens: int, context: int) -> StaticTextStep:
        """The text bucket of this batch, new-token count and context (created when missing)."""
        key = (
            bucket_for(batch, self.batch_buckets),
            next_power_of_two(new_tokens),
            round_up(context, self.context_bucket),
        )
        if key not in self._texts:
            self._created()
            vocab = min(self.policy.tokenizer.vocab_size, self.model.config.vocab_size)
            self._texts[key] = StaticTextStep(
                self.model, self.pool, *key, vocab, self.cuda_graphs, self._graph_pool
            )
        return self._texts[key]

    # A frame's lookups: before `freeze` as above; after, the smallest captured bucket that holds
    # the
    # shape, or None (the caller runs its eager path).
    def _frame_prefill(self, slots: tuple[int, ...], prompt_len: int) -> StaticPrefill | None:
        if not self.frozen:
            return self.prefill_path(slots, prompt_len)
        fits = [p for (s, n), p in self._prefills.items() if s == slots and n >= prompt_len]
        return self._counted(min(fits, key=lambda p: p.prompt_len) if fits else None)

    def _frame_action(
        self, prefix_len: int, num_steps: int, kind: ChunkKind
    ) -> StaticActionChunk | None:
        if not self.frozen:
            return self.action_path(prefix_len, num_steps, kind)
        fits = [
            p
            for (c, n, k), p in self._actions.items()
            if n == num_steps and k == kind and c >= prefix_len
        ]
        return self._counted(min(fits, key=lambda p: p.context) if fits else None)

    def _frame_text(self, batch: int, new_tokens: int, context: int) -> StaticTextStep | None:
        if not self.frozen:
            return self.text_path(batch, new_tokens, context)
        if batch <= self.batch_buckets[-1]:
            key = (
                bucket_for(batch, self.batch_buckets),
                next_power_of_two(new_tokens),
                round_up(context, self.context_bucket),
            )
            if key in self._texts:
                return self._texts[key]
        fits = [
            p
            for (b, t, c), p in self._texts.items()
            if b >= batch and t >= new_tokens and c >= context
        ]
        return self._counted(
            min(fits, key=lambda p: p.batch * p.new_tokens * p.context) if fits else None
        )

    def _counted(self, path):
        if path is None:
            self.fallbacks += 1
        return path

    def _replay(self, path: _StaticStep) -> None:
        """Run one bucket for a frame (the fault point of every replay)."""
        try:
            self.faults.check("graph_replay")
            path()
        except BaseException as error:
            tag_stage(error, "graph_replay")
            raise

    def _upload(self, name: str, packed: PackedInts) -> None:
        self._stager.upload(name, packed.host, packed.device)

    def synchronize(self) -> None:
        """Wait for the device (CUDA) so that host timings attribute work to the right phase."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    # -- prefill -----------------------------------------------------------------------------------
    def stage_images(self, observation: Observation) -> tuple[int, ...]:
        """Preprocess and upload the observation's images into the buffer of its slot set."""
        images = self.policy.slot_images(observation.images)
        slots = tuple(slot for slot, _ in images)
        buffer = self._image_buffer(slots)
        if self.gpu_preprocess:
            for i, (_, image) in enumerate(images):
                raw = self._stager.to_device(f"raw {i}", np.asarray(image))
                self.policy.model_image_torch(raw, out=buffer[i : i + 1])
        else:  # the host path (openpi's PIL resize, or LeRobot's), one pinned upload
            pixels = np.stack([self.policy.model_image(image) for _, image in images])
            self._stager.upload(f"images {slots}", pixels, buffer)
        return slots

    def prefill(
        self,
        observation: Observation,
        owner: str,
        ids: Sequence[int] | None = None,
        causal_from: int | None = None,
    ) -> KVSegment | None:
        """Encode an observation into a new pool segment (one reference, held by the caller).

        ids: the prompt's token ids (default: openpi's action prompt of the observation).
        causal_from: index of the first id of a causal tail (None: every id is bidirectional).
        Returns the segment; None when frozen with no captured bucket for its cameras and prompt
        (run the eager prefill). On an exception the segment is released.
        """
        slots = self.policy.present_slots(observation.images)
        if ids is None:
            ids = self.policy.frame_prompt(observation.state, observation.prompt).ids
        tokens = np.asarray(ids, dtype=np.int64)
        n_tokens = len(tokens)
        path = self._frame_prefill(slots, n_tokens)
        if path is None:
            return None
        self.stage_images(observation)
        n_valid = path.image_columns + n_tokens
        segment = self.pool.allocate(n_valid, owner)
        try:
            path.fill_padding()
            host = path.inputs.host_views
            host["tokens"][0, :n_tokens] = tokens[:n_tokens]
            host["write"][:n_valid] = self.pool.next_slots(segment, n_valid)
            host["n_tokens"][0] = n_tokens
            host["causal_from"][0] = n_tokens if causal_from is None else causal_from
            self._upload("prefill", path.inputs)
            self._replay(path)
            self.pool.claim(segment, n_valid)
        except BaseException:
            self.pool.release(segment)
            raise
        return segment

    # -- actions -----------------------------------------------------------------------------------
    def act(
        self,
        prefix: KVSegment,
        noise: Tensor,
        num_steps: int,
        guidance: RTCGuidance | TrainedPrefix | None = None,
    ) -> Tensor | None:
        """Denoise an action chunk over ``prefix`` (read from the pool): [horizon, action_dim] fp32,
        continuing the previous chunk by ``guidance`` (identity or trained; see `chunk_kind`).
        None when frozen with no captured bucket that holds the prefix (run the eager chunk).

        Raises:
            ValueError: a guidance no static chunk runs (vjp: the caller runs it eagerly).
        """
        kind = chunk_kind(guidance)
        if kind is None:
            raise ValueError("vjp guidance runs on the eager path only")
        n_valid = prefix.length
        path = self._frame_action(n_valid, num_steps, kind)
        if path is None:
            return None
        path.fill_padding()
        host = path.inputs.host_views
        host["gather"][:n_valid] = self.pool.host_slots(prefix, 0, n_valid)
        host["n_valid"][0] = n_valid
        self._upload("action", path.inputs)
        path.noise.copy_(noise.reshape(path.noise.shape))
        path.load(guidance)
        self._replay(path)
        return path.actions[0].clone()

    # -- text --------------------------------------------------------------------------------------
    def text(
        self, rows: Sequence[TextRow], want_logits: Sequence[bool] | None = None
    ) -> tuple[np.ndarray, dict[int, Tensor]] | None:
        """Feed each row's new tokens, append their K/V to the row's target segment.

        Returns the greedy next token of every row (host int64 [rows]) and float32 logits [vocab]
        of the rows flagged in ``want_logits`` (for sampling with a temperature); None (nothing
        run) when frozen with no captured bucket for some chunk of the rows (run the eager step).
        """
        pool = self.pool
        chunks = []
        for start, chunk in self._chunks(rows):
            reads = [
                np.concatenate([pool.host_slots(seg, 0, n) for seg, n in row.context])
                for row in chunk
            ]
            path = self._frame_text(
                len(chunk), max(len(r.tokens) for r in chunk), max(len(r) for r in reads)
            )
            if path is None:
                return None
            chunks.append((start, chunk, reads, path))
        greedy = np.zeros(len(rows), dtype=np.int64)
        logits: dict[int, Tensor] = {}
        for start, chunk, reads, path in chunks:
            self._run_text(path, chunk, reads)
            greedy[start : start + len(chunk)] = path.greedy[: len(chunk)].cpu().numpy()
            for i in range(len(chunk)):
                if want_logits is not None and want_logits[start + i]:
                    logits[start + i] = path.logits[i].clone()
        return greedy, logits

    def _chunks(self, rows: Sequence[TextRow]) -> Iterator[tuple[int, Sequence[TextRow]]]:
        largest = self.batch_buckets[-1]
        for start in range(0, len(rows), largest):
            yield start, rows[start : start + largest]

    def _run_text(
        self, path: StaticTextStep, rows: Sequence[TextRow], reads: Sequence[np.ndarray]
    ) -> None:
        pool = self.pool
        path.fill_padding()  # the rows past len(rows) stay padding
        host = path.inputs.host_views
        t = path.new_tokens
        for i, (row, read) in enumerate(zip(rows, reads, strict=True)):
            n = len(row.tokens)
            host["gather"][i, : len(read)] = read
            host["context_len"][i] = len(read)
            host["tokens"][i, :n] = row.tokens
            host["new_len"][i] = n
            host["first_pos"][i] = row.position
            host["write"][i * t : i * t + n] = pool.next_slots(row.target, n)
        self._upload("text", path.inputs)
        self._replay(path)
        for row in rows:  # written: count them only now
            pool.claim(row.target, len(row.tokens))

    # -- capture ahead of time
    # -----------------------------------------------------------------------
    def warm_up(
        self,
        observation: Observation,
        *,
        num_steps: int | None,
        max_batch: int = 0,
        text_tokens: int = 0,
        attach_tokens: Sequence[int] = (),
        chunk_kinds: Sequence[ChunkKind] = (PLAIN,),
        prompt_lengths: Sequence[int] = (),
    ) -> int:
        """Create (and on CUDA capture) the buckets a workload like ``observation`` will use, so no
        capture lands inside a real-time frame: every bucket runs once on harmless inputs that read
        and write only scratch slots. Returns the number of buckets created.

        num_steps: the action chunk's steps (None: this runner only prefills). chunk_kinds: the
        chunks a frame may continue with (`chunk_kind`). max_batch: the most concurrent text
        rows. text_tokens: tokens a request appends after admission (its prompt
        plus generated ones). attach_tokens: lengths of the kind prompts prefilled at admission.
        prompt_lengths: the shortest and longest frame prompts (default: openpi's action prompt
        of ``observation``); every prompt bucket between them is created, with its action chunks.
        """
        before = self.num_paths
        frozen, self.frozen = self.frozen, False  # creating buckets here is what warm-up is for
        slots = self.policy.present_slots(observation.images)
        if not prompt_lengths:
            _, mask = self.policy.prompt_tokens(observation.state, observation.prompt)
            prompt_lengths = (int(mask.sum()),)
        shortest, longest = min(prompt_lengths), max(prompt_lengths)
        first, last = (bucket_for(n, self.prompt_buckets) for n in (shortest, longest))
        buckets = [b for b in self.prompt_buckets if first <= b <= last]
        for bucket in buckets:
            prefill = self.prefill_path(slots, bucket)
            self._run_padding("prefill", prefill)
        image_columns = prefill.image_columns
        if num_steps is not None:
            prompts = {shortest} | {min(b, longest) for b in buckets}
            for context in sorted(
                {round_up(image_columns + n, self.context_bucket) for n in prompts}
            ):
                for kind in chunk_kinds:
                    self._run_padding("action", self.action_path(context, num_steps, kind))
        n_valid = image_columns + shortest
        if max_batch > 0:
            top = bucket_for(min(max_batch, self.batch_buckets[-1]), self.batch_buckets)
            batches = [b for b in self.batch_buckets if b <= top]
            step = self.context_bucket
            widest = image_columns + longest + text_tokens
            contexts = range(round_up(n_valid, step), round_up(widest, step) + 1, step)
            shapes = {(b, 1, c) for b in batches for c in contexts}
            # admissions come a few at a time; a larger burst captures its bucket when it happens
            shapes |= {(b, k, n_valid) for b in batches if b <= 4 for k in attach_tokens}
            for batch, new_tokens, context in sorted(shapes):
                self._run_padding("text", self.text_path(batch, new_tokens, context))
        self.synchronize()
        self.frozen = frozen
        return self.num_paths - before

    def _run_padding(self, name: str, path: _StaticStep) -> None:
        """Run a bucket once on its padding inputs (scratch slots only): creates / captures it."""
        path.fill_padding()
        self._upload(name, path.inputs)
        path()
