"""The CUDA-graph layer of the static paths, and pinned-memory host-to-device staging.

A `GraphedStep` wraps a function that reads fixed input buffers and writes fixed output buffers
(see ``static_paths``). Eager by default, which is how CPU runs and tests it. With ``use_graph`` it
captures the function once, on first call, with PyTorch's standard recipe (a few warm-up runs on a
side stream so lazy cuBLAS/cuDNN/allocator state exists, then ``torch.cuda.graph``) and replays
the graph from then on: one launch instead of thousands of kernels.

Rules the wrapped function must keep (the static paths do): no host syncs (``.item()``, ``bool()``
of a tensor, ``nonzero``, data-dependent shapes), no new host-to-device copies, no RNG, every input
read from and every result written into tensors that outlive the capture. Whatever the function
writes must be the same for a repeated run on the same inputs (warm-up runs execute it for real).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

# One capture at a time in the process: two threads capturing at once (the naive-parallel baseline
# runs an action and a language worker) would interleave their work into each other's graphs.
_CAPTURE_LOCK = threading.Lock()


class GraphedStep:
    """Run ``fn`` eagerly, or capture it once into a CUDA graph and replay it."""

    def __init__(
        self,
        fn: Callable[[], None],
        device: torch.device,
        use_graph: bool,
        pool: tuple[int, int] | None = None,
        warmup: int = 2,
    ) -> None:
        if use_graph and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.fn = fn
        self.device = device
        self.use_graph = use_graph
        self.pool = pool  # graphs of one runner share a memory pool: they never run concurrently
        self.warmup = warmup
        self.graph: torch.cuda.CUDAGraph | None = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def __call__(self) -> None:
        if not self.use_graph:
            with torch.no_grad():
                self.fn()
            return
        if self.graph is None:
            self._capture()
        self.graph.replay()

    def _capture(self) -> None:
        with _CAPTURE_LOCK, torch.cuda.device(self.device), torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(self.warmup):
                    self.fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA calls (naive-parallel's second worker) are not
            # errors for this capture; the lock above keeps captures themselves apart.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self.fn()
            self.graph = graph


def new_graph_pool(device: torch.device, use_graph: bool) -> tuple[int, int] | None:
    """A private memory pool for a family of graphs that replay one after another, never at once."""
    return torch.cuda.graph_pool_handle() if use_graph and device.type == "cuda" else None


class HostStager:
    """Copies host data into device buffers through reusable pinned buffers, without blocking.

    On CUDA the copy is ``non_blocking`` from page-locked memory, so the host can go on (tokenize,
    pack the next inputs) while the DMA runs; a pinned buffer is reused only after its previous copy
    has finished (an event per buffer). On CPU it is a plain copy.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda"
        self._buffers: dict[
            tuple[str, tuple[int, ...], torch.dtype], tuple[Tensor, torch.cuda.Event | None]
        ] = {}

    def _buffer(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        slot = (key, shape, dtype)
        if slot not in self._buffers:
            self._buffers[slot] = (torch.empty(shape, dtype=dtype, pin_memory=self.pinned), None)
        buffer, event = self._buffers[slot]
        if event is not None:
            event.synchronize()  # its last upload must be done before the host overwrites it
        return buffer

    def upload(self, key: str, host: np.ndarray, dst: Tensor) -> Tensor:
        """Copy the host array ``host`` (as many elements as ``dst``) into the tensor ``dst``.

        ``key`` names the pinned buffer to reuse (one per key and shape).
        """
        host = np.asarray(host)
        if not self.pinned:  # CPU: straight into the destination
            # torch warns on read-only arrays
            source = host if host.flags.writeable else host.copy()
            dst.copy_(torch.from_numpy(np.ascontiguousarray(source)).reshape(dst.shape))
            return dst
        shape = tuple(host.shape)
        dtype = torch.from_numpy(np.empty(0, dtype=host.dtype)).dtype
        buffer = self._buffer(key, shape, dtype)
        np.copyto(buffer.numpy(), host)
        dst.copy_(buffer.reshape(dst.shape), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._buffers[(key, shape, dtype)] = (buffer, event)
        return dst

    def to_device(self, key: str, host: np.ndarray) -> Tensor:
        """A new device tensor holding ``host`` (pinned, non-blocking upload on CUDA)."""
        host = np.asarray(host)
        dtype = torch.from_numpy(np.empty(0, dtype=host.dtype)).dtype
        dst = torch.empty(host.shape, dtype=dtype, device=self.device)
        return self.upload(key, host, dst)
