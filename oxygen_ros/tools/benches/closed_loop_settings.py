"""The closed-loop bench's settings (what runs each episode) and the checkpoint variants they
need: random weights for the floor, and the trained checkpoint without its training-time RTC
declaration for guided (identity) RTC."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from oxygen_ros.checkpoints.rtc_metadata import FIELD as RTC_FIELD
from oxygen_ros.sim.questions import TARGET_QUESTION

EXPERT, POLICY = "expert", "policy"
TRAINED, RANDOM = "trained", "random"  # checkpoint variants: the one given, its shuffled floor
TOUCH_TASK, PLACE_TASK, ANY_TASK = "touch", "place", "any"  # any: as --tasks says
ASK_QUESTION = TARGET_QUESTION  # the grounding co-training asks it too


@dataclass(frozen=True)
class Setting:
    """One row of the bench: who drives the arm and how the policy node is set.

    configure: node parameters the configure transition applies (a change reconfigures the node).
    runtime: node parameters set while it is inactive, before each episode.
    """

    name: str
    driver: str = POLICY
    checkpoint: str = TRAINED
    configure: dict = field(default_factory=dict)
    runtime: dict = field(default_factory=dict)
    task_kind: str = ANY_TASK
    contention: bool = False
    ask: bool = False
    continuity: str = ""  # for the plot: none | identity | trained
    delay_steps: float = math.nan  # for the plot

    def signature(self) -> tuple:
        """What the node's configure transition depends on (equal: no reconfigure)."""
        return (self.checkpoint, tuple(sorted(self.configure.items())))


def parse_delays(text: str, action_dt: float) -> list[tuple[float, float]]:
    """``"0,2,5"`` (controller steps) or ``"0ms,250ms"`` -> [(steps, ms)]."""
    delays = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        match = re.fullmatch(r"([0-9.]+)\s*(ms)?", item)
        if not match:
            raise ValueError(f"a delay is a number of controller steps or NNms, got {item!r}")
        value = float(match.group(1))
        ms = value if match.group(2) else value * action_dt * 1e3
        delays.append((ms / (action_dt * 1e3), ms))
    return delays


def all_settings(
    delays: list[tuple[float, float]], trained_rtc: bool, contention_overrun: str = "adapt"
) -> list[Setting]:
    """Every setting, in table order. ``trained_rtc``: the checkpoint declares
    rtc_training_max_delay (else the trained-RTC rows are left out)."""
    settings = [
        Setting("expert", driver=EXPERT),
        Setting("random", checkpoint=RANDOM, configure={"chunk_continuity": "none"}),
    ]
    modes = [
        ("none", TRAINED, {"chunk_continuity": "none"}),
        ("identity", TRAINED, {"chunk_continuity": "rtc", "rtc_mode": "guided"}),
    ]
    if trained_rtc:
        modes.append(("trained", TRAINED, {"chunk_continuity": "rtc", "rtc_mode": "trained"}))
    for mode, checkpoint, configure in modes:
        for steps, ms in delays:
            settings.append(
                Setting(
                    f"{mode}/d{steps:g}",
                    checkpoint=checkpoint,
                    configure=configure,
                    runtime={"inject_inference_delay_ms": ms},
                    continuity=mode,
                    delay_steps=steps,
                )
            )
    flat = {"chunk_continuity": "none", "subtask_conditioning": "none"}
    settings += [
        Setting("flat", checkpoint=TRAINED, configure=flat, task_kind=PLACE_TASK),
        Setting(
            "same_frame",
            checkpoint=TRAINED,
            configure={**flat, "subtask_conditioning": "same_frame"},
            task_kind=PLACE_TASK,
        ),
        Setting(
            "contention",
            checkpoint=TRAINED,
            configure={"chunk_continuity": "none"},
            runtime={"overrun_policy": contention_overrun},
            contention=True,
        ),
        Setting("ask", checkpoint=TRAINED, configure={"chunk_continuity": "none"}, ask=True),
    ]
    return settings


def select(settings: list[Setting], wanted: str) -> list[Setting]:
    """The settings named in ``wanted`` (comma-separated; ``none`` picks every ``none/d*``;
    empty or ``all``: every one)."""
    names = [n.strip() for n in wanted.split(",") if n.strip()]
    if not names or names == ["all"]:
        return list(settings)
    chosen = [s for s in settings if any(s.name == n or s.name.startswith(f"{n}/") for n in names)]
    unknown = [
        n for n in names if not any(s.name == n or s.name.startswith(f"{n}/") for s in chosen)
    ]
    if unknown:
        raise ValueError(f"unknown settings {unknown}; known: {[s.name for s in settings]}")
    return chosen


# -- checkpoint variants -------------------------------------------------------------------------
def declares_trained_rtc(checkpoint: Path) -> bool:
    config = checkpoint / "config.json"
    if not config.is_file():
        return False
    return bool(json.loads(config.read_text()).get(RTC_FIELD) or 0)


def _linked_copy(src: Path, dst: Path, except_names: set[str]) -> None:
    """``dst`` holding symbolic links to every entry of ``src`` but ``except_names``."""
    dst.mkdir(parents=True, exist_ok=True)
    for entry in src.iterdir():
        if entry.name not in except_names:
            link = dst / entry.name
            if not link.exists():
                link.symlink_to(entry.resolve())


def random_variant(checkpoint: Path, out: Path, seed: int = 0) -> Path:
    """The floor: the checkpoint with the values of every weight tensor shuffled (same shapes and
    value distribution per tensor, no learned structure); config, norm stats and tokenizer kept."""
    weights = checkpoint / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{weights}: the random-weight floor needs a model.safetensors")
    _linked_copy(checkpoint, out, {"model.safetensors"})
    generator = torch.Generator().manual_seed(seed)
    tensors = load_file(str(weights))
    shuffled = {}
    for name, tensor in tensors.items():
        flat = tensor.reshape(-1)
        order = torch.randperm(flat.numel(), generator=generator)
        shuffled[name] = flat[order].reshape(tensor.shape).contiguous()
    save_file(shuffled, str(out / "model.safetensors"))
    return out
