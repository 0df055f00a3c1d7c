"""The OxyGen engine (ROS-free): unified KV memory, shared prefill, batched language decoding."""

from __future__ import annotations

import time

from ..policy_io.policy import Pi05Policy
from .base import EngineBase
from .baselines import IsolatedSequentialEngine, NaiveParallelEngine, SharedKVEngine
from .scheduler import OxygenEngine
from .settings import EngineConfig
from .types import Clock

ENGINES: dict[str, type[EngineBase]] = {
    cls.name: cls
    for cls in (OxygenEngine, IsolatedSequentialEngine, SharedKVEngine, NaiveParallelEngine)
}


def make_engine(
    name: str,
    policy: Pi05Policy,
    config: EngineConfig | None = None,
    clock: Clock = time.perf_counter,
) -> EngineBase:
    """Build an engine by name: oxygen, isolated-sequential, shared-kv or naive-parallel."""
    try:
        cls = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}") from None
    return cls(policy, config, clock)


__all__ = ["ENGINES", "EngineBase", "EngineConfig", "OxygenEngine", "make_engine"]
