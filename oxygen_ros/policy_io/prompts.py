"""Prompt formats as data: every string a checkpoint was trained to read, named in one place.

A :class:`PromptFormat` names every piece of text the engine feeds the model:

* the **action prompt** of a frame without a subtask (``action``), and with one
  (``subtask_action``), each with a variant for robots trained without the state in the prompt;
* which of those pieces are **bidirectional** (the frame's shared prefix, read by every task of the
  frame) and which are **causal** (``causal_from``: the first causal piece of ``subtask_action``;
  ``causal_prompt``: the whole prompt is causal);
* each **language kind's** own text (:class:`KindFormat`): appended causally after the whole frame
  prefix (``reads="frame"``) or after the shared bidirectional part only (``reads="shared"``, exact
  where a format makes the generated text continue that prefix), token ranges never sampled
  (``suppress``), its token limit;
* how the task text is cleaned, and whether a changed subtask writes a memory note.

A template is a tuple of *pieces*, each encoded on its own and concatenated after the bos token
(openpi encodes the pi0 prompt's trailing newline separately, so pieces matter). A piece may hold
the fields ``{task}``, ``{state}`` (the state bins), ``{subtask}`` (the subtask's text) and, in
kind texts, ``{text}`` (a question), ``{memory}`` (the previous memory note) and ``{previous}``
(the subtask just completed). Two pieces are special: ``<eos>`` is the eos token, and a piece that
is exactly ``{subtask}`` inserts the subtask's generated token ids as they were decoded (the
KV-append formats condition on those tokens, not on a re-tokenised text).

Presets (:data:`PRESETS`): ``openpi`` (openpi ``main``'s action prompt, the default), ``oxygen``
(the same action prompt with this package's own narration / answer / memory prompts, which no
public checkpoint was trained on; every preset without a published text for one of those kinds
falls back to them), ``openpi_subtask`` (openpi PR #942), ``opentau``, ``brunofang`` (the format
OxyGen's ``pi05_o2`` configs use), ``pi052`` (LeRobot PI052, "blend" action layout) and
``pi052_joint`` (its ``joint_subtask_conditioning`` layout). Sources: ``PI05_LANGUAGE.md``.
"""

from __future__ import annotations

import dataclasses
import json
import string
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

LANGUAGE_KINDS = ("narration", "answer", "memory", "subtask")
# How a decoded subtask conditions the actions (engine/subtasks.py): not at all (no subtask loop),
# by the format's conditioned prompt, or (exact formats only) by its ids appended causally on the
# frame's shared prefix. Either way it is the frame's one prefill.
SUBTASK_CONDITIONING = ("none", "prompt", "same_frame")
DEFAULT_SUBTASK_MAX_TOKENS = 64  # a subtask's limit when neither the format nor the user sets one
# The fewest tokens a subtask can be useful with: a verb and an object ("grasp the cup" is three
# PaliGemma tokens). A prompt that leaves a subtask less is refused (or the configured limit, when
# that is lower).
MIN_SUBTASK_TOKENS = 4
EOS_PIECE = "<eos>"
SUBTASK_IDS_PIECE = "{subtask}"
TASK_STYLES = ("openpi", "lower_period", "whitespace")
READS = ("frame", "shared")
# PaliGemma's <loc0000>..<loc1023>: PI052 never samples them for subtask and memory text.
PALIGEMMA_LOC_IDS = (256000, 257023)

Template = tuple[str, ...]
_ACTION_FIELDS = {"task", "state"}
_SUBTASK_ACTION_FIELDS = {"task", "state", "subtask"}
_KIND_FIELDS = {"text", "task", "memory", "previous"}


def clean_task(task: str) -> str:
    """openpi's prompt cleaning: strip, then underscores and newlines become spaces."""
    return task.strip().replace("_", " ").replace("\n", " ")


class PromptFormatError(ValueError):
    """A prompt format (preset or custom) that cannot be used; the message names the piece."""


@dataclasses.dataclass(frozen=True)
class KindFormat:
    """How one language kind is prompted.

    text: pieces appended causally after what the request reads (may be empty for ``shared``).
    reads: ``frame`` (after the whole frame prefix) or ``shared`` (after the bidirectional shared
        prefix only: the format's generated text continues that prefix, as PR #942's subtask does).
    suppress: inclusive token-id ranges the request never samples.
    max_tokens: the format's token limit for this kind (0: the request's own).
    ours: True when no public checkpoint was trained on this text (this package's own prompt).
    """

    text: Template = ()
    reads: str = "frame"
    suppress: tuple[tuple[int, int], ...] = ()
    max_tokens: int = 0
    ours: bool = False


@dataclasses.dataclass(frozen=True)
class FramePrompt:
    """A frame's prompt token ids (bos first) and their attention layout.

    shared: how many of ``ids`` form the shared bidirectional prefix (kinds reading ``shared``
        read the images and these); equals len(ids) when nothing causal follows.
    causal_from: index of the first causal id (None: every id is bidirectional).
    subtask_id: the subtask these ids carry (0: none).
    """

    ids: tuple[int, ...]
    shared: int
    causal_from: int | None = None
    subtask_id: int = 0

    def causal_mask(self) -> np.ndarray:
        """bool [len(ids)]: which ids attend causally (ar=1 in openpi's mask terms)."""
        mask = np.zeros(len(self.ids), dtype=bool)
        if self.causal_from is not None:
            mask[self.causal_from :] = True
        return mask


@dataclasses.dataclass(frozen=True)
class SubtaskText:
    """A decoded subtask: its generated ids (without the eos) and its text."""

    ids: tuple[int, ...]
    text: str
    subtask_id: int = 0


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """Every prompt piece of one checkpoint family (see the module docstring)."""

    name: str
    action: Template
    action_no_state: Template | None = None
    subtask_action: Template | None = None
    subtask_action_no_state: Template | None = None
    causal_from: int | None = None  # first causal piece of subtask_action; None: all bidirectional
    causal_prompt: bool = False  # every prompt token is causal (BrunoFANG)
    task_style: str = "openpi"
    kinds: Mapping[str, KindFormat] = dataclasses.field(default_factory=dict)
    memory_on_subtask_change: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kinds", MappingProxyType(dict(self.kinds)))
        _validate(self)

    # -- what the format can do ----------------------------------------------------------------
    @property
    def has_subtask(self) -> bool:
        return self.subtask_action is not None and "subtask" in self.kinds

    @property
    def same_frame_exact(self) -> bool:
        """Whether appending the subtask's ids causally on top of the frame's shared prefix equals
        re-prefilling the subtask-conditioned prompt (the tail is causal, positions continue)."""
        return self.subtask_action is not None and self.causal_from is not None

    def kind(self, name: str) -> KindFormat:
        try:
            return self.kinds[name]
        except KeyError:
            raise PromptFormatError(
                f"prompt format {self.name!r} has no {name!r} prompt; it has "
                f"{', '.join(sorted(self.kinds))}"
            ) from None

    def needs_state(self, conditioned: bool) -> bool:
        """Whether the prompt used has no variant for a robot without state bins."""
        return (self.subtask_action_no_state if conditioned else self.action_no_state) is None

    # -- text ----------------------------------------------------------------------------------
    def clean_task(self, task: str) -> str:
        """The task text as the format's training data wrote it."""
        if self.task_style == "openpi":
            return clean_task(task)
        if self.task_style == "whitespace":
            return " ".join(task.split())
        text = clean_task(task).lower().rstrip(".!?;:, ")
        return f"{text}." if text else text

    def action_text(self, task: str, state_bins: Sequence[int] | None) -> str:
        """The whole action prompt without a subtask as one string (for logs and tests)."""
        template = self.template(False, state_bins is not None)
        fields = self._fields(task, state_bins, None)
        return "".join("<eos>" if p == EOS_PIECE else p.format(**fields) for p in template)

    def template(self, conditioned: bool, has_state: bool) -> Template:
        """The action prompt's pieces (``conditioned``: the subtask-conditioned one) for a robot
        with or without state bins in the prompt.

        Raises:
            PromptFormatError: the format has no variant without state bins.
        """
        template = (
            (self.subtask_action if has_state else self.subtask_action_no_state)
            if conditioned
            else (self.action if has_state else self.action_no_state)
        )
        if template is None:
            what = "subtask-conditioned action prompt" if conditioned else "action prompt"
            raise PromptFormatError(
                f"prompt format {self.name!r} has no {what} without state bins: it was trained "
                "with the state in the prompt, and this robot puts none there (discrete state "
                "input off, as libero); choose a format with a state-free variant (openpi, "
                "openpi_subtask, brunofang) or a robot with state bins"
            )
        return template

    def _fields(
        self, task: str, state_bins: Sequence[int] | None, subtask: SubtaskText | None
    ) -> dict[str, str]:
        return {
            "task": self.clean_task(task),
            "state": " ".join(str(int(b)) for b in state_bins) if state_bins is not None else "",
            "subtask": " ".join(subtask.text.split()) if subtask is not None else "",
        }

    def frame_prompt(
        self,
        tokenizer: Any,
        task: str,
        state_bins: Sequence[int] | None,
        conditioned: bool = False,
        subtask: SubtaskText | None = None,
    ) -> FramePrompt:
        """The token ids of a frame's prompt: the action prompt, or with ``conditioned`` the
        subtask-conditioned one carrying ``subtask`` (None: an empty subtask, before the first
        one finished). ``tokenizer`` needs bos_id, eos_id and encode_text.

        Raises:
            PromptFormatError: the prompt needs state bins and ``state_bins`` is None.
        """
        template = self.template(conditioned, state_bins is not None)
        fields = self._fields(task, state_bins, subtask)
        ids = [tokenizer.bos_id]
        shared = None
        for index, piece in enumerate(template):
            if conditioned and index == self.causal_from:
                shared = len(ids)
            ids += _encode_piece(tokenizer, piece, fields, subtask)
        shared = len(ids) if shared is None else shared
        causal_from = 0 if self.causal_prompt else (shared if shared < len(ids) else None)
        return FramePrompt(
            tuple(ids), shared, causal_from, subtask.subtask_id if subtask is not None else 0
        )

    def kind_ids(self, tokenizer: Any, kind: str, **fields: str) -> list[int]:
        """The ids of ``kind``'s own text with ``fields`` (text, task, memory, previous)."""
        values = {name: "" for name in _KIND_FIELDS} | fields
        if "task" in fields:
            values["task"] = self.clean_task(fields["task"])
        ids: list[int] = []
        for piece in self.kind(kind).text:
            ids += _encode_piece(tokenizer, piece, values, None)
        return ids


def _encode_piece(
    tokenizer: Any, piece: str, fields: Mapping[str, str], subtask: SubtaskText | None
) -> list[int]:
    if piece == EOS_PIECE:
        return [tokenizer.eos_id]
    if piece == SUBTASK_IDS_PIECE:
        return list(subtask.ids) if subtask is not None else []
    return tokenizer.encode_text(piece.format(**fields))


# -- validation ----------------------------------------------------------------------------------


def _fields_of(where: str, piece: str) -> set[str]:
    if not isinstance(piece, str):
        raise PromptFormatError(f"{where}: every piece must be a string, got {piece!r}")
    try:
        parsed = list(string.Formatter().parse(piece))
    except ValueError as exc:
        raise PromptFormatError(f"{where}: bad template {piece!r}: {exc}") from None
    names = set()
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise PromptFormatError(
                f"{where}: bad field {{{name}}} in {piece!r}: use plain fields such as {{task}}"
            )
        names.add(name)
    return names


def _check_template(where: str, template: Any, allowed: set[str], required: bool) -> None:
    if template is None:
        if required:
            raise PromptFormatError(f"{where} is required")
        return
    if not isinstance(template, tuple) or (required and not any(template)):
        raise PromptFormatError(f"{where} must be a non-empty list of pieces, got {template!r}")
    for piece in template:
        if piece in (EOS_PIECE, SUBTASK_IDS_PIECE) and "subtask" in allowed:
            continue
        if piece == EOS_PIECE:
            continue
        unknown = _fields_of(where, piece) - allowed
        if unknown:
            raise PromptFormatError(
                f"{where}: unknown field(s) {sorted(unknown)} in {piece!r}; allowed: "
                f"{sorted(allowed)}"
            )


def _validate(fmt: PromptFormat) -> None:
    where = f"prompt format {fmt.name!r}"
    if not fmt.name or not isinstance(fmt.name, str):
        raise PromptFormatError("a prompt format needs a name")
    _check_template(f"{where} action", fmt.action, _ACTION_FIELDS, True)
    _check_template(f"{where} action_no_state", fmt.action_no_state, {"task"}, False)
    for name, allowed in (
        ("subtask_action", _SUBTASK_ACTION_FIELDS),
        ("subtask_action_no_state", {"task", "subtask"}),
    ):
        template = getattr(fmt, name)
        _check_template(f"{where} {name}", template, allowed, False)
        if template is not None and not any("{subtask}" in piece for piece in template):
            raise PromptFormatError(f"{where} {name} never uses the {{subtask}}")
    if fmt.task_style not in TASK_STYLES:
        raise PromptFormatError(
            f"{where}: task_style must be one of {', '.join(TASK_STYLES)}, got {fmt.task_style!r}"
        )
    if fmt.causal_from is not None:
        for name in ("subtask_action", "subtask_action_no_state"):
            template = getattr(fmt, name)
            if template is not None and not 0 < fmt.causal_from < len(template):
                raise PromptFormatError(
                    f"{where}: causal_from {fmt.causal_from} must split {name} "
                    f"({len(template)} pieces) into a shared part and a causal tail"
                )
        if fmt.subtask_action is None:
            raise PromptFormatError(f"{where}: causal_from needs a subtask_action")
    for kind, spec in fmt.kinds.items():
        kwhere = f"{where} kind {kind!r}"
        if kind not in LANGUAGE_KINDS:
            raise PromptFormatError(
                f"{kwhere}: unknown language kind; expected one of {LANGUAGE_KINDS}"
            )
        if not isinstance(spec, KindFormat):
            raise PromptFormatError(f"{kwhere}: expected a KindFormat, got {spec!r}")
        _check_template(f"{kwhere} text", spec.text, _KIND_FIELDS, False)
        if spec.reads not in READS:
            raise PromptFormatError(
                f"{kwhere}: reads must be one of {', '.join(READS)}, got {spec.reads!r}"
            )
        if spec.reads == "shared" and not fmt.same_frame_exact:
            raise PromptFormatError(
                f"{kwhere}: reads 'shared' needs a subtask_action with a causal tail (causal_from)"
            )
        if spec.reads == "frame" and not spec.text:
            raise PromptFormatError(f"{kwhere}: a kind reading the frame needs its own text")
        for low, high in spec.suppress:
            if not 0 <= low <= high:
                raise PromptFormatError(f"{kwhere}: bad suppress range [{low}, {high}]")
        if spec.max_tokens < 0:
            raise PromptFormatError(f"{kwhere}: max_tokens must be >= 0")
    if "subtask" in fmt.kinds and fmt.subtask_action is None:
        raise PromptFormatError(f"{where}: a subtask kind needs a subtask_action")


# -- presets -------------------------------------------------------------------------------------

OPENPI_ACTION: Template = ("Task: {task}, State: {state};\nAction: ",)
OPENPI_ACTION_NO_STATE: Template = ("{task}", "\n")  # openpi's pi0 format: "\n" encoded alone
# This package's own kind prompts: appended after a frame's action prompt. No public checkpoint
# was trained on them.
OXYGEN_KINDS: Mapping[str, KindFormat] = MappingProxyType(
    {
        "narration": KindFormat(("\nNarrate: ",), ours=True),
        "answer": KindFormat(("\nQuestion: {text}\nAnswer: ",), ours=True),
        "memory": KindFormat(("\nMemory note: ",), ours=True),
    }
)


def _with_ours(kinds: Mapping[str, KindFormat]) -> dict[str, KindFormat]:
    return {**OXYGEN_KINDS, **kinds}


_LOC = (PALIGEMMA_LOC_IDS,)
# LeRobot PI052's text turns (max 128 tokens; <loc> ids masked for subtask and memory text).
PI052_KINDS = _with_ours(
    {
        "subtask": KindFormat(("User: {task}\nAssistant:",), suppress=_LOC, max_tokens=128),
        "memory": KindFormat(
            (
                "User: {task}\nAssistant: Previous memory: {memory}\nUser: "
                "Completed subtask: {previous}\nAssistant:",
            ),
            suppress=_LOC,
            max_tokens=128,
        ),
        "answer": KindFormat(("User: {text}\nAssistant:",), max_tokens=128),
    }
)

PRESETS: Mapping[str, PromptFormat] = MappingProxyType(
    {
        fmt.name: fmt
        for fmt in (
            PromptFormat(
                "openpi",
                OPENPI_ACTION,
                OPENPI_ACTION_NO_STATE,
                kinds=OXYGEN_KINDS,
                source="openpi main 15a9616 PaligemmaTokenizer.tokenize (no text path)",
            ),
            PromptFormat(
                "oxygen",
                OPENPI_ACTION,
                OPENPI_ACTION_NO_STATE,
                kinds=OXYGEN_KINDS,
                source="this package's own narration/answer/memory prompts on openpi's action "
                "prompt; no public checkpoint was trained on them",
            ),
            PromptFormat(
                "openpi_subtask",
                OPENPI_ACTION,
                OPENPI_ACTION_NO_STATE,
                subtask_action=(
                    "Task: {task}, State: {state};\nSubtask: ",
                    SUBTASK_IDS_PIECE,
                    EOS_PIECE,
                    "\nAction: ",
                ),
                subtask_action_no_state=(
                    "Task: {task};\nSubtask: ",
                    SUBTASK_IDS_PIECE,
                    EOS_PIECE,
                    "\nAction: ",
                ),
                causal_from=1,
                kinds=_with_ours({"subtask": KindFormat((), "shared", max_tokens=64)}),
                source="openpi PR #942 (head f084c912) tokenizer.py:52-113, pi0.py:294-430",
            ),
            PromptFormat(
                "opentau",
                OPENPI_ACTION,
                subtask_action=(
                    "Task: {task}, State: {state};\nResponse: ",
                    SUBTASK_IDS_PIECE,
                    EOS_PIECE,
                    ";\n",
                    "Action: ",
                ),
                causal_from=1,
                kinds=_with_ours({"subtask": KindFormat((), "shared", max_tokens=64)}),
                source="OpenTau modeling_pi05.py:1168-1530",
            ),
            PromptFormat(
                "brunofang",
                ("Task: {task} Subtask: ",),
                ("Task: {task} Subtask: ",),
                subtask_action=("Task: {task} Subtask: ", SUBTASK_IDS_PIECE),
                subtask_action_no_state=("Task: {task} Subtask: ", SUBTASK_IDS_PIECE),
                causal_from=1,
                causal_prompt=True,
                task_style="lower_period",
                kinds=_with_ours({"subtask": KindFormat((), "shared", max_tokens=64)}),
                source="BrunoFANG1/openpi_subtask_generation tokenizer.py:51-94; OxyGen "
                "tokenizer.py:51-56, transforms.py:269-282 (no state in the prompt; the "
                "generated text ends with '.;\\nAction: ' before its eos)",
            ),
            PromptFormat(
                "pi052",
                ("User: {task}, State: {state};\n",),
                subtask_action=("User: {subtask}, State: {state};\n",),
                task_style="whitespace",
                kinds=PI052_KINDS,
                memory_on_subtask_change=True,
                source="LeRobot PR #4184 pi052_adapter.py:53-146, text_processor_pi052.py:227-421 "
                "(blend layout: the task is dropped from the action prompt)",
            ),
            PromptFormat(
                "pi052_joint",
                ("User: {task}, State: {state};\n",),
                subtask_action=(
                    "User: {task}, State: {state};\nAssistant: {subtask}",
                    EOS_PIECE,
                    "\n",
                ),
                task_style="whitespace",
                kinds=PI052_KINDS,
                memory_on_subtask_change=True,
                source="LeRobot PR #4184 (joint_subtask_conditioning layout)",
            ),
        )
    }
)
DEFAULT_FORMAT = "openpi"


# -- custom formats ------------------------------------------------------------------------------

_FORMAT_KEYS = {f.name for f in dataclasses.fields(PromptFormat)} | {"base"}
_KIND_KEYS = {f.name for f in dataclasses.fields(KindFormat)}


def _template_of(where: str, value: Any) -> Template | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value):
        return tuple(value)
    raise PromptFormatError(f"{where} must be a string or a list of strings, got {value!r}")


def _kind_of(where: str, value: Any, base: KindFormat | None) -> KindFormat:
    if not isinstance(value, Mapping):
        raise PromptFormatError(f"{where} must be a mapping with text/reads/..., got {value!r}")
    unknown = set(value) - _KIND_KEYS
    if unknown:
        raise PromptFormatError(
            f"{where}: unknown key(s) {sorted(unknown)}; use {sorted(_KIND_KEYS)}"
        )
    fields = dataclasses.asdict(base) if base is not None else {}
    fields.update(value)
    fields["text"] = _template_of(f"{where} text", fields.get("text", ())) or ()
    try:
        fields["suppress"] = tuple((int(a), int(b)) for a, b in fields.get("suppress", ()))
        fields["max_tokens"] = int(fields.get("max_tokens", 0))
    except (TypeError, ValueError):
        raise PromptFormatError(
            f"{where}: suppress must be [[first, last], ...] ids and max_tokens an integer"
        ) from None
    return KindFormat(**fields)


def custom_format(spec: Mapping[str, Any] | str) -> PromptFormat:
    """A prompt format from a mapping (or its JSON/YAML text), e.g. from the params YAML::

        {"name": "my_finetune", "base": "openpi_subtask",
         "subtask_action": ["Goal: {task}, State: {state};\\nStep: ", "{subtask}", "<eos>",
                            "\\nAction: "],
         "kinds": {"subtask": {"reads": "shared", "max_tokens": 32}}}

    Fields not given are taken from ``base`` (a preset name; default ``openpi``); ``kinds`` are
    merged kind by kind. Templates are a string or a list of pieces.

    Raises:
        PromptFormatError: unparsable text, an unknown key or preset, or a bad template.
    """
    if isinstance(spec, str):
        spec = _parse_text(spec)
    if not isinstance(spec, Mapping):
        raise PromptFormatError(f"a custom prompt format must be a mapping, got {spec!r}")
    unknown = set(spec) - _FORMAT_KEYS
    if unknown:
        raise PromptFormatError(
            f"custom prompt format: unknown key(s) {sorted(unknown)}; use {sorted(_FORMAT_KEYS)}"
        )
    base = preset(spec.get("base", DEFAULT_FORMAT))
    name = spec.get("name")
    if not isinstance(name, str) or not name.strip():
        raise PromptFormatError("custom prompt format: give it a non-empty 'name'")
    fields: dict[str, Any] = {
        f.name: getattr(base, f.name) for f in dataclasses.fields(PromptFormat)
    }
    for key, value in spec.items():
        if key in ("base", "kinds"):
            continue
        if key in ("action", "action_no_state", "subtask_action", "subtask_action_no_state"):
            value = _template_of(f"custom prompt format {name!r} {key}", value)
        fields[key] = value
    kinds = dict(base.kinds)
    raw_kinds = spec.get("kinds", {}) or {}
    if not isinstance(raw_kinds, Mapping):
        raise PromptFormatError(f"custom prompt format {name!r}: kinds must be a mapping")
    for kind, value in raw_kinds.items():
        where = f"custom prompt format {name!r} kind {kind!r}"
        kinds[kind] = _kind_of(where, value, kinds.get(kind))
    fields["kinds"] = kinds
    try:
        return PromptFormat(**fields)
    except TypeError as exc:
        raise PromptFormatError(f"custom prompt format {name!r}: {exc}") from None


def _parse_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        import yaml
    except ImportError:  # pragma: no cover - PyYAML ships with ROS 2
        raise PromptFormatError("a custom prompt format must be JSON (PyYAML is missing)") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise PromptFormatError(f"custom prompt format is neither JSON nor YAML: {exc}") from None


def subtask_max_tokens(fmt: PromptFormat, configured: int = 0) -> int:
    """A subtask's token limit before the prompt's room: ``configured`` (the node's
    ``subtask_max_tokens``; 0: unset), else the format's limit for its subtask kind, else
    ``DEFAULT_SUBTASK_MAX_TOKENS``."""
    kind = fmt.kinds.get("subtask")
    return configured or (kind.max_tokens if kind is not None else 0) or DEFAULT_SUBTASK_MAX_TOKENS


def check_conditioning(fmt: PromptFormat, mode: str) -> None:
    """Whether ``fmt`` supports ``subtask_conditioning`` ``mode``.

    Raises:
        PromptFormatError: an unknown mode, a format without a subtask prompt, or same_frame where
            it would not be exact.
    """
    if mode not in SUBTASK_CONDITIONING:
        raise PromptFormatError(
            f"subtask_conditioning must be one of {', '.join(SUBTASK_CONDITIONING)}, got {mode!r}"
        )
    if mode != "none" and not fmt.has_subtask:
        raise PromptFormatError(
            f"subtask_conditioning {mode!r} needs a prompt format with a subtask prompt; "
            f"{fmt.name!r} has none (openpi_subtask, opentau, brunofang, pi052 do)"
        )
    if mode == "same_frame" and not fmt.same_frame_exact:
        raise PromptFormatError(
            "subtask_conditioning same_frame is exact only where the subtask-conditioned action "
            f"prompt ends in a causal tail (openpi_subtask, opentau, brunofang); {fmt.name!r} "
            "re-prefills the subtask's text: use subtask_conditioning prompt"
        )


def preset(name: str) -> PromptFormat:
    """The preset called ``name``.

    Raises:
        PromptFormatError: no such preset (the message lists them).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise PromptFormatError(
            f"unknown prompt format {name!r}; presets: {', '.join(PRESETS)} (or a custom one)"
        ) from None


def resolve_format(name: str, custom: str | Mapping[str, Any] | None = None) -> PromptFormat:
    """``name`` as a preset, or the custom format ``custom`` when it is named ``name``.

    Raises:
        PromptFormatError: an unknown name, or a custom format that is bad or named otherwise.
    """
    if custom:
        fmt = custom_format(custom)
        if fmt.name != name:
            raise PromptFormatError(
                f"prompt_format is {name!r} but the custom format is named {fmt.name!r}"
            )
        return fmt
    return preset(name)
