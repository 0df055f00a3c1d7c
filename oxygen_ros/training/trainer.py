"""The training loop: pi0.5's objectives on a LeRobotDataset, a LeRobot folder out.

AdamW (openpi's betas 0.9 / 0.95), linear warmup then cosine decay (:mod:`.schedule`), gradients
clipped by global norm, a fixed seed for the weights and the flow draws and a data seed for the
frames and the augmentation, and a wall-clock budget: the loop stops at ``steps`` or when the
budget is spent, whichever comes first, and writes the checkpoint either way
(:mod:`.checkpoint_out`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oxygen_ros.checkpoints.conventions import lerobot_conventions
from oxygen_ros.checkpoints.core import build_model, init_random_weights
from oxygen_ros.model.config import Pi05Config, get_preset
from oxygen_ros.model.objectives import Losses, sample_flow, training_losses
from oxygen_ros.model.pi05 import Pi05Model
from oxygen_ros.policy_io.prompts import resolve_format
from oxygen_ros.policy_io.tokenizer import Pi05Tokenizer

from .batches import BatchMaker
from .checkpoint_out import write_trained_checkpoint
from .dataset import TrainingFrames, concatenate_frames, load_training_frames
from .normalization import dataset_norms
from .schedule import learning_rate

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainSettings:
    """Everything that decides a training run (``training.json`` records all of it)."""

    datasets: tuple[Path, ...]  # LeRobotDataset v3 folders, trained on together
    out: Path
    tokenizer: Path
    preset: str = "tiny"
    steps: int = 1000
    batch_size: int = 8
    lr: float = 5e-4
    warmup_steps: int = 50
    final_lr_fraction: float = 0.1
    weight_decay: float = 1e-4
    grad_clip: float = 1.0
    seed: int = 0
    data_seed: int | None = None  # None: the seed
    rtc_training_max_delay: int = 0
    time_budget_s: float | None = None
    prompt_format: str = "openpi_subtask"
    max_token_len: int | None = None  # None: the preset's
    augment: bool = True
    flat_fraction: float = 0.25
    state_noise: float = 0.0  # std of noise on the prompt's normalised state (`BatchMaker`)
    state_dropout: float = 0.0  # share of examples whose prompt shows a random state
    start_share: float = 0.0  # share of examples from their episode's first start_frames
    start_frames: int = 5
    narration: str = "held"  # held / event (`dataset.NARRATION_MODES`), or none: no narration loss
    text_weight: float = 1.0
    knowledge_insulation: bool = True
    log_every: int = 10
    threads: int = 0  # torch CPU threads (0: torch's default, every core)
    command: str = ""

    @property
    def effective_data_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed


@dataclasses.dataclass
class StepLog:
    step: int
    flow: float
    text: float
    text_tokens: int
    lr: float
    seconds: float  # wall time since the loop started


@dataclasses.dataclass
class TrainResult:
    out: Path
    history: list[StepLog]
    steps_per_second: float
    final_flow: float
    final_text: float


def model_config(settings: TrainSettings, frames: TrainingFrames) -> Pi05Config:
    """The preset with the dataset's camera count as image slots and the prompt limit asked for
    (both written into the LeRobot folder's config.json, which the loader reads back)."""
    preset = get_preset(settings.preset)
    return dataclasses.replace(
        preset,
        num_image_slots=len(frames.cameras),
        max_token_len=settings.max_token_len or preset.max_token_len,
    )


def new_model(config: Pi05Config, seed: int) -> Pi05Model:
    """A float32 model with `init_random_weights`' deterministic values for ``seed``."""
    model = build_model(config, "cpu", torch.float32)
    init_random_weights(model, seed)
    return model.train().requires_grad_(True)


def _names(paths: tuple[Path, ...]) -> str:
    return " + ".join(str(p) for p in paths)


def _window_mean(history: list[StepLog], name: str, count: int) -> float:
    values = [getattr(h, name) for h in history[-count:]]
    return float(np.mean(values)) if values else math.nan


def train(settings: TrainSettings, log: Callable[[str], None] = print) -> TrainResult:
    """Train from random weights on ``settings.datasets`` and write the checkpoint to
    ``settings.out``.

    Raises:
        TrainingDataError / BatchError (ValueErrors): a dataset, format or preset that do not fit,
            named in the message.
    """
    torch.manual_seed(settings.seed)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    held = "event" if settings.narration == "none" else settings.narration
    frames = concatenate_frames([load_training_frames(d, held) for d in settings.datasets])
    norms = dataset_norms(frames)
    config = model_config(settings, frames)
    tokenizer = Pi05Tokenizer(settings.tokenizer)
    prompt_format = resolve_format(settings.prompt_format)
    conventions = lerobot_conventions("main", ["written by oxygen-train"], 32)
    maker = BatchMaker(
        frames,
        norms,
        config,
        tokenizer,
        prompt_format,
        conventions,
        augment=settings.augment,
        flat_fraction=settings.flat_fraction,
        state_noise=settings.state_noise,
        state_dropout=settings.state_dropout,
        start_share=settings.start_share,
        start_frames=settings.start_frames,
        narration=settings.narration != "none",
    )
    longest_prompt, longest = maker.prompt_lengths()
    if tokenizer.tasks_shortened:
        raise ValueError(
            f"a prompt of {_names(settings.datasets)} needs more than max_token_len "
            f"{config.max_token_len} tokens ({tokenizer.last_shortened}); raise --max-token-len"
        )
    model = new_model(config, settings.seed)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=settings.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=settings.weight_decay,
    )
    rng = np.random.default_rng(settings.effective_data_seed)
    augment_generator = torch.Generator().manual_seed(settings.effective_data_seed)
    flow_generator = torch.Generator().manual_seed(settings.seed)
    log(
        f"dataset {_names(settings.datasets)}: {len(frames)} frames, "
        f"{frames.num_episodes} episodes, "
        f"cameras {list(frames.cameras)}; preset {config.name} "
        f"({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params); prompt format "
        f"{prompt_format.name}: longest action prompt {longest_prompt} tokens, with narration "
        f"{longest} (max_token_len {config.max_token_len})"
    )
    history: list[StepLog] = []
    start = time.monotonic()
    for step in range(settings.steps):
        lr = learning_rate(
            step, settings.lr, settings.warmup_steps, settings.steps, settings.final_lr_fraction
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = maker.batch(maker.sample_indices(settings.batch_size, rng), rng, augment_generator)
        sample = sample_flow(batch.actions, settings.rtc_training_max_delay, flow_generator)
        losses: Losses = training_losses(
            model, batch, sample, settings.text_weight, settings.knowledge_insulation
        )
        optimizer.zero_grad(set_to_none=True)
        losses.total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        history.append(
            StepLog(
                step,
                float(losses.flow.detach()),
                float(losses.text.detach()),
                losses.text_tokens,
                lr,
                time.monotonic() - start,
            )
        )
        if not math.isfinite(history[-1].flow + history[-1].text):
            raise FloatingPointError(f"step {step}: a non-finite loss ({history[-1]})")
        done = step + 1
        if done % settings.log_every == 0 or done == settings.steps:
            elapsed = history[-1].seconds
            log(
                f"step {done:5d}  flow {_window_mean(history, 'flow', settings.log_every):.4f}  "
                f"text {_window_mean(history, 'text', settings.log_every):.4f}  lr {lr:.2e}  "
                f"{done / elapsed:.2f} steps/s"
            )
        if settings.time_budget_s is not None and history[-1].seconds >= settings.time_budget_s:
            log(f"time budget of {settings.time_budget_s:.0f} s spent after {done} steps")
            break
    elapsed = history[-1].seconds if history else 0.0
    steps_per_second = len(history) / elapsed if elapsed > 0 else math.nan
    final_flow = _window_mean(history, "flow", settings.log_every)
    final_text = _window_mean(history, "text", settings.log_every)
    model.eval().requires_grad_(False)
    record = _record(settings, frames, history, steps_per_second, final_flow, final_text, config)
    write_trained_checkpoint(
        settings.out,
        model,
        frames,
        norms,
        settings.tokenizer,
        settings.rtc_training_max_delay,
        record,
    )
    log(
        f"final losses (last {settings.log_every} steps): flow {final_flow:.4f}, text "
        f"{final_text:.4f}; {len(history)} steps in {elapsed:.0f} s "
        f"({steps_per_second:.2f} steps/s); checkpoint {settings.out}"
    )
    return TrainResult(Path(settings.out), history, steps_per_second, final_flow, final_text)


def _record(
    settings: TrainSettings,
    frames: TrainingFrames,
    history: list[StepLog],
    steps_per_second: float,
    final_flow: float,
    final_text: float,
    config: Pi05Config,
) -> dict[str, Any]:
    fields = dataclasses.asdict(settings)
    fields = {k: (str(v) if isinstance(v, Path) else v) for k, v in fields.items()}
    fields["datasets"] = [str(d) for d in settings.datasets]
    return {
        **fields,
        "data_seed": settings.effective_data_seed,
        "frames": len(frames),
        "episodes": frames.num_episodes,
        "cameras": list(frames.cameras),
        "joint_names": frames.action_names,
        "max_token_len": config.max_token_len,
        "steps_done": len(history),
        "train_seconds": history[-1].seconds if history else 0.0,
        "steps_per_second": steps_per_second,
        "final": {"flow": final_flow, "text": final_text},
        "history": [dataclasses.asdict(h) for h in history],
        "torch": torch.__version__,
    }
