"""``oxygen-bench serve``: N robots on one ``oxygen-serve`` (sessions batched on one model) against
N separate single-robot servers, interleaved in one run.

Every server is a real ``oxygen-serve`` process on a random-weight checkpoint of ``--preset``
(written to a temporary folder, or ``--checkpoint``); every robot is a `PolicyClient` thread
running openpi's loop back to back: send an observation, wait for its chunk, send the next. For
each client count and round: the shared server with N clients, then N servers with one client
each (the order alternates by round, so drift of a shared machine hits both). Per setting:
aggregate frames/s over the window where all clients run, each client's p50/p99 round trip and
its misses of ``--deadline-ms``, and the servers' resident memory (one process vs the sum of N).
The numbers of a setting are the medians over ``--rounds``.

    oxygen-bench serve --preset tiny --clients 1,2,4,8 --json serve.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.serving.client import PolicyClient
from oxygen_ros.serving.client_observation import client_message
from oxygen_ros.tools.benches import common
from oxygen_ros.tools.benches.serve_processes import ServeProcess, free_port
from oxygen_ros.tools.benches.workloads import synthetic_observations
from oxygen_ros.tools.make_checkpoint import make_checkpoint

HELP = "N robots on one oxygen-serve vs N separate servers: frames/s, p99, deadline misses, RSS"
START_TIMEOUT_S = 600.0  # a server loads its checkpoint and warms up (minutes for pi05)
REPLY_TIMEOUT_S = 600.0  # a round trip that takes longer is an error, not a measurement


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand's arguments."""
    parser.add_argument("--preset", default="tiny", help="model preset of the random checkpoint")
    parser.add_argument("--checkpoint", type=Path, help="serve this checkpoint instead")
    parser.add_argument("--device", default="cpu", help="the servers' torch device")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--server-threads", type=int, default=1, help="torch threads of every server process"
    )
    parser.add_argument(
        "--clients", default="1,2,4,8", help="comma-separated robot counts (default 1,2,4,8)"
    )
    parser.add_argument("--cameras", type=int, default=2, help="camera images per observation")
    parser.add_argument("--steps", type=int, default=10, help="flow-matching denoising steps")
    parser.add_argument("--frames", type=int, default=30, help="measured frames per client")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured frames per client")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds (median)")
    parser.add_argument(
        "--deadline-ms",
        type=float,
        default=200.0,
        help="a client's deadline: a round trip longer than this is a miss",
    )
    parser.add_argument("--batch-window-ms", type=float, default=5.0, help="oxygen-serve's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write results as JSON here")


@dataclasses.dataclass
class ClientRun:
    """One client's measured frames: round trips (ms) and its window on the bench clock."""

    latencies_ms: list[float]
    start: float
    end: float


def run(args: argparse.Namespace) -> dict[str, object]:
    """Start the shared server and max(N) single-robot ones, measure every setting interleaved,
    print the table and write the JSON."""
    counts = sorted({int(n) for n in args.clients.split(",") if n.strip()})
    if not counts or counts[0] < 1:
        raise SystemExit(f"oxygen-bench serve: --clients takes positive counts, not {args.clients}")
    with tempfile.TemporaryDirectory(prefix="oxygen_serve_bench_") as tmp:
        work = Path(tmp)
        dtype = getattr(torch, args.dtype)
        checkpoint = args.checkpoint or make_checkpoint(
            work / "checkpoint", args.preset, args.seed, dtype=dtype, force=True
        )
        with servers(args, checkpoint, work, counts[-1]) as (shared, separate):
            samples = interleaved(args, counts, shared, separate)
    rows = [summarise(n, samples[(n, "shared")], samples[(n, "separate")]) for n in counts]
    print(
        f"serve: preset {args.preset}, {args.cameras} cameras, {args.steps} steps, device "
        f"{args.device}, server threads {args.server_threads}, deadline {args.deadline_ms:g} ms, "
        f"{args.frames} frames per client, median of {args.rounds} interleaved rounds"
    )
    common.print_table(table_rows(rows), TABLE_COLUMNS)
    out = {
        "workload": {
            key: getattr(args, key)
            for key in (
                "preset",
                "device",
                "dtype",
                "server_threads",
                "cameras",
                "steps",
                "frames",
                "warmup",
                "rounds",
                "deadline_ms",
                "batch_window_ms",
            )
        },
        "rows": rows,
    }
    common.write_json(args.json, out)
    return out


def interleaved(
    args: argparse.Namespace, counts: list[int], shared: ServeProcess, separate: list[ServeProcess]
) -> dict[tuple[int, str], list[dict[str, object]]]:
    """(clients, mode) -> one measurement per round; the modes' order alternates by round."""
    samples: dict[tuple[int, str], list[dict[str, object]]] = {}
    for round_index in range(args.rounds):
        for n in counts:
            modes = ("shared", "separate")
            for mode in modes if round_index % 2 == 0 else reversed(modes):
                processes = [shared] if mode == "shared" else separate[:n]
                uris = [shared.uri] * n if mode == "shared" else [p.uri for p in processes]
                result = measure(args, uris)
                result["rss_bytes"] = sum(p.rss_bytes() for p in processes)
                samples.setdefault((n, mode), []).append(result)
    return samples


@contextlib.contextmanager
def servers(
    args: argparse.Namespace, checkpoint: Path, work: Path, most: int
) -> Iterator[tuple[ServeProcess, list[ServeProcess]]]:
    """One server for ``most`` sessions and ``most`` single-session ones, all healthy; stopped
    afterwards."""
    common_args = [
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--torch-threads",
        str(args.server_threads),
        "--num-steps",
        str(args.steps),
        "--seed",
        str(args.seed),
        "--batch-window-ms",
        str(args.batch_window_ms),
        "--log-level",
        "WARNING",
    ]
    started: list[ServeProcess] = []
    try:
        shared = ServeProcess(
            checkpoint,
            free_port(),
            work / "shared.log",
            [*common_args, "--max-sessions", str(most), "--max-batch", str(most)],
        )
        started.append(shared)
        for i in range(most):
            started.append(
                ServeProcess(
                    checkpoint,
                    free_port(),
                    work / f"single_{i}.log",
                    [*common_args, "--max-sessions", "1", "--max-batch", "1"],
                )
            )
        for process in started:
            process.wait_healthy(START_TIMEOUT_S)
        yield shared, started[1:]
    finally:
        for process in started:
            process.stop()


def measure(args: argparse.Namespace, uris: list[str]) -> dict[str, object]:
    """One client per uri, all running back to back at once: aggregate frames/s over the
    window all of them measure in, and each client's latencies."""
    ready = threading.Barrier(len(uris))
    runs: list[ClientRun | BaseException] = [RuntimeError("did not run")] * len(uris)

    def client(index: int) -> None:
        try:
            runs[index] = run_client(args, uris[index], index, ready)
        except BaseException as error:  # reported below, with the other clients' results
            ready.abort()
            runs[index] = error

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(uris))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in runs:
        if isinstance(result, BaseException):
            raise SystemExit(f"oxygen-bench serve: a client failed: {result!r}")
    window = max(r.end for r in runs) - min(r.start for r in runs)
    frames = sum(len(r.latencies_ms) for r in runs)
    return {
        "frames_per_s": frames / window,
        "clients": [client_figures(r.latencies_ms, args.deadline_ms) for r in runs],
    }


def run_client(
    args: argparse.Namespace, uri: str, index: int, ready: threading.Barrier
) -> ClientRun:
    """Connect, warm up, wait for every client, then ``--frames`` round trips."""
    with PolicyClient(uri) as client:
        if not client.wait_connected(START_TIMEOUT_S):
            raise RuntimeError(f"no connection to {uri}: {client.last_error}")
        metadata = client.metadata
        observations = synthetic_observations(
            args.cameras, state_dim=metadata["observation"]["state_dim"] or 7, seed=index
        )
        messages = [client_message(o, metadata["robot"]) for o in observations]
        for i in range(args.warmup):
            client.infer(messages[i % len(messages)], timeout_s=REPLY_TIMEOUT_S)
        ready.wait(START_TIMEOUT_S)
        latencies = []
        start = time.perf_counter()
        for i in range(args.frames):
            sent = time.perf_counter()
            client.infer(messages[i % len(messages)], timeout_s=REPLY_TIMEOUT_S)
            latencies.append((time.perf_counter() - sent) * 1e3)
        return ClientRun(latencies, start, time.perf_counter())


def client_figures(latencies_ms: list[float], deadline_ms: float) -> dict[str, float]:
    p50, p99 = np.percentile(latencies_ms, [50, 99])
    misses = sum(latency > deadline_ms for latency in latencies_ms)
    return {"p50_ms": float(p50), "p99_ms": float(p99), "deadline_misses": int(misses)}


def summarise(
    clients: int, shared: list[dict[str, object]], separate: list[dict[str, object]]
) -> dict[str, object]:
    """One client count's row: each mode's medians over the rounds, and their ratio."""
    row: dict[str, object] = {"clients": clients}
    for mode, samples in (("shared", shared), ("separate", separate)):
        per_client = [c for sample in samples for c in sample["clients"]]
        row[mode] = {
            "frames_per_s": statistics.median(s["frames_per_s"] for s in samples),
            "p50_ms": statistics.median(c["p50_ms"] for c in per_client),
            "worst_p99_ms": max(c["p99_ms"] for c in per_client),
            "deadline_misses": sum(c["deadline_misses"] for c in per_client),
            "rss_bytes": statistics.median(s["rss_bytes"] for s in samples),
            "rounds": samples,
        }
    row["speedup_vs_separate"] = row["shared"]["frames_per_s"] / row["separate"]["frames_per_s"]
    row["rss_ratio_vs_separate"] = row["shared"]["rss_bytes"] / max(row["separate"]["rss_bytes"], 1)
    return row


TABLE_COLUMNS = [
    "clients",
    "mode",
    "frames/s",
    "p50 ms",
    "worst p99 ms",
    "misses",
    "RSS MiB",
    "speedup",
]


def table_rows(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    table = []
    for row in rows:
        for mode in ("shared", "separate"):
            figures = row[mode]
            table.append(
                {
                    "clients": row["clients"],
                    "mode": mode,
                    "frames/s": figures["frames_per_s"],
                    "p50 ms": figures["p50_ms"],
                    "worst p99 ms": figures["worst_p99_ms"],
                    "misses": figures["deadline_misses"],
                    "RSS MiB": figures["rss_bytes"] / 2**20,
                    "speedup": row["speedup_vs_separate"] if mode == "shared" else "",
                }
            )
    return table
