"""Shared by the engine tests: an autouse fixture after which each engine the test built passes
`check_memory` (every live KV segment owned by a live frame or request, the pool's counts
consistent; import ``check_engine_memory`` into a test module to enable it there), and the tiny
policy with weights large enough for context-dependent text (`scaled_policy`)."""

from __future__ import annotations

import pytest
import torch

from oxygen_ros.engine import ENGINES
from oxygen_ros.engine.base import EngineBase
from oxygen_ros.policy_io.policy import Pi05Policy, load_policy


def scaled_policy(checkpoint, device: str = "cpu") -> Pi05Policy:
    """The tiny checkpoint with weights scaled up so that greedy text depends on its context
    (N(0, 0.02) random weights give near-flat logits and one repeated token)."""
    policy = load_policy(checkpoint, action_dim=7, device=device)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * (0.1 if p.dim() == 1 else 0.3))
    return policy


@pytest.fixture(autouse=True)
def check_engine_memory(monkeypatch) -> None:
    engines: list[EngineBase] = []

    def recording(real_init):
        def init(self, *args, **kwargs):
            real_init(self, *args, **kwargs)
            engines.append(self)  # fully built engines only

        return init

    for cls in ENGINES.values():
        monkeypatch.setattr(cls, "__init__", recording(cls.__init__))
    yield
    for engine in engines:
        engine.check_memory()
