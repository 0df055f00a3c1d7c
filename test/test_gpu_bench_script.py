"""scripts/gpu_bench.sh end to end on the CPU (tiny preset, static paths without CUDA graphs), so
the GPU run only has the GPU left to go wrong; and a run that loses its steps still ends in a
summary that names what is missing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MEASUREMENTS = ("action", "engines", "realtime", "hierarchy", "serve")


def dry_run_env(out: Path, **overrides: str) -> dict[str, str]:
    """The script's CPU dry run (tiny preset, a few frames) writing into ``out``."""
    return dict(
        os.environ,
        PYTHON=sys.executable,
        PRESET="tiny",
        DEVICE="cpu",
        DTYPE="float32",
        INIT="cpu",
        FRAMES="3",
        WARMUP="2",
        REPEATS="3",
        TOKENS="8",
        RT_FRAMES="20",
        RT_WARMUP="5",
        SERVE_CLIENTS="1,2",
        OUT=str(out),
        **overrides,
    )


def run_script(env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_bench.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ~30 s on an idle 2-core machine, many minutes when another process holds a core (torch's threads
# then wait for each other): no step limit here (STEP_TIMEOUT=0), only this generous one
@pytest.mark.timeout(3000)
def test_gpu_bench_script_dry_run_on_cpu(tmp_path):
    out = tmp_path / "bench"
    result = run_script(dry_run_env(out, STEP_TIMEOUT="0"), timeout=2900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for name in (*MEASUREMENTS, "summary"):
        assert (out / f"{name}.json").is_file(), name
        assert (out / f"{name}.log").is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    figures = summary["figures"]
    for cameras in (1, 2, 3):
        for path in ("dynamic", "static"):
            assert figures[f"action_{cameras}cam_{path}_p99_ms"] > 0
    for engine in ("oxygen", "isolated-sequential", "shared-kv", "naive-parallel"):
        assert figures[f"engines_{engine}_frames_per_s"] > 0
    assert figures["realtime_frames_per_s"] > 0
    assert set(summary["targets"]) >= {
        "action_2cam_p99_ms",
        "oxygen_speedup_vs_isolated",
        "realtime_tokens_per_s",
    }
    engines = json.loads((out / "engines.json").read_text())
    assert engines["errors"] == {} and engines["workload"]["static_shapes"] is True
    assert figures["serve_2clients_speedup_vs_separate"] > 0
    hierarchy = json.loads((out / "hierarchy.json").read_text())["modes"]
    assert set(hierarchy) == {"none", "per_call", "oxygen"}
    assert all(mode["frames_per_s"] > 0 for mode in hierarchy.values())
    log = (out / "gpu_bench.log").read_text()
    assert "MET" in log or "MISS" in log
    assert "(limit none)" in log
    assert not set(MEASUREMENTS) & set(summary["missing"]), summary["missing"]


@pytest.mark.timeout(900)
def test_gpu_bench_script_that_loses_every_step_still_summarises(tmp_path):
    """Every measuring step runs past its limit (10 ms: no bench even starts in that time, however
    idle the machine): the summary still runs and names each missing measurement and target, and
    the script fails naming the steps."""
    out = tmp_path / "bench"
    out.mkdir()
    (out / "action.json").write_text('{"rows": []}')  # an earlier run's figure must not count
    result = run_script(dry_run_env(out, STEP_TIMEOUT="0.01"), timeout=800)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    assert "FAILED steps: action (exit 124)" in output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["figures"] == {} and summary["targets"] == {}
    for name in MEASUREMENTS:
        assert "ran past its time limit" in summary["missing"][name], summary["missing"]
        assert f"MISSING {name}: the step ran past its time limit" in output
    assert "action_2cam_p99_ms" in summary["unmeasured"]
    assert "MISSING target oxygen_speedup_vs_isolated: no figure" in output
    assert "no figures: no measurement finished" in output


def test_print_table_without_rows_prints_the_header(capsys):
    from oxygen_ros.tools.benches.common import print_table

    print_table([], ["figure", "value"])
    assert capsys.readouterr().out.split() == ["figure", "value"]


def test_gpu_bench_script_refuses_a_python_without_cuda(tmp_path):
    """On a machine without CUDA the default (DEVICE=cuda) run stops at once with the reason."""
    import torch

    if torch.cuda.is_available():
        return  # the check passes on a GPU machine; nothing to refuse
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "bench"))
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_bench.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "torch.cuda.is_available() is False" in result.stdout + result.stderr
