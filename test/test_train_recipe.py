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
    "PLACE": "1",
    "START_LAYOUTS": "3",
    "MOVED_LAYOUTS": "2",
    "HELDOUT": "2",
    "START_STEPS": "2",
    "ALL_STEPS": "2",
    "DEMO_STEPS": "3",
    "ONE_COLOUR": "1",
    "PROBE_EVERY": "1",
    "PROBE_SCENES": "4",
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


def test_the_recipe_renders_trains_in_stages_and_resumes(tmp_path):
    work = tmp_path / "sim_policy"
    first = run_recipe(work)
    assert first.returncode == 0, first.stdout + first.stderr
    checkpoint = work / "checkpoint"
    record = json.loads((checkpoint / "training.json").read_text())
    stages = [(s["stage"], s["first_step"], s["last_step"]) for s in record["stages"]]
    assert stages == [("ground_start", 0, 2), ("ground_all", 2, 4), ("demos", 4, 7)]
    assert record["steps_done"] == 7 and not record["knowledge_insulation"]
    assert record["flat_fraction"] == 0.1 and record["image_positions"] == "sincos"
    assert len(record["datasets"]) == 2 and len(record["grounding"]) == 2
    assert [h["flow"] > 0 for h in record["history"]] == [False] * 4 + [True] * 3
    for data in ("demos_clean", "demos_dart"):
        assert (work / data / "meta" / "info.json").is_file()
    views = json.loads(first.stdout.splitlines()[3])["views"]  # the moved-arm scenes' summary
    assert set(views) <= {"start", "along", "dart", "off_course"} and len(views) > 1
    policy = load_policy(checkpoint)
    assert policy.image_slots == ("observation.images.scene", "observation.images.wrist")

    again = run_recipe(work)  # everything there: no stage trained again
    assert again.returncode == 0, again.stdout + again.stderr
    assert again.stdout.count("nothing to do") == 2, again.stdout
    assert json.loads((checkpoint / "training.json").read_text())["steps_done"] == 7

    (checkpoint / "model.safetensors").unlink()  # as if stopped before the end
    resumed = run_recipe(work)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert (checkpoint / "model.safetensors").is_file()
