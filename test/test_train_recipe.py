"""scripts/train_sim_policy.sh, the shipped checkpoint's recipe, end to end at a tiny size: it
renders its data, trains, leaves a checkpoint the loader reads, and a second run resumes or
skips instead of starting over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from oxygen_ros.policy_io.policy import load_policy

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "train_sim_policy.sh"
TINY = {
    "TOUCH": "2",
    "DART_TOUCH": "2",
    "LAYOUTS": "3",
    "HELDOUT": "2",
    "STEPS": "3",
    "GROUNDING_ONLY": "1",
    "ONE_COLOUR": "1",
    "RESUME_EVERY_MIN": "0.0001",  # a resume file after every step
}


def run_recipe(work: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, **TINY, BIN=str(Path(sys.executable).parent), MUJOCO_GL="egl")
    return subprocess.run(
        ["bash", str(SCRIPT), str(work)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_recipe_renders_trains_and_resumes(tmp_path):
    work = tmp_path / "sim_policy"
    first = run_recipe(work)
    assert first.returncode == 0, first.stdout + first.stderr
    checkpoint = work / "checkpoint"
    record = json.loads((checkpoint / "training.json").read_text())
    assert record["steps_done"] == 3 and not record["knowledge_insulation"]
    assert record["flat_fraction"] == 0.1 and record["image_positions"] == "sincos"
    assert len(record["datasets"]) == 2 and len(record["grounding"]) == 1
    for data in ("touch_settle", "touch_dart_settle"):
        assert (work / data / "meta" / "info.json").is_file()
    policy = load_policy(checkpoint)
    assert policy.image_slots == ("observation.images.scene", "observation.images.wrist")

    again = run_recipe(work)  # everything there: nothing redone
    assert again.returncode == 0 and "already trained" in again.stdout, again.stderr

    (checkpoint / "model.safetensors").unlink()  # as if stopped before the end
    resumed = run_recipe(work)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert (checkpoint / "model.safetensors").is_file()
