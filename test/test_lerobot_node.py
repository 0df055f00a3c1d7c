"""A LeRobot pi05 folder in the real node over DDS: refused folders leave the node alive and
unconfigured, saying why; a good one configures, logs its format, and publishes chunks of its
n_action_steps from the camera keys the params map the robot's topics onto."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import signal
import time

import pytest
from lifecycle_msgs.msg import Transition
from node_harness import (
    STATE_ACTIVE,
    STATE_UNCONFIGURED,
    SYNTHETIC_INPUT_TOPICS,
    NodeProcess,
    Probe,
    wait_for,
)
from safetensors.torch import load_file, save_file

from oxygen_ros.checkpoints.core import build_model, init_random_weights
from oxygen_ros.checkpoints.lerobot_writer import lerobot_stats, write_lerobot_folder
from oxygen_ros.model.config import get_preset
from oxygen_ros.tools.make_bag import camera_topic, joint_names, write_synthetic_bag
from oxygen_ros.tools.make_checkpoint import synthetic_norm_stats

pytestmark = [pytest.mark.ros, pytest.mark.slow]

CAMERAS = ["observation.images.base", "observation.images.wrist"]
N_ACTION_STEPS = 4
ACTION_JOINTS = joint_names(6)


def _folder(root, tokenizer):
    model = init_random_weights(
        build_model(dataclasses.replace(get_preset("tiny"), max_token_len=200)), 11
    )
    stats = synthetic_norm_stats(7, 3)
    action = lerobot_stats(stats["actions"])
    write_lerobot_folder(
        root,
        model,
        {
            "observation.state": lerobot_stats(stats["state"]),
            "action": {k: v[:6] for k, v in action.items()},
        },
        cameras=CAMERAS,
        state_dim=7,
        action_dim=6,
        n_action_steps=N_ACTION_STEPS,
    )
    shutil.copy(tokenizer, root / "tokenizer.model")
    return root


def _broken(good, root, name, edit):
    folder = shutil.copytree(good, root / name)
    edit(folder)
    return folder


def _retype(folder):
    config = json.loads((folder / "config.json").read_text())
    config["type"] = "pi0"
    (folder / "config.json").write_text(json.dumps(config))


def _edit_weights(edit):
    def apply(folder):
        tensors = load_file(str(folder / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(folder / "model.safetensors"))

    return apply


NORM = "model.paligemma_with_expert.paligemma.model.language_model.norm.weight"
REFUSED = {
    "pi0": (_retype, "policy type 'pi0'"),
    "no_stats": (
        lambda f: (f / "policy_postprocessor_step_0_unnormalizer_processor.safetensors").unlink(),
        "statistics file",
    ),
    "unknown_key": (
        _edit_weights(lambda t: t.update({"model.mystery.weight": t[NORM].clone()})),
        "unexpected tensors",
    ),
    "shape": (_edit_weights(lambda t: t.update({NORM: t[NORM][:3].clone()})), "wrong shapes"),
}


def _params(checkpoint):
    return {
        "checkpoint_dir": str(checkpoint),
        "rate_hz": 15.0,
        "camera_topics": [camera_topic("base"), camera_topic("wrist")],
        "camera_slots": CAMERAS,
        "joint_names": joint_names(7),
        "action_joint_names": ACTION_JOINTS,
        "action_horizon": 0,  # the checkpoint's n_action_steps
        "action_dt": 0.05,
        "max_observation_age_s": 1.0,
        "narration_period_s": 0.0,
        "task": "pick up the red block",
    }


def test_lerobot_folder_in_the_node_over_dds(tiny_checkpoint, tmp_path):
    good = _folder(tmp_path / "lerobot", tiny_checkpoint / "tokenizer.model")
    broken = {
        name: (_broken(good, tmp_path, name, edit), why) for name, (edit, why) in REFUSED.items()
    }
    bag = write_synthetic_bag(tmp_path / "bag", duration_s=3.0)
    name = "oxygen_lerobot"
    process = NodeProcess(_params(broken["pi0"][0]), tmp_path, name=name)
    probe = Probe(SYNTHETIC_INPUT_TOPICS, target=name)
    try:
        # autostart on a pi0 folder: configure fails, the node stays up and says why
        assert wait_for(lambda: "configure failed" in process.log(), 60), process.log()[-3000:]
        assert process.alive() and probe.get_state() == STATE_UNCONFIGURED
        for folder, why in broken.values():
            assert probe.set("checkpoint_dir", str(folder)).successful
            assert not probe.change_state(Transition.TRANSITION_CONFIGURE)
            assert process.alive() and probe.get_state() == STATE_UNCONFIGURED
            assert why in probe.fresh_diagnostics()["last_error"], folder
        assert probe.set("checkpoint_dir", str(good)).successful
        assert probe.change_state(Transition.TRANSITION_CONFIGURE), process.log()[-3000:]
        assert probe.change_state(Transition.TRANSITION_ACTIVATE)
        assert probe.get_state() == STATE_ACTIVE
        log = process.log()
        assert 'checkpoint format: LeRobot pi05 folder: config.json "type": "pi05"' in log
        assert "LeRobot 0.4 conventions" in log
        playback = probe.play_in_background(bag)
        try:
            since = time.monotonic()
            assert wait_for(lambda: len(probe.chunks_since(since)) >= 5, 30), log[-3000:]
            for chunk in probe.chunks_since(since):
                assert (chunk.horizon, chunk.action_dim) == (N_ACTION_STEPS, 6)
                assert list(chunk.joint_names) == ACTION_JOINTS
                assert chunk.action_space == "position"
                assert all(math.isfinite(a) for a in chunk.actions)
        finally:
            playback.stop()
    finally:
        probe.close()
        assert process.stop(signum=signal.SIGTERM) == 0, process.log()[-3000:]
