"""Train pi0.5 on a LeRobotDataset with its own objectives (``oxygen-train``).

::

    oxygen-train --dataset datasets/sim --out checkpoints/sim_tiny --preset tiny --steps 2000 \\
        --batch-size 8 --seed 0 --rtc-training-max-delay 4 --time-budget-min 10

Flow matching on the action chunks, cross-entropy on the subtask and narration text, openpi's
image augmentation and training-time RTC (``oxygen_ros.training``, ``oxygen_ros.model.objectives``).
The tiny and small presets get a tiny sentencepiece tokenizer trained on the built-in corpus plus
the dataset's own texts (so "cube", "pad", "grasp" are pieces); ``--tokenizer`` gives one instead.
Writes a LeRobot ``pi05`` folder that ``load_policy`` and the node read unchanged, with the
tokenizer, ``training.json`` (this command, the seeds, the loss history) and a README. Prints the
losses every ``--log-every`` steps, the steps/s and the final losses.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from oxygen_ros.checkpoints.core import TOKENIZER_FILENAME
from oxygen_ros.model.config import PRESETS, get_preset
from oxygen_ros.policy_io.prompts import PRESETS as PROMPT_FORMATS
from oxygen_ros.sim.questions import question_sentences
from oxygen_ros.tools.cli import positive_float, positive_int
from oxygen_ros.tools.tiny_tokenizer import train_tiny_tokenizer
from oxygen_ros.training.dataset import NARRATION_MODES, dataset_texts
from oxygen_ros.training.trainer import (
    IMAGE_POSITIONS,
    RESUME_FILE,
    TrainSettings,
    parse_gate,
    parse_question_weight,
    parse_task_filter,
    train,
)

# a tokenizer trained here covers the prompt formats' fixed words as well as the dataset's
FORMAT_SENTENCES = (
    "Task: {task}, State: 12 200 128 3 45 250;\nSubtask: {subtask}\nAction: ",
    "\nNarrate: {narration}",
    "\nQuestion: {narration}\nAnswer: {narration}",
)


def tokenizer_sentences(texts: Sequence[str]) -> list[str]:
    """The extra corpus for a dataset's tokenizer: its texts, and each in the prompts' frames."""
    sentences = list(texts)
    for text in texts:
        sentences += [s.format(task=text, subtask=text, narration=text) for s in FORMAT_SENTENCES]
    return sentences


def dataset_tokenizer(
    datasets: Sequence[Path], out_dir: Path, vocab_size: int, grounding: bool = False
) -> Path:
    """Train the tiny tokenizer with the ``datasets``' texts (and the grounding questions' and
    answers' wordings, with ``grounding``) into ``out_dir/tokenizer.model``."""
    texts = {text for dataset in datasets for text in dataset_texts(dataset)}
    if grounding:
        texts |= set(question_sentences())
    texts = sorted(texts)
    return train_tiny_tokenizer(
        out_dir / TOKENIZER_FILENAME, vocab_size, tokenizer_sentences(texts)
    )


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="oxygen-train", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument(
        "--dataset",
        type=Path,
        required=True,
        action="append",
        help="LeRobotDataset v3 folder; repeat it to train on several together",
    )
    parser.add_argument(
        "--task-filter",
        action="append",
        default=[],
        metavar="DATASET=PATTERN",
        help="train only on DATASET's episodes whose task matches the regular expression "
        "PATTERN, e.g. the place takeovers of an on-policy set: data/dagger='^put '; repeatable",
    )
    parser.add_argument("--out", type=Path, required=True, help="checkpoint folder to write")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--steps", type=positive_int, default=1000)
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--lr", type=positive_float, default=5e-4, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=50)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument(
        "--ema-decay",
        type=float,
        default=0.0,
        help="keep a moving average of the weights with this decay (openpi: 0.99) and write it "
        "as the checkpoint; the probes read it too (default 0: the last step's weights)",
    )
    parser.add_argument("--grad-clip", type=positive_float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="weights and flow-matching draws")
    parser.add_argument(
        "--data-seed", type=int, default=None, help="frames and augmentation (default: --seed)"
    )
    parser.add_argument(
        "--rtc-training-max-delay",
        type=int,
        default=0,
        help="training-time RTC: clean action prefixes of 0..D steps (0: off)",
    )
    parser.add_argument(
        "--rtc-slowed-prefix",
        type=float,
        default=0.0,
        help="training-time RTC: this share of the examples shows a slowed or still prefix "
        "before the demonstration's own continuation (a stalled arm is not the motion's end)",
    )
    parser.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="a checkpoint folder whose weights a new run starts from (same preset; give its "
        "tokenizer with --tokenizer)",
    )
    parser.add_argument("--time-budget-min", type=positive_float, default=None)
    parser.add_argument("--prompt-format", default="openpi_subtask", choices=list(PROMPT_FORMATS))
    parser.add_argument(
        "--max-token-len", type=positive_int, default=None, help="default: the preset's"
    )
    parser.add_argument(
        "--flat-fraction",
        type=float,
        default=0.25,
        help="share of frames with a subtask given the plain action prompt instead",
    )
    parser.add_argument(
        "--relative-actions",
        action="store_true",
        help="learn the arm's actions relative to the state at the chunk's start (LeRobot's "
        "relative actions; the gripper stays absolute); the folder says so and the loader adds "
        "the state back",
    )
    parser.add_argument(
        "--state-noise",
        type=float,
        default=0.0,
        help="std of Gaussian noise on the prompt's normalised state ([-1, 1] units; default 0)",
    )
    parser.add_argument(
        "--state-dropout",
        type=float,
        default=0.0,
        help="share of examples whose prompt shows a uniformly random state instead (default 0)",
    )
    parser.add_argument(
        "--start-share",
        type=float,
        default=0.0,
        help="share of examples drawn from their episode's first --start-frames frames, where "
        "only the images and the task say where to go (default 0: frames uniformly)",
    )
    parser.add_argument("--start-frames", type=positive_int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads (default 0: torch's own, every core); give two runs sharing a "
        "machine one core each rather than letting both take all (here 13 steps/s each vs 1.6)",
    )
    parser.add_argument(
        "--narration",
        default="held",
        choices=[*NARRATION_MODES, "none"],
        help="held: every frame's latest sentence; event: only frames where one was said",
    )
    parser.add_argument("--text-weight", type=float, default=1.0)
    parser.add_argument("--no-augment", action="store_true")
    parser.add_argument(
        "--no-knowledge-insulation",
        action="store_true",
        help="let the flow loss train the backbone too (pi0.5 insulates it)",
    )
    parser.add_argument(
        "--tokenizer", type=Path, default=None, help="sentencepiece model (default: train one)"
    )
    parser.add_argument(
        "--image-positions",
        default="learned",
        choices=IMAGE_POSITIONS,
        help="sincos: fixed 2-D sin-cos image positions, frozen (a from-scratch ViT finds "
        "objects with them; the checkpoint layout is the same)",
    )
    parser.add_argument(
        "--grounding",
        type=Path,
        action="append",
        default=[],
        help="grounding scenes (oxygen-sim-dataset grounding); repeat for several: co-trains "
        "the backbone on questions about them",
    )
    parser.add_argument("--grounding-heldout", type=Path, help="held-out scenes for the probe")
    parser.add_argument("--grounding-batch-size", type=positive_int, default=16)
    parser.add_argument("--grounding-weight", type=float, default=1.0)
    parser.add_argument(
        "--question-weight",
        action="append",
        default=[],
        metavar="KIND=WEIGHT",
        help="how often a grounding question kind is drawn, relative to the others, in place of "
        "its default (sim/questions.py KIND_WEIGHTS), e.g. where_pad=0.2; repeatable",
    )
    parser.add_argument(
        "--grounding-only-steps",
        type=int,
        default=0,
        help="first steps on the grounding questions alone, before the demonstrations join",
    )
    parser.add_argument(
        "--one-colour-steps",
        type=int,
        default=0,
        help="first steps asking only where the first colour's cube is and where all cubes "
        "are (the warm-up that breaks the colours' symmetry)",
    )
    parser.add_argument("--probe-every", type=int, default=500, help="steps between probes")
    parser.add_argument("--probe-scenes", type=positive_int, default=150)
    parser.add_argument(
        "--resume",
        action="store_true",
        help=f"continue from OUT/{RESUME_FILE} (same arguments, or the next --stage)",
    )
    parser.add_argument(
        "--resume-every-min", type=positive_float, default=5.0, help="minutes between resume files"
    )
    parser.add_argument(
        "--stage",
        default="main",
        help="this call's stage of a curriculum: with --resume, a new name starts a stage from "
        "the last one's weights (its own step counts and learning-rate schedule); the same name "
        "continues it",
    )
    parser.add_argument(
        "--gate",
        action="append",
        default=[],
        metavar="PROBE>=MIN",
        help="ends the stage at the first probe where every gate holds, e.g. start/where>=0.95 "
        "(keys as the probe logs them)",
    )
    parser.add_argument("--log-every", type=positive_int, default=10)
    args = parser.parse_args(argv)
    try:
        args.gate = tuple(parse_gate(g) for g in args.gate)
        args.question_weight = tuple(parse_question_weight(w) for w in args.question_weight)
        args.task_filter = tuple(parse_task_filter(f, args.dataset) for f in args.task_filter)
    except ValueError as exc:
        parser.error(str(exc))
    if args.gate and not (args.grounding_heldout and args.probe_every > 0):
        parser.error("--gate reads the probe: it needs --grounding-heldout and --probe-every > 0")
    if not 0.0 <= args.ema_decay < 1.0:
        parser.error(f"--ema-decay must be in [0, 1) (0: no average), got {args.ema_decay}")
    if args.threads < 0:
        parser.error(f"--threads must be >= 0 (0: torch's default), got {args.threads}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    command = shlex.join(["oxygen-train", *(sys.argv[1:] if argv is None else argv)])
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        resumed_tokenizer = args.out / TOKENIZER_FILENAME
        if args.resume and args.tokenizer is None and resumed_tokenizer.exists():
            args.tokenizer = resumed_tokenizer  # the run being resumed trained it
        tokenizer = args.tokenizer or dataset_tokenizer(
            args.dataset, args.out, get_preset(args.preset).vocab_size, bool(args.grounding)
        )
        settings = TrainSettings(
            datasets=tuple(args.dataset),
            task_filters=args.task_filter,
            out=args.out,
            tokenizer=tokenizer,
            preset=args.preset,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            warmup_steps=args.warmup_steps,
            weight_decay=args.weight_decay,
            ema_decay=args.ema_decay,
            grad_clip=args.grad_clip,
            seed=args.seed,
            data_seed=args.data_seed,
            rtc_training_max_delay=args.rtc_training_max_delay,
            rtc_slowed_prefix=args.rtc_slowed_prefix,
            init_from=args.init_from,
            time_budget_s=args.time_budget_min * 60 if args.time_budget_min else None,
            prompt_format=args.prompt_format,
            max_token_len=args.max_token_len,
            augment=not args.no_augment,
            flat_fraction=args.flat_fraction,
            relative_actions=args.relative_actions,
            state_noise=args.state_noise,
            state_dropout=args.state_dropout,
            start_share=args.start_share,
            start_frames=args.start_frames,
            threads=args.threads,
            narration=args.narration,
            text_weight=args.text_weight,
            knowledge_insulation=not args.no_knowledge_insulation,
            log_every=args.log_every,
            image_positions=args.image_positions,
            grounding=tuple(args.grounding),
            grounding_heldout=args.grounding_heldout,
            grounding_batch_size=args.grounding_batch_size,
            grounding_weight=args.grounding_weight,
            question_weights=args.question_weight,
            grounding_only_steps=args.grounding_only_steps,
            one_colour_steps=args.one_colour_steps,
            probe_every=args.probe_every,
            probe_scenes=args.probe_scenes,
            resume=args.resume,
            resume_every_s=args.resume_every_min * 60,
            stage=args.stage,
            gates=args.gate,
            command=command,
        )
        train(settings)
    except (ValueError, FileNotFoundError) as exc:
        print(f"oxygen-train: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
