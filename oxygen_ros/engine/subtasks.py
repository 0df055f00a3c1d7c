"""pi0.5's hierarchy at control rate: a subtask decoded in the slack steers every following chunk.

`SubtaskLoop` is the engine's bookkeeping of the ``subtask`` language kind:

* a subtask request is due every ``subtask_period_s`` (0: once per task) and at once when the task
  changes (the old task's request is cancelled and its subtask forgotten: a chunk is never
  conditioned on another task's subtask); it is a greedy request like any other, decoded in the
  slack before each deadline, so it never delays a chunk;
* when it finishes (at eos, or at its token limit) it becomes the *current* subtask, and the next
  frame's prompt carries it (``subtask_conditioning``: ``prompt`` lays out the format's
  conditioned prompt, ``same_frame`` appends its ids causally on top of the frame's shared prefix;
  both in the frame's one prefill, see `frames.prefill_frame`); a frame never carries a subtask
  that finished after its own action;
* a subtask that differs from the current one is adopted only once ``confirmations`` requests in
  a row decoded it (1: at once), so a decode that flickers for one refresh (a cube near a place
  word's edge, a guess ahead of the scene) never reaches the actions; the task's first subtask is
  adopted at once (there is nothing to hold);
* with a `PhaseOrder` (the task's phases in the order they are carried out), a change to a later
  phase is adopted at once and only a change back, or within a phase (another cube), waits for
  ``confirmations``: progress is the scene changing as planned, so holding it back only lags the
  short phases (a grasp), while going back is what a flickering decoder does;
* with a `HeldGate`, a change to a subtask that presupposes a held object ("carry ...",
  "release ...") is adopted only while the newest frame's gripper state says it holds something
  (closed, short of closed on nothing): a decoder that guesses ahead of the scene ("carry" while
  the fingers are open, or closed on nothing) is not a scene that changed, and the arm would head
  for the pad with nothing in its hand;
* with formats that keep a memory (PI052), a changed subtask asks for a memory note chained with
  the previous one.

Everything here is host bookkeeping: the engine owns the requests and the KV.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

from ..policy_io.prompts import PromptFormat, SubtaskText
from .requests import LanguageRequest
from .types import ActionChunk, TextDelta

RECENT_FRAMES = 4096  # frame start times kept for the staleness of a subtask


@dataclasses.dataclass(frozen=True)
class Subtask:
    """A finished subtask: what conditions the chunks after it."""

    text: SubtaskText  # ids, text and the subtask id (counted from 1)
    task: str  # the task it was decoded for
    frame_id: int  # the frame whose prefix it read
    born_s: float  # engine clock when that frame's action started
    decode_ms: float  # from its submission to its final token


def _compiled(pattern: str, what: str) -> re.Pattern[str]:
    """``pattern`` compiled, or a ValueError naming ``what`` it is and why it does not compile."""
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(f"{what} {pattern!r}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class HeldGate:
    """Subtasks that presuppose a held object, adopted only while the gripper holds one.

    ``pattern`` is searched in a subtask's text (e.g. ``^(carry|release) ``); ``dims`` are the
    gripper's indices in the observation state. A gripper holds an object while its state lies
    between ``low`` (past open) and ``high`` (short of closed on nothing: the fingers stopped on
    something), every dim; ``high`` inf: any gripper closed past ``low``.

    Raises (constructor):
        ValueError: an empty or invalid pattern, no dims, a negative dim, a ``low`` that is not a
            finite number or a ``high`` not above it.
    """

    pattern: str
    dims: tuple[int, ...]
    low: float
    high: float = math.inf
    _regex: re.Pattern[str] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.pattern:
            raise ValueError("a held-object gate needs a pattern (a regular expression)")
        object.__setattr__(self, "_regex", _compiled(self.pattern, "held-object gate pattern"))
        if not self.dims or min(self.dims) < 0:
            raise ValueError(f"a held-object gate needs gripper state dims >= 0, got {self.dims}")
        if not math.isfinite(self.low) or not self.high > self.low:
            raise ValueError(
                f"a held-object gate needs a finite low and a high above it, got low {self.low}, "
                f"high {self.high}"
            )

    def allows(self, text: str, state: Sequence[float] | np.ndarray) -> bool:
        """Whether ``text`` may be adopted with the gripper in ``state``: it presupposes nothing
        held, or every gripper dim holds (a state too short for the dims: not holding)."""
        if not self._regex.search(text):
            return True
        if len(state) <= max(self.dims):
            return False
        return all(self.low < state[d] < self.high for d in self.dims)


@dataclasses.dataclass(frozen=True)
class PhaseOrder:
    """A task's phases in the order they are carried out, each a regular expression searched in a
    subtask's text (e.g. ``^reach ``, ``^grasp ``, ``^carry ``, ``^release ``); a subtask's phase
    is the first pattern it matches.

    Raises (constructor):
        ValueError: fewer than two patterns, an empty or invalid one.
    """

    patterns: tuple[str, ...]
    _regexes: tuple[re.Pattern[str], ...] = dataclasses.field(init=False, repr=False, compare=False)

    @classmethod
    def of(cls, patterns: Sequence[str]) -> PhaseOrder | None:
        """The order of ``patterns`` (None for none: no order)."""
        return cls(tuple(patterns)) if patterns else None

    def __post_init__(self) -> None:
        if len(self.patterns) < 2:
            raise ValueError(f"a phase order needs two phases or more, got {list(self.patterns)}")
        if not all(self.patterns):
            raise ValueError("a phase order's patterns must not be empty")
        regexes = tuple(_compiled(p, "phase pattern") for p in self.patterns)
        object.__setattr__(self, "_regexes", regexes)

    def phase(self, text: str) -> int | None:
        """The index of ``text``'s phase (None: it matches no pattern)."""
        return next((i for i, r in enumerate(self._regexes) if r.search(text)), None)

    def advances(self, current: str, new: str) -> bool:
        """Whether ``new`` is in a later phase than ``current`` (both in a known phase)."""
        before, after = self.phase(current), self.phase(new)
        return before is not None and after is not None and after > before


class SubtaskLoop:
    """The subtask kind's schedule and the current subtask of an engine (one thread)."""

    def __init__(
        self,
        prompt_format: PromptFormat,
        period_s: float,
        confirmations: int = 1,
        held_gate: HeldGate | None = None,
        phase_order: PhaseOrder | None = None,
    ) -> None:
        if confirmations < 1:
            raise ValueError(f"subtask confirmations must be >= 1, got {confirmations}")
        self.format = prompt_format
        self.period_s = period_s
        self.confirmations = confirmations
        self.held_gate = held_gate
        self.phase_order = phase_order
        self.reset()

    def reset(self) -> None:
        """Forget everything (a new run)."""
        self.current: Subtask | None = None
        self.latest: Subtask | None = None  # the newest decoded, adopted or not
        self.task: str | None = None
        self.refreshes = 0  # subtasks that finished
        self.changes_held = 0  # decoded changes not (yet) confirmed: the current one kept
        self.changes_gated = 0  # confirmed changes the held-object gate kept out
        self._state: np.ndarray = np.zeros(0)  # the newest frame's observation state
        self._candidate: tuple[tuple[int, ...], int] | None = None  # a change's ids, its count
        self.empty_subtasks = 0  # finished with no words (only spaces or control text)
        self.chunks_by_subtask: collections.Counter[int] = collections.Counter()
        self.unconditioned_chunks = 0  # chunks of a task before its first subtask
        self.memory_note = ""
        self._request: LanguageRequest | None = None
        self._submitted_s = 0.0
        self._due_s: float | None = None  # None: due now
        self._next_id = 1
        self._memory: LanguageRequest | None = None
        self._frame_start: collections.OrderedDict[int, float] = collections.OrderedDict()

    def restart(self) -> None:
        """Start a new subtask at the next frame, as if the task had changed (~/instruction)."""
        self.task = None

    def stats(self, now_s: float) -> dict[str, object]:
        """What diagnostics show: the current subtask, its age, refreshes, decode time, chunks."""
        current = self.current
        recent = sorted(self.chunks_by_subtask.items())[-5:]
        return {
            "subtask": current.text.text if current else "",
            "subtask_id": current.text.subtask_id if current else 0,
            "subtask_age_s": now_s - current.born_s if current else 0.0,
            "subtask_decode_ms": current.decode_ms if current else 0.0,
            "subtask_refreshes": self.refreshes,
            "subtask_changes_held": self.changes_held,
            "subtask_changes_gated": self.changes_gated,
            "subtasks_empty": self.empty_subtasks,
            "subtask_in_flight": self._request is not None,
            "chunks_unconditioned": self.unconditioned_chunks,
            "chunks_per_subtask": " ".join(f"{i}:{n}" for i, n in recent),
            "memory_note": self.memory_note,
        }

    # -- frames ----------------------------------------------------------------------------------
    def observe_task(self, task: str) -> list[LanguageRequest]:
        """The task of the next frame; on a change, the subtask (and memory) is restarted and the
        requests still working for the old task are returned for cancelling."""
        if task == self.task:
            return []
        stale = [r for r in (self._request, self._memory) if r is not None]
        self.task, self.current, self._request, self._memory = task, None, None, None
        self.latest = self._candidate = None
        self._due_s, self.memory_note = None, ""
        return stale

    def observe_state(self, state: np.ndarray) -> None:
        """The next frame's observation state (what the held-object gate reads)."""
        self._state = state

    def conditioning(self) -> SubtaskText | None:
        """The subtask the next frame's prompt carries (None before the task's first)."""
        return self.current.text if self.current is not None else None

    def chunk_made(self, chunk: ActionChunk, started_s: float) -> None:
        """Record a frame's start and label its chunk with the subtask that conditioned it."""
        self._frame_start[chunk.frame_id] = started_s
        while len(self._frame_start) > RECENT_FRAMES:
            self._frame_start.popitem(last=False)
        current = self.current
        if current is None or chunk.subtask_id != current.text.subtask_id:
            self.unconditioned_chunks += chunk.subtask_id == 0
            return
        chunk.subtask = current.text.text
        chunk.subtask_age_s = started_s - current.born_s
        self.chunks_by_subtask[current.text.subtask_id] += 1

    # -- requests --------------------------------------------------------------------------------
    def due(self, now_s: float) -> bool:
        """Whether a new subtask request should be submitted now."""
        if self._request is not None or self.task is None:
            return False
        return self._due_s is None or (self.period_s > 0 and now_s >= self._due_s)

    def submitted(self, request: LanguageRequest, now_s: float) -> None:
        self._request, self._submitted_s = request, now_s
        self._due_s = now_s + self.period_s if self.period_s > 0 else float("inf")

    @property
    def in_flight(self) -> LanguageRequest | None:
        return self._request

    def finished(self, deltas: list[TextDelta], now_s: float) -> dict[str, str] | None:
        """Take this step's deltas; when the subtask request finished with text, it becomes the
        current subtask. Returns the fields of a memory request to submit (PI052: the subtask
        changed), else None."""
        memory = self._memory
        if memory is not None and _final_of(memory, deltas):
            if memory.finish_reason in ("eos", "length"):
                self.memory_note = memory.text.strip()
            self._memory = None
        request = self._request
        if request is None or not _final_of(request, deltas):
            return None
        self._request = None
        if request.finish_reason not in ("eos", "length") or not request.tokens:
            return None  # refused, stalled, cancelled or failed: the next one is due on schedule
        # A subtask of only spaces or control text (an untrained model's) still conditions the
        # chunks, as the model said it; diagnostics count it, so a user sees why ~/subtask is ''.
        self.empty_subtasks += not request.text.strip()
        self.refreshes += 1
        previous = self.current
        ids = tuple(request.tokens)
        same = previous is not None and ids == previous.text.ids
        decoded = Subtask(
            SubtaskText(ids, request.text.strip(), previous.text.subtask_id if same else 0),
            self.task or "",
            request.frame_id or 0,
            self._frame_start.get(request.frame_id or 0, self._submitted_s),
            (now_s - self._submitted_s) * 1e3,
        )
        self.latest = decoded
        if not self._confirmed(ids, same, previous is None or self._advances(previous, decoded)):
            self.changes_held += 1
            return None
        if (
            not same
            and self.held_gate
            and not self.held_gate.allows(decoded.text.text, self._state)
        ):
            self.changes_gated += 1  # confirmed but not yet true: adopted once the gripper holds
            return None
        self._candidate = None
        if not same:
            text = dataclasses.replace(decoded.text, subtask_id=self._next_id)
            decoded = dataclasses.replace(decoded, text=text)
            self._next_id += 1
        self.current = decoded
        if (
            same
            or previous is None
            or not self.format.memory_on_subtask_change
            or "memory" not in self.format.kinds
            or self._memory is not None
        ):
            return None
        return {"task": self.task or "", "memory": self.memory_note, "previous": previous.text.text}

    def _advances(self, current: Subtask, decoded: Subtask) -> bool:
        """Whether ``decoded`` is a later phase of the task than ``current`` (no order: never)."""
        order = self.phase_order
        return order is not None and order.advances(current.text.text, decoded.text.text)

    def _confirmed(self, ids: tuple[int, ...], same: bool, at_once: bool) -> bool:
        """Whether a decoded subtask (token ids) conditions the chunks from now on: the current
        one again, one adopted at once (the task's first, a later phase) or a change decoded
        ``confirmations`` times in a row."""
        if same or at_once:
            self._candidate = None
            return True
        count = self._candidate[1] + 1 if self._candidate and self._candidate[0] == ids else 1
        self._candidate = (ids, count)
        return count >= self.confirmations

    def memory_submitted(self, request: LanguageRequest) -> None:
        self._memory = request


def _final_of(request: LanguageRequest, deltas: list[TextDelta]) -> bool:
    return any(d.final and d.request_id == request.request_id for d in deltas)
