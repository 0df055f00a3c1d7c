"""`oxygen-serve` as a process: loads the checkpoint, says where it listens, checks the key file,
serves an openpi client, and refuses what it cannot load with a clear message."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import websockets
from serve_helpers import OpenpiClient, libero_observation

from oxygen_ros.tools.serve import _parse_args, build_server, read_api_key, subtask_rules


def test_serves_an_openpi_client_with_the_key_from_a_file(tiny_checkpoint, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("k3y\n")
    command = [
        sys.executable, "-m", "oxygen_ros.tools.serve", "--checkpoint", str(tiny_checkpoint),
        "--robot", "libero", "--port", "0", "--api-key-file", str(key_file),
    ]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        port = None
        for line in process.stderr:  # the log says where it listens (port 0: any free one)
            found = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
            if found:
                port = int(found.group(1))
                break
        assert port, "oxygen-serve exited before listening"
        uri = f"ws://127.0.0.1:{port}"
        with pytest.raises(websockets.InvalidStatus):
            OpenpiClient(uri)
        with OpenpiClient(uri, api_key="k3y") as client:
            assert client.metadata["robot"] == "libero"
            assert client.infer(libero_observation(1))["actions"].shape == (10, 7)
    finally:
        process.terminate()
        process.wait(60)


def test_a_checkpoint_that_is_not_there_is_refused_clearly(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "oxygen_ros.tools.serve", "--checkpoint", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("oxygen-serve: ") and "Traceback" not in result.stderr


def test_api_key_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("OXYGEN_SERVE_API_KEY", " from-env ")
    assert read_api_key(None) == "from-env"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_api_key(empty)
    monkeypatch.delenv("OXYGEN_SERVE_API_KEY")
    assert read_api_key(None) == ""


def test_the_subtask_rules_reach_every_sessions_engine(tiny_checkpoint):
    args = _parse_args(
        ["--checkpoint", str(tiny_checkpoint), "--prompt-format", "openpi_subtask",
         "--subtask-conditioning", "same_frame",
         "--subtask-confirmations", "3", "--subtask-period-s", "0.5",
         "--subtask-phase-order", "^reach ", "^carry ",
         "--subtask-held-pattern", "^carry ", "--subtask-held-dims", "6",
         "--subtask-held-range", "0.25", "0.8"]
    )  # fmt: skip
    config = build_server(args).engine_config
    assert (config.subtask_confirmations, config.subtask_period_s) == (3, 0.5)
    assert config.subtask_phase_order.advances("reach it", "carry it")
    gate = config.subtask_held_gate
    assert (gate.pattern, gate.dims, gate.low, gate.high) == ("^carry ", (6,), 0.25, 0.8)
    plain = subtask_rules(_parse_args(["--checkpoint", "x"]))
    assert plain == (None, None)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--subtask-held-pattern", "^carry "], "needs --subtask-held-dims"),
        (
            [
                "--subtask-held-pattern",
                "(carry",
                "--subtask-held-dims",
                "6",
                "--subtask-held-range",
                "0.2",
                "0.8",
            ],
            "pattern",
        ),  # fmt: skip
        (["--subtask-phase-order", "^reach "], "two phases"),
        (["--subtask-confirmations", "0"], "subtask_confirmations must be >= 1"),
    ],
)
def test_bad_subtask_rules_are_refused_before_the_model_loads(tmp_path, flags, message):
    result = subprocess.run(
        [sys.executable, "-m", "oxygen_ros.tools.serve", "--checkpoint", str(tmp_path / "none"),
         *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message in result.stderr
