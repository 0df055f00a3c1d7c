"""Deliberate faults, for proving that the engine and the node recover from their own failures.

A CUDA error, an out-of-memory or a plain bug inside a stage all reach the caller as an exception.
:class:`FaultInjector` raises :class:`InjectedFault` at named stages on a schedule, so tests and
``oxygen-bench soak --inject-faults`` can check that every KV block comes back, every request gets
its final delta and the next frame acts normally. Stages call :meth:`FaultInjector.check`; an
injector with no schedule never raises and costs one dictionary lookup per call.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

STAGES = (
    "prefill",  # the frame's shared prefill
    "action",  # the action expert, after the prefill wrote the frame's KV
    "admission",  # attaching queued requests to a frame (their kind-text prefill)
    "decode_step",  # one batched decode step
    "detokenise",  # turning a sampled token into text
    "graph_replay",  # a static-shape step / CUDA graph replay
    "text_publish",  # the node publishing text deltas
)


class InjectedFault(RuntimeError):
    """The exception a :class:`FaultInjector` raises: stands for any failure inside a stage."""

    def __init__(self, stage: str, call: int) -> None:
        super().__init__(f"injected fault in {stage} (call {call})")
        self.stage = stage
        self.call = call


class FaultInjector:
    """Raises :class:`InjectedFault` at chosen calls of chosen stages.

    Args:
        every: stage -> n: fail every n-th call of that stage (n >= 1).
        at: stage -> call numbers (1-based) that fail.

    Raises:
        ValueError: an unknown stage name or a period below 1.
    """

    def __init__(
        self,
        every: Mapping[str, int] | None = None,
        at: Mapping[str, Iterable[int]] | None = None,
    ) -> None:
        self.every: dict[str, int] = dict(every or {})
        self.at: dict[str, frozenset] = {
            stage: frozenset(calls) for stage, calls in (at or {}).items()
        }
        unknown = sorted((set(self.every) | set(self.at)) - set(STAGES))
        if unknown:
            raise ValueError(f"unknown fault stages {unknown}; expected some of {STAGES}")
        bad = {stage: n for stage, n in self.every.items() if n < 1}
        if bad:
            raise ValueError(f"fault periods must be >= 1, got {bad}")
        self.calls: dict[str, int] = {}
        self.raised: dict[str, int] = {}

    @property
    def armed(self) -> bool:
        return bool(self.every or self.at)

    def check(self, stage: str) -> None:
        """Count one call of ``stage``; raise :class:`InjectedFault` when this call is scheduled to
        fail."""
        if not self.armed:
            return
        call = self.calls.get(stage, 0) + 1
        self.calls[stage] = call
        period = self.every.get(stage)
        if (period is not None and call % period == 0) or call in self.at.get(stage, ()):
            self.raised[stage] = self.raised.get(stage, 0) + 1
            raise InjectedFault(stage, call)

    def fail_next(self, stage: str) -> None:
        """Make the next call of ``stage`` fail (on top of the schedule given at construction).

        Raises ValueError for an unknown stage."""
        if stage not in STAGES:
            raise ValueError(f"unknown fault stage {stage!r}; expected one of {STAGES}")
        self.at[stage] = frozenset({self.calls.get(stage, 0) + 1})

    @property
    def total_raised(self) -> int:
        return sum(self.raised.values())


NO_FAULTS = FaultInjector()
"""The default: never raises."""


def tag_stage(error: BaseException, name: str) -> None:
    """Record on ``error`` the engine stage it came from, unless an inner stage already did, so
    that real faults are counted by stage like injected ones (the exception is not changed
    otherwise and is re-raised by the caller)."""
    if not hasattr(error, "engine_stage"):
        try:
            error.engine_stage = name  # type: ignore[attr-defined]
        except AttributeError:  # an exception type without instance attributes
            pass


def stage_of(error: BaseException, default: str) -> str:
    """The stage an engine error came from: an InjectedFault's own stage, else the innermost
    stage that tagged it (`tag_stage`), else ``default``."""
    if isinstance(error, InjectedFault):
        return error.stage
    return getattr(error, "engine_stage", default)


def describe(error: BaseException) -> str:
    """``"<ExceptionType>: <message>"``: what a failed request's final delta carries in
    ``detail``."""
    return f"{type(error).__name__}: {error}"
