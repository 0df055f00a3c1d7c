"""``oxygen-bench serve`` run minimally (real oxygen-serve processes, real sockets): every setting
is measured and written, and the GPU summary picks its figures up. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from oxygen_ros.tools.bench import main as bench_main

pytestmark = pytest.mark.slow


@pytest.mark.timeout(1200)  # three server processes load and warm up on a possibly busy machine
def test_serve_bench_measures_shared_and_separate_servers(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "serve.json"
    bench_main(
        [
            "serve",
            "--checkpoint",
            str(tiny_checkpoint),
            "--clients",
            "2,1",
            "--frames",
            "2",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--json",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert [row["clients"] for row in result["rows"]] == [1, 2]
    for row in result["rows"]:
        for mode in ("shared", "separate"):
            figures = row[mode]
            assert figures["frames_per_s"] > 0 and figures["worst_p99_ms"] >= figures["p50_ms"] > 0
            assert figures["rss_bytes"] > 0
            (sample,) = figures["rounds"]
            assert len(sample["clients"]) == row["clients"]
            assert all(c["deadline_misses"] <= 2 for c in sample["clients"])
        assert row["speedup_vs_separate"] > 0
    # one process for two robots, two processes for two: the separate servers hold more memory
    two = result["rows"][1]
    assert two["separate"]["rss_bytes"] > two["shared"]["rss_bytes"]
    printed = capsys.readouterr().out
    assert "shared" in printed and "separate" in printed

    bench_main(["summary", "--dir", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["figures"]["serve_2clients_speedup_vs_separate"] == two["speedup_vs_separate"]
    assert "serve" not in summary["missing"]
    assert "serve_4clients_speedup_vs_separate" in summary["unmeasured"]
