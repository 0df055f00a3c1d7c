"""An autouse fixture for the engine tests: after every test, each engine the test built passes
`check_memory` (every live KV segment owned by a live frame or request, the pool's counts
consistent). Import ``check_engine_memory`` into a test module to enable it there."""

from __future__ import annotations

from typing import List

import pytest

from oxygen_ros.engine import ENGINES
from oxygen_ros.engine.scheduler import EngineBase


@pytest.fixture(autouse=True)
def check_engine_memory(monkeypatch) -> None:
    engines: List[EngineBase] = []

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
