"""scripts/gpu_bench.sh end to end on the CPU (tiny preset, static paths without CUDA graphs), so
the GPU run only has the GPU left to go wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(900)  # ~30 s on an idle 2-core machine; generous for a loaded CI host
def test_gpu_bench_script_dry_run_on_cpu(tmp_path):
    out = tmp_path / "bench"
    env = dict(
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
        OUT=str(out),
    )
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_bench.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    for name in ("action", "engines", "realtime", "hierarchy", "summary"):
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
    hierarchy = json.loads((out / "hierarchy.json").read_text())["modes"]
    assert set(hierarchy) == {"none", "per_call", "oxygen"}
    assert all(mode["frames_per_s"] > 0 for mode in hierarchy.values())
    log = (out / "gpu_bench.log").read_text()
    assert "MET" in log or "MISS" in log


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
