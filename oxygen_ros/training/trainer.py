"""The training loop: pi0.5's objectives on a LeRobotDataset, a LeRobot folder out.

AdamW (openpi's betas 0.9 / 0.95), linear warmup then cosine decay (:mod:`.schedule`), gradients
clipped by global norm, optionally a moving average of the weights (``ema_decay``, openpi's
0.99: the probes and the checkpoint read the average, :mod:`.weight_average`), a fixed seed
for the weights and the flow draws and a data seed for the frames and the augmentation, and a
wall-clock budget: the loop stops at ``steps`` or when the
budget is spent, whichever comes first, and writes the checkpoint either way
(:mod:`.checkpoint_out`).

pi0.5's co-training: with grounding scenes (`oxygen_ros.sim.grounding`), every step adds a
text-only batch of questions about rendered scenes (:mod:`.grounding`) to the demonstrations'
batch; the first ``grounding_only_steps`` train on the questions alone, and the first
``one_colour_steps`` ask only the warm-up's questions (`curriculum_questions`). With knowledge
insulation the backbone learns from text alone (the questions, the subtask, the narration), the
action expert reads what it learned. A held-out probe (:func:`.grounding.probe`) is logged every
``probe_every`` steps. A resume file (``resume.pt`` in ``out``) is written every
``resume_every_s`` seconds and when the run ends; ``resume`` continues from it.

A run can be trained in stages, one call per stage (a curriculum: the grounding questions at the
start pose, then at every pose, then the demonstrations joining): each call names its ``stage``
and resumes the previous stage's weights and optimiser; a new stage restarts the step counts that
shape it (``steps``, the warmup and cosine of its learning rate, ``grounding_only_steps``,
``one_colour_steps``, the time budget) from its first step. A stage ends at its ``steps``, its
budget, or at the first probe where every one of its ``gates`` holds (``start/where >= 0.95``:
a recipe gated on what the model knows, not on a step count). Resumed, a stage that its gates
ended is not trained again, one stopped by its budget or step count goes on to its ``steps``, and
an earlier stage, once a later one ran, is skipped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oxygen_ros.checkpoints.conventions import lerobot_conventions
from oxygen_ros.checkpoints.core import build_model, init_random_weights
from oxygen_ros.checkpoints.lerobot import relative_action_mask
from oxygen_ros.checkpoints.loader import load_checkpoint
from oxygen_ros.model.config import Pi05Config, get_preset
from oxygen_ros.model.objectives import Losses, sample_flow, text_only_loss, training_losses
from oxygen_ros.model.pi05 import Pi05Model
from oxygen_ros.model.siglip import sincos_positions
from oxygen_ros.policy_io.prompts import resolve_format
from oxygen_ros.policy_io.tokenizer import Pi05Tokenizer
from oxygen_ros.sim.questions import KIND_WEIGHTS, QUESTION_KINDS, GroundingScenes

from .batches import BatchMaker
from .checkpoint_out import write_trained_checkpoint
from .dataset import (
    TrainingFrames,
    concatenate_frames,
    episodes_with_task,
    load_training_frames,
)
from .grounding import GroundingBatchMaker, probe
from .normalization import RELATIVE_EXCLUDE, checkpoint_norms, dataset_norms
from .schedule import learning_rate
from .weight_average import WeightAverage

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainSettings:
    """Everything that decides a training run (``training.json`` records all of it)."""

    datasets: tuple[Path, ...]  # LeRobotDataset v3 folders, trained on together
    out: Path
    tokenizer: Path
    task_filters: tuple[tuple[Path, str], ...] = ()  # (dataset, task pattern): its episodes kept
    preset: str = "tiny"
    steps: int = 1000
    batch_size: int = 8
    lr: float = 5e-4
    warmup_steps: int = 50
    final_lr_fraction: float = 0.1
    weight_decay: float = 1e-4
    ema_decay: float = 0.0  # the weight average's decay (`weight_average`); 0: the last weights
    grad_clip: float = 1.0
    seed: int = 0
    data_seed: int | None = None  # None: the seed
    rtc_training_max_delay: int = 0
    rtc_slowed_prefix: float = 0.0  # share of examples whose RTC prefix is slowed (objectives)
    init_from: Path | None = None  # a checkpoint folder whose weights a new run starts from
    time_budget_s: float | None = None
    prompt_format: str = "openpi_subtask"
    max_token_len: int | None = None  # None: the preset's
    augment: bool = True
    flat_fraction: float = 0.25
    relative_actions: bool = False  # arm dims relative to the chunk's start state (LeRobot's)
    state_noise: float = 0.0  # std of noise on the prompt's normalised state (`BatchMaker`)
    state_dropout: float = 0.0  # share of examples whose prompt shows a random state
    start_share: float = 0.0  # share of examples from their episode's first start_frames
    start_frames: int = 5
    narration: str = "held"  # held / event (`dataset.NARRATION_MODES`), or none: no narration loss
    text_weight: float = 1.0
    knowledge_insulation: bool = True
    log_every: int = 10
    threads: int = 0  # torch CPU threads (0: torch's default, every core)
    image_positions: str = "learned"  # or "sincos": fixed 2-D sin-cos, frozen (IMAGE_POSITIONS)
    grounding: tuple[Path, ...] = ()  # GroundingScenes files (.npz) for co-training
    grounding_heldout: Path | None = None  # GroundingScenes for the probe
    grounding_batch_size: int = 16
    grounding_weight: float = 1.0
    question_weights: tuple[tuple[str, float], ...] = ()  # (kind, weight) over KIND_WEIGHTS
    grounding_only_steps: int = 0  # steps of questions alone before the demonstrations join
    one_colour_steps: int = 0  # steps asking the warm-up's questions only
    probe_every: int = 500
    probe_scenes: int = 150
    resume: bool = False  # continue from out/resume.pt
    resume_every_s: float = 300.0
    stage: str = "main"  # this call's stage of a curriculum (module docstring)
    gates: tuple[tuple[str, float], ...] = ()  # (probe key, minimum): all met ends the stage
    command: str = ""

    @property
    def effective_data_seed(self) -> int:
        return self.seed if self.data_seed is None else self.data_seed


IMAGE_POSITIONS = ("learned", "sincos")
RESUME_FILE = "resume.pt"


def parse_gate(text: str) -> tuple[str, float]:
    """``"start/where>=0.95"`` -> ``("start/where", 0.95)``.

    Raises:
        ValueError: not ``KEY>=NUMBER`` with a number in [0, 1].
    """
    key, sep, value = text.partition(">=")
    try:
        minimum = float(value)
    except ValueError:
        minimum = math.nan
    if not sep or not key.strip() or not 0.0 <= minimum <= 1.0:
        raise ValueError(f"a gate is PROBE_KEY>=NUMBER in [0, 1] (start/where>=0.95), got {text!r}")
    return key.strip(), minimum


def parse_question_weight(text: str) -> tuple[str, float]:
    """``"where_pad=0.2"`` -> ``("where_pad", 0.2)``.

    Raises:
        ValueError: not ``KIND=NUMBER`` with a question kind and a number >= 0.
    """
    kind, sep, value = text.partition("=")
    try:
        weight = float(value)
    except ValueError:
        weight = math.nan
    if not sep or kind.strip() not in QUESTION_KINDS or not weight >= 0.0:
        raise ValueError(
            f"a question weight is KIND=NUMBER >= 0 with KIND one of {', '.join(QUESTION_KINDS)}, "
            f"got {text!r}"
        )
    return kind.strip(), weight


def parse_task_filter(text: str, datasets: Sequence[Path]) -> tuple[Path, str]:
    """``"data/dagger=^put "`` -> ``(Path("data/dagger"), "^put ")``: train only on that
    dataset's episodes whose task matches the pattern.

    Raises:
        ValueError: not ``DATASET=PATTERN``, or a folder that is not one of ``datasets``.
    """
    folder, sep, pattern = text.partition("=")
    if not sep or not folder.strip() or not pattern:
        raise ValueError(f"a task filter is DATASET=PATTERN (data/dagger=^put ), got {text!r}")
    root = Path(folder.strip())
    if root not in {Path(d) for d in datasets}:
        raise ValueError(
            f"task filter {text!r} names {str(root)!r}, which is not one of the --dataset "
            f"folders: {', '.join(str(d) for d in datasets)}"
        )
    return root, pattern


def gates_met(gates: Sequence[tuple[str, float]], accuracy: dict[str, float]) -> bool:
    """Whether every gate's probe figure reaches its minimum (a figure the probe lacks: not met)."""
    return bool(gates) and all(accuracy.get(key, -1.0) >= minimum for key, minimum in gates)


@dataclasses.dataclass
class StepLog:
    step: int
    flow: float
    text: float
    text_tokens: int
    lr: float
    seconds: float  # wall time since the loop started
    grounding: float = 0.0  # the grounding questions' text loss (0 without them)


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


def load_weights(model: Pi05Model, checkpoint_dir: Path) -> None:
    """``model``'s weights from a checkpoint folder the loader reads (any layout it reads).

    Raises:
        ValueError: the checkpoint's model is not ``model``'s shape (another preset).
    """
    source = load_checkpoint(checkpoint_dir).model
    try:
        model.load_state_dict(source.state_dict())
    except RuntimeError as exc:
        raise ValueError(f"{checkpoint_dir} does not fit the model being trained: {exc}") from None


def _names(paths: tuple[Path, ...]) -> str:
    return " + ".join(str(p) for p in paths)


def freeze_sincos_positions(model: Pi05Model) -> None:
    """Write fixed 2-D sin-cos values into the vision tower's position table and freeze it (the
    checkpoint's layout is unchanged: loaders read the table as before)."""
    vision = model.config.vision
    table = model.paligemma_with_expert.paligemma.model.vision_tower.vision_model.embeddings
    grid = vision.image_size // vision.patch_size
    table.position_embedding.weight.data.copy_(sincos_positions(grid, vision.width))
    table.position_embedding.weight.requires_grad_(False)


def _window_mean(history: list[StepLog], name: str, count: int) -> float:
    values = [getattr(h, name) for h in history[-count:]]
    return float(np.mean(values)) if values else math.nan


def _dataset_frames(root: Path, narration: str, settings: TrainSettings) -> TrainingFrames:
    frames = load_training_frames(root, narration)
    for filtered, pattern in settings.task_filters:
        if Path(filtered) == Path(root):
            frames = episodes_with_task(frames, pattern)
    return frames


def train(settings: TrainSettings, log: Callable[[str], None] = print) -> TrainResult:
    """Train from random weights (or ``out/resume.pt`` with ``resume``) on ``settings.datasets``
    (and grounding questions, when given) and write the checkpoint to ``settings.out``.

    Raises:
        TrainingDataError / BatchError (ValueErrors): a dataset, format or preset that do not fit,
            named in the message.
        FileNotFoundError: ``resume`` without a resume file.
    """
    if settings.image_positions not in IMAGE_POSITIONS:
        raise ValueError(
            f"image_positions must be one of {IMAGE_POSITIONS}, got {settings.image_positions!r}"
        )
    torch.manual_seed(settings.seed)
    if settings.threads:
        torch.set_num_threads(settings.threads)
    held = "event" if settings.narration == "none" else settings.narration
    frames = concatenate_frames([_dataset_frames(d, held, settings) for d in settings.datasets])
    config = model_config(settings, frames)
    relative = (
        relative_action_mask(frames.actions.shape[1], frames.action_names, RELATIVE_EXCLUDE)
        if settings.relative_actions
        else ()
    )
    if settings.init_from is not None and relative:
        raise ValueError("--init-from keeps the checkpoint's absolute-action statistics: drop "
                         "--relative-actions")  # fmt: skip
    norms = (
        checkpoint_norms(settings.init_from)
        if settings.init_from is not None
        else dataset_norms(frames, relative, config.action_horizon)
    )
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

    def grounding_maker(paths: Sequence[Path]) -> GroundingBatchMaker:
        scenes = GroundingScenes.concatenate([GroundingScenes.load(p) for p in paths])
        return GroundingBatchMaker(
            scenes,
            config,
            tokenizer,
            prompt_format,
            norms.state.normalize,
            frames.cameras,
            conventions.border,
            KIND_WEIGHTS | dict(settings.question_weights),
        )

    questions = grounding_maker(settings.grounding) if settings.grounding else None
    heldout = grounding_maker([settings.grounding_heldout]) if settings.grounding_heldout else None
    model = new_model(config, settings.seed)
    if settings.image_positions == "sincos":
        freeze_sincos_positions(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        trained,
        lr=settings.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=settings.weight_decay,
    )
    rng = np.random.default_rng(settings.effective_data_seed)
    augment_generator = torch.Generator().manual_seed(settings.effective_data_seed)
    flow_generator = torch.Generator().manual_seed(settings.seed)
    history: list[StepLog] = []
    probes: list[dict[str, Any]] = []
    resume_path = Path(settings.out) / RESUME_FILE
    first_step, seconds_before = 0, 0.0
    stages: list[dict[str, Any]] = []  # every stage's name, first and last step, how it ended
    if settings.resume:
        state = torch.load(resume_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        rng.bit_generator.state = state["rng"]
        augment_generator.set_state(state["augment_generator"])
        flow_generator.set_state(state["flow_generator"])
        history = [StepLog(**h) for h in state["history"]]
        probes = state["probes"]
        stages = state.get("stages", [])
        first_step = len(history)
        seconds_before = history[-1].seconds if history else 0.0
        log(f"resumed from {resume_path} at step {first_step}")
    elif settings.init_from is not None:
        load_weights(model, settings.init_from)
        log(f"weights from {settings.init_from}")
    average = WeightAverage(model, settings.ema_decay) if settings.ema_decay else None
    if settings.resume and average is not None and "weight_average" in state:
        average.load_state_dict(state["weight_average"])  # else it starts from these weights
    names = [s["stage"] for s in stages]
    if settings.stage in names[:-1]:
        log(f"stage {settings.stage!r} is over: later stages ({names[-1]!r}) ran; nothing to do")
        return _result_of(settings, history)
    if names[-1:] != [settings.stage]:
        stages.append(
            {
                "stage": settings.stage,
                "first_step": first_step,
                "gated": False,  # ended by its gates: never trained again
                "ended": "",  # how it ended, in words
                "command": settings.command,
            }
        )
    stage = stages[-1]
    gated = stage.get("gated", False)
    if gated:  # the checkpoint is written again, the training not repeated
        log(f"stage {settings.stage!r} ended already ({stage['ended']})")
    else:
        stage["ended"] = ""  # a stage stopped by its budget or step count goes on
    stage_start = stage["first_step"]
    stage_seconds_before = history[stage_start - 1].seconds if stage_start else 0.0
    log(
        f"dataset {_names(settings.datasets)}: {len(frames)} frames, "
        f"{frames.num_episodes} episodes, "
        f"cameras {list(frames.cameras)}; preset {config.name} "
        f"({sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params); prompt format "
        f"{prompt_format.name}: longest action prompt {longest_prompt} tokens, with narration "
        f"{longest} (max_token_len {config.max_token_len})"
        + (f"; {len(questions.scenes)} grounding scenes" if questions else "")
    )

    def run_probe(step: int) -> dict[str, float]:
        if heldout is None:
            return {}
        with average.applied(model) if average else contextlib.nullcontext():
            accuracy = probe(model, heldout, settings.probe_scenes)
        probes.append({"step": step, "stage": settings.stage, **accuracy})
        log(f"probe at step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in accuracy.items()))
        return accuracy

    def save_resume() -> None:
        resume_path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "rng": rng.bit_generator.state,
                "augment_generator": augment_generator.get_state(),
                "flow_generator": flow_generator.get_state(),
                "history": [dataclasses.asdict(h) for h in history],
                "probes": probes,
                "stages": stages,
                **({"weight_average": average.state_dict()} if average else {}),
            },
            resume_path,
        )

    start = time.monotonic() - seconds_before
    last_save = time.monotonic()
    last_step = first_step if gated else stage_start + settings.steps
    for step in range(first_step, last_step):
        in_stage = step - stage_start
        lr = learning_rate(
            in_stage, settings.lr, settings.warmup_steps, settings.steps, settings.final_lr_fraction
        )
        for group in optimizer.param_groups:
            group["lr"] = lr
        total, flow, text, tokens, grounding = _step_losses(
            settings, model, maker, questions, in_stage, rng, augment_generator, flow_generator
        )
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(trained, settings.grad_clip)
        optimizer.step()
        if average is not None:
            average.update(model)
        history.append(StepLog(step, flow, text, tokens, lr, time.monotonic() - start, grounding))
        if not math.isfinite(flow + text + grounding):
            raise FloatingPointError(f"step {step}: a non-finite loss ({history[-1]})")
        done = step + 1
        if done % settings.log_every == 0 or done == stage_start + settings.steps:
            elapsed = history[-1].seconds - stage_seconds_before
            log(
                f"step {done:5d}  flow {_window_mean(history, 'flow', settings.log_every):.4f}  "
                f"text {_window_mean(history, 'text', settings.log_every):.4f}  "
                + (
                    f"grounding {_window_mean(history, 'grounding', settings.log_every):.4f}  "
                    if questions
                    else ""
                )
                + f"lr {lr:.2e}  {(done - stage_start) / elapsed:.2f} steps/s"
            )
        if settings.probe_every and done % settings.probe_every == 0:
            if gates_met(settings.gates, run_probe(done)):
                stage["gated"] = True
                stage["ended"] = f"gates met at step {done}"
                log(f"stage {settings.stage!r}: {stage['ended']}")
                break
        if time.monotonic() - last_save >= settings.resume_every_s:
            save_resume()
            last_save = time.monotonic()
        stage_seconds = history[-1].seconds - stage_seconds_before
        if settings.time_budget_s is not None and stage_seconds >= settings.time_budget_s:
            stage["ended"] = f"time budget of {settings.time_budget_s:.0f} s spent at step {done}"
            log(f"stage {settings.stage!r}: {stage['ended']}")
            break
    else:
        stage["ended"] = stage["ended"] or f"{settings.steps} steps done"
    stage["last_step"] = len(history)
    if not probes or probes[-1]["step"] != len(history):
        run_probe(len(history))
    if settings.gates and not stage["gated"]:
        log(f"stage {settings.stage!r}: gates not met ({stage['ended']})")
    save_resume()
    result = _result_of(settings, history)
    if average is not None:
        average.copy_to(model)
    model.eval().requires_grad_(False)
    record = _record(settings, frames, history, result, config)
    record["probes"] = probes
    record["stages"] = stages
    if questions is not None:
        record["grounding_scenes"] = len(questions.scenes)
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
        f"final losses (last {settings.log_every} steps): flow {result.final_flow:.4f}, text "
        f"{result.final_text:.4f}; {len(history)} steps in {record['train_seconds']:.0f} s "
        f"({result.steps_per_second:.2f} steps/s); checkpoint {settings.out}"
    )
    return result


def _result_of(settings: TrainSettings, history: list[StepLog]) -> TrainResult:
    elapsed = history[-1].seconds if history else 0.0
    return TrainResult(
        Path(settings.out),
        history,
        len(history) / elapsed if elapsed > 0 else math.nan,
        _window_mean(history, "flow", settings.log_every),
        _window_mean(history, "text", settings.log_every),
    )


def _step_losses(
    settings: TrainSettings,
    model: Pi05Model,
    maker: BatchMaker,
    questions: GroundingBatchMaker | None,
    step: int,
    rng: np.random.Generator,
    augment_generator: torch.Generator,
    flow_generator: torch.Generator,
) -> tuple[torch.Tensor, float, float, int, float]:
    """One step's (total, flow, text, text tokens, grounding): the demonstrations' losses (not
    during the grounding-only warm-up) plus the weighted grounding questions' text loss."""
    total = torch.zeros(())
    flow = text = grounding = 0.0
    tokens = 0
    if step >= settings.grounding_only_steps or questions is None:
        batch = maker.batch(maker.sample_indices(settings.batch_size, rng), rng, augment_generator)
        sample = sample_flow(
            batch.actions,
            settings.rtc_training_max_delay,
            flow_generator,
            settings.rtc_slowed_prefix,
        )
        losses: Losses = training_losses(
            model, batch, sample, settings.text_weight, settings.knowledge_insulation
        )
        total = total + losses.total
        flow, text, tokens = (
            float(losses.flow.detach()),
            float(losses.text.detach()),
            losses.text_tokens,
        )
    if questions is not None:
        one_colour = step < settings.one_colour_steps
        loss, _ = text_only_loss(
            model, questions.batch(settings.grounding_batch_size, rng, one_colour)
        )
        total = total + settings.grounding_weight * loss
        grounding = float(loss.detach())
    return total, flow, text, tokens, grounding


def _record(
    settings: TrainSettings,
    frames: TrainingFrames,
    history: list[StepLog],
    result: TrainResult,
    config: Pi05Config,
) -> dict[str, Any]:
    fields = dataclasses.asdict(settings)
    fields = {k: (str(v) if isinstance(v, Path) else v) for k, v in fields.items()}
    fields["datasets"] = [str(d) for d in settings.datasets]
    fields["grounding"] = [str(g) for g in settings.grounding]
    fields["task_filters"] = [f"{root}={pattern}" for root, pattern in settings.task_filters]
    fields["gates"] = [f"{key}>={minimum}" for key, minimum in settings.gates]
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
        "steps_per_second": result.steps_per_second,
        "final": {"flow": result.final_flow, "text": result.final_text},
        "history": [dataclasses.asdict(h) for h in history],
        "torch": torch.__version__,
    }
