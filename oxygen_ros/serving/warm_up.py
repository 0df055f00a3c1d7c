"""The server's first-call costs, paid before it reports ready (``/healthz``).

One synthetic frame goes through every path a session uses, on the model thread and with the
functions the batches use: the batched action path (`scheduler.act_together`), then the language
the server runs (an ``ask`` when it answers questions, a narration when ``--narration-every`` is
set) admitted onto that frame and decoded for a few batched steps (`scheduler.decode_together`).
The engine is a throwaway one over the shared policy and pool: no session, id or counter is used.
"""

from __future__ import annotations

from ..engine.scheduler import OxygenEngine, act_together, decode_together
from ..engine.types import Observation
from .sessions import LanguageSettings, Session

WARM_UP_QUESTION = "what do you see?"
WARM_UP_DECODE_STEPS = 2  # the first batched step, and one more over the grown KV


def warm_up(engine: OxygenEngine, observation: Observation, language: LanguageSettings) -> None:
    """Run one frame and its language through ``engine`` (model thread), then close it.

    Raises:
        RuntimeError: the frame failed (the server cannot serve this model as configured).
    """
    session = Session(0, engine, language)
    try:
        [result] = act_together([engine], [observation])
        if isinstance(result, Exception):
            raise RuntimeError(
                f"the warm-up frame failed: {type(result).__name__}: {result}"
            ) from result
        ask = WARM_UP_QUESTION if "answer" in engine.config.kinds else ""
        session.acted(result, ask)  # queues the ask and (frame 1) a due narration
        decode_together([engine], max_steps=WARM_UP_DECODE_STEPS)
    finally:
        session.close()
