"""What a training run leaves behind: a LeRobot ``pi05`` folder the node loads unchanged.

The folder is LeRobot main's layout (`checkpoints.lerobot_writer`, ``version="main"``): its
conventions (state bins of the real dims, float bilinear image resizing with -1 borders, LeRobot's
flow times) are the ones training fed the model. Beside LeRobot's files it holds the tokenizer
(``tokenizer.model``), ``training.json`` (the command, the seeds, the dataset, the settings, the
loss history) and a ``README.md`` saying how it was made and how the node must be configured.
``config.json`` declares ``rtc_training_max_delay``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from oxygen_ros.checkpoints.core import TOKENIZER_FILENAME
from oxygen_ros.checkpoints.lerobot_writer import write_lerobot_folder
from oxygen_ros.checkpoints.rtc_metadata import FIELD as RTC_FIELD
from oxygen_ros.model.pi05 import Pi05Model

from .dataset import IMAGE_PREFIX, TrainingFrames
from .normalization import RELATIVE_EXCLUDE, DatasetNorms

TRAINING_JSON = "training.json"
README = "README.md"


def write_trained_checkpoint(
    out_dir: Path,
    model: Pi05Model,
    frames: TrainingFrames,
    norms: DatasetNorms,
    tokenizer_path: Path,
    rtc_training_max_delay: int,
    record: Mapping[str, Any],
) -> Path:
    """Write the LeRobot folder, the tokenizer, ``training.json`` and ``README.md``."""
    out_dir = Path(out_dir)
    write_lerobot_folder(
        out_dir,
        model,
        norms.stats,
        cameras=frames.cameras,
        state_dim=frames.states.shape[1],
        action_dim=frames.actions.shape[1],
        version="main",
        norm_mode="QUANTILES",
        relative_actions=any(norms.relative),
        exclude_joints=RELATIVE_EXCLUDE if any(norms.relative) else (),
        action_names=frames.action_names,
        n_action_steps=model.config.action_horizon,
        config_overrides={RTC_FIELD: int(rtc_training_max_delay)},
    )
    if Path(tokenizer_path).resolve() != (out_dir / TOKENIZER_FILENAME).resolve():
        shutil.copyfile(tokenizer_path, out_dir / TOKENIZER_FILENAME)
    (out_dir / TRAINING_JSON).write_text(json.dumps(record, indent=2) + "\n")
    (out_dir / README).write_text(readme_text(frames, record))
    return out_dir


def readme_text(frames: TrainingFrames, record: Mapping[str, Any]) -> str:
    """How the checkpoint was made, and what the node needs to run it."""
    slots = ", ".join(
        f"{key} (topic of the {key[len(IMAGE_PREFIX) :]} camera)" for key in frames.cameras
    )
    final = record.get("final", {})
    lines = [
        "# pi0.5 trained by oxygen-train",
        "",
        "Reproduce (same code, same dataset):",
        "",
        "    " + record["command"],
        "",
        f"- datasets: {', '.join(f'`{d}`' for d in record['datasets'])} "
        f"({record['frames']} frames, {record['episodes']} episodes, {frames.fps} fps)",
        f"- model preset `{record['preset']}`, seed {record['seed']}, data seed "
        f"{record['data_seed']}; {record['steps_done']} steps of batch {record['batch_size']} "
        f"in {record['train_seconds']:.0f} s",
        f"- final losses (mean of the last {record['log_every']} steps): flow "
        f"{final.get('flow', float('nan')):.4f}, text {final.get('text', float('nan')):.4f}",
        f"- training-time RTC: `rtc_training_max_delay` {record['rtc_training_max_delay']}",
        *_grounding_lines(record),
        "",
        "Node parameters this checkpoint needs:",
        "",
        f"- `prompt_format: {record['prompt_format']}`",
        f"- cameras, in slot order: {slots}",
        f"- joints, in order: {', '.join(frames.action_names or [])}",
        "",
    ]
    return "\n".join(lines)


def _grounding_lines(record: Mapping[str, Any]) -> list[str]:
    """The co-training's data and the last held-out probe, when the run had them."""
    lines = []
    if record.get("grounding"):
        lines.append(
            f"- co-trained on {record.get('grounding_scenes', '?')} grounding scenes "
            f"({', '.join(f'`{g}`' for g in record['grounding'])}), "
            f"{record['grounding_batch_size']} questions a step, the first "
            f"{record['grounding_only_steps']} steps questions only; image positions "
            f"`{record['image_positions']}`"
        )
    for stage in record.get("stages", []):
        lines.append(
            f"- stage `{stage['stage']}`: steps {stage['first_step']}–{stage.get('last_step', '?')}"
            f", {stage['ended']}: `{stage.get('command', '')}`"
        )
    if record.get("probes"):
        last = record["probes"][-1]
        scores = ", ".join(f"{k} {v:.3f}" for k, v in last.items() if k not in ("step", "stage"))
        lines.append(f"- held-out grounding probe at step {last['step']}: {scores}")
    return lines
