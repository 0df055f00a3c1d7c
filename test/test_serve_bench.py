"""``oxygen-bench serve`` run minimally (real oxygen-serve processes, real sockets): both views
are measured with their runs interleaved, each side's runs kept with their range, and the GPU
summary picks up the equal-CPU figures. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from oxygen_ros.tools.bench import main as bench_main
from oxygen_ros.tools.benches.serve import available_cores, server_threads

pytestmark = pytest.mark.slow


def test_threads_give_both_sides_the_same_cores():
    assert server_threads("equal-cpu", "shared", 4, cores=16) == 16
    assert server_threads("equal-cpu", "separate", 4, cores=16) == 4
    assert server_threads("equal-cpu", "separate", 8, cores=2) == 1  # at least one each
    assert server_threads("one-thread", "shared", 4, cores=16) == 1
    assert server_threads("one-thread", "separate", 4, cores=16) == 1


@pytest.mark.timeout(1200)  # server processes load and warm up on a possibly busy machine
def test_serve_bench_measures_both_views_interleaved(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "serve.json"
    bench_main(
        [
            "serve",
            "--checkpoint", str(tiny_checkpoint),
            "--clients", "2",
            "--frames", "2",
            "--warmup", "1",
            "--repeats", "2",
            "--json", str(out),
        ]
    )  # fmt: skip
    result = json.loads(out.read_text())
    cores = available_cores()
    assert result["workload"]["cores"] == cores
    views = {"equal-cpu": result["rows"], "one-thread": result["one_thread_rows"]}
    for view, rows in views.items():
        (row,) = rows
        assert row["view"] == view and row["clients"] == 2
        for mode in ("shared", "separate"):
            figures = row[mode]
            assert figures["threads_per_server"] == server_threads(view, mode, 2, cores)
            fps = figures["frames_per_s"]
            assert figures["frames_per_s_min"] <= fps <= figures["frames_per_s_max"]
            assert figures["worst_p99_ms"] >= figures["p50_ms"] > 0
            assert figures["infer_p50_ms"] > 0 and figures["queue_p50_ms"] >= 0
            assert figures["rss_bytes"] > 0
            assert len(figures["runs"]) == 2
            assert all(len(run["clients"]) == 2 for run in figures["runs"])
        assert row["separate"]["mean_batch"] == 1
        assert 1 <= row["shared"]["mean_batch"] <= 2
        assert row["speedup_min"] <= row["speedup_vs_separate"] <= row["speedup_max"]
        # one process for two robots, two processes for two: the separate servers hold more
        assert row["separate"]["rss_bytes"] > row["shared"]["rss_bytes"]
    printed = capsys.readouterr().out
    assert "equal-cpu: " in printed and "one-thread: " in printed and "(min-max)" in printed

    bench_main(["summary", "--dir", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    speedup = result["rows"][0]["speedup_vs_separate"]
    assert summary["figures"]["serve_2clients_speedup_vs_separate"] == speedup
    assert "serve" not in summary["missing"]
    assert "serve_4clients_speedup_vs_separate" in summary["unmeasured"]


def test_bad_settings_are_refused_clearly():
    for flags, message in (
        (["--views", "fair"], "--views takes equal-cpu, one-thread"),
        (["--clients", "0"], "--clients takes positive counts"),
        (["--repeats", "0"], "--repeats must be >= 1"),
    ):
        with pytest.raises(SystemExit, match=message):
            bench_main(["serve", *flags])
