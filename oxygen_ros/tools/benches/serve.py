"""``oxygen-bench serve``: N robots on one ``oxygen-serve`` (sessions batched on one model) against
N separate single-robot servers, on the same CPU, runs interleaved.

Every server is a real ``oxygen-serve`` process on a random-weight checkpoint of ``--preset``
(written to a temporary folder, or ``--checkpoint``); every robot is a `PolicyClient` thread
running openpi's loop back to back: send an observation, wait for its chunk, send the next.

Two views (``--views``), each labelled in the table and the JSON:

* ``equal-cpu`` (the comparison): every process runs on the bench's cores (it inherits the
  bench's CPU affinity: run the bench under ``taskset`` to use fewer); the shared server runs
  as many torch threads as there are cores, each of the N separate servers cores/N (at least 1:
  beyond as many robots as cores, N one-thread servers time-share the same cores). Both sides
  have the same CPU, so what differs is batching against separate processes.
* ``one-thread``: every server one torch thread, as a robot fleet's default oxygen-serve runs;
  with fewer robots than cores the N separate servers then use up to N cores and the shared one
  only one, so this view mixes batching with CPU share.

For each client count and view, ``--repeats`` runs of each side, interleaved (shared, separate,
separate, shared, ...: the order alternates, so a drift of a shared machine's load falls on
both). Per run: aggregate frames/s over the window where all clients run, each client's
p50/p99 round trip, misses of ``--deadline-ms``, the server's own time per frame (queueing for
a batch, the batch's inference) and the servers' resident memory. A setting's figure is the
median over its runs, printed with the range of the runs (min-max); the speedup is the median
of each run's shared/separate ratio.

    oxygen-bench serve --preset tiny --clients 1,2,4,8 --repeats 5 --json serve.json
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.serving.client import PolicyClient
from oxygen_ros.serving.client_observation import client_message
from oxygen_ros.tools.benches import common
from oxygen_ros.tools.benches.serve_processes import ServeProcess, free_port
from oxygen_ros.tools.benches.workloads import synthetic_observations
from oxygen_ros.tools.make_checkpoint import make_checkpoint

HELP = "N robots on one oxygen-serve vs N separate servers on the same CPU: frames/s, p99, RSS"
START_TIMEOUT_S = 600.0  # a server loads its checkpoint and warms up (minutes for pi05)
REPLY_TIMEOUT_S = 600.0  # a round trip that takes longer is an error, not a measurement
VIEWS = {
    "equal-cpu": "same cores: shared server threads = cores, each of N servers cores/N (>= 1)",
    "one-thread": "every server 1 torch thread (N separate servers get up to N cores)",
}
MODES = ("shared", "separate")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand's arguments."""
    parser.add_argument("--preset", default="tiny", help="model preset of the random checkpoint")
    parser.add_argument("--checkpoint", type=Path, help="serve this checkpoint instead")
    parser.add_argument("--device", default="cpu", help="the servers' torch device")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--views",
        default=",".join(VIEWS),
        help=f"comma-separated: {', '.join(VIEWS)} (default both; see the module docstring)",
    )
    parser.add_argument(
        "--clients", default="1,2,4,8", help="comma-separated robot counts (default 1,2,4,8)"
    )
    parser.add_argument("--cameras", type=int, default=2, help="camera images per observation")
    parser.add_argument("--steps", type=int, default=10, help="flow-matching denoising steps")
    parser.add_argument("--frames", type=int, default=30, help="measured frames per client")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured frames per client")
    parser.add_argument(
        "--repeats", type=int, default=3, help="interleaved runs of each side (median, range)"
    )
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
    """One client's measured frames: round trips and the server's timing of each (ms), and its
    window on the bench clock."""

    latencies_ms: list[float]
    queue_ms: list[float]
    infer_ms: list[float]
    batch_sizes: list[int]
    start: float
    end: float


def available_cores() -> int:
    """The cores this process (and every server it starts) may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def server_threads(view: str, mode: str, clients: int, cores: int) -> int:
    """Torch threads of each server of ``mode`` when ``clients`` robots run in ``view``."""
    if view == "one-thread":
        return 1
    return cores if mode == "shared" else max(1, cores // clients)


def parse_settings(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """The client counts and views asked for (a clear exit for anything else)."""
    try:
        counts = sorted({int(n) for n in args.clients.split(",") if n.strip()})
    except ValueError:
        counts = []
    if not counts or counts[0] < 1:
        raise SystemExit(f"oxygen-bench serve: --clients takes positive counts, not {args.clients}")
    views = [v.strip() for v in args.views.split(",") if v.strip()]
    unknown = [v for v in views if v not in VIEWS]
    if not views or unknown:
        raise SystemExit(
            f"oxygen-bench serve: --views takes {', '.join(VIEWS)}, not {args.views!r}"
        )
    if args.repeats < 1:
        raise SystemExit(f"oxygen-bench serve: --repeats must be >= 1, not {args.repeats}")
    return counts, list(dict.fromkeys(views))


def run(args: argparse.Namespace) -> dict[str, object]:
    """Measure every (view, client count) with its runs interleaved, print the table and write
    the JSON."""
    counts, views = parse_settings(args)
    cores = available_cores()
    with tempfile.TemporaryDirectory(prefix="oxygen_serve_bench_") as tmp:
        work = Path(tmp)
        checkpoint = args.checkpoint or make_checkpoint(
            work / "checkpoint",
            args.preset,
            args.seed,
            dtype=getattr(torch, args.dtype),
            force=True,
        )
        with ServerPool(args, checkpoint, work, counts[-1]) as pool:
            rows = {
                view: [measure_setting(args, pool, view, n, cores) for n in counts]
                for view in views
            }
    print(
        f"serve: preset {args.preset}, {args.cameras} cameras, {args.steps} steps, device "
        f"{args.device}, {cores} cores, deadline {args.deadline_ms:g} ms, {args.frames} frames "
        f"per client, median (min-max) of {args.repeats} interleaved runs"
    )
    for view in views:
        print(f"\n{view}: {VIEWS[view]}")
        common.print_table(table_rows(rows[view]), TABLE_COLUMNS)
    workload = {
        key: getattr(args, key)
        for key in (
            "preset",
            "device",
            "dtype",
            "cameras",
            "steps",
            "frames",
            "warmup",
            "repeats",
            "deadline_ms",
            "batch_window_ms",
        )
    }
    out = {
        "workload": workload | {"cores": cores, "views": views},
        # the equal-CPU comparison (the figures the GPU summary reads)
        "rows": rows.get("equal-cpu", []),
        "one_thread_rows": rows.get("one-thread", []),
    }
    common.write_json(args.json, out)
    return out


def measure_setting(
    args: argparse.Namespace, pool: ServerPool, view: str, clients: int, cores: int
) -> dict[str, object]:
    """``--repeats`` runs of each side for one client count in one view, interleaved."""
    threads = {mode: server_threads(view, mode, clients, cores) for mode in MODES}
    processes = {
        "shared": [pool.shared(threads["shared"])],
        "separate": pool.singles(threads["separate"], clients),
    }
    uris = {
        "shared": [processes["shared"][0].uri] * clients,
        "separate": [p.uri for p in processes["separate"]],
    }
    runs: dict[str, list[dict[str, object]]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES if repeat % 2 == 0 else reversed(MODES):
            result = measure(args, uris[mode])
            result["rss_bytes"] = sum(p.rss_bytes() for p in processes[mode])
            runs[mode].append(result)
    return summarise(view, clients, threads, runs)


class ServerPool:
    """The servers the settings need, started when first needed and kept while they are: a
    shared server (``most`` sessions) per thread count, and single-robot servers of one thread
    count at a time (those of another count are stopped first, so no more run at once than the
    largest setting needs)."""

    def __init__(self, args: argparse.Namespace, checkpoint: Path, work: Path, most: int) -> None:
        self._args = args
        self._checkpoint = checkpoint
        self._work = work
        self._most = most
        self._shared: dict[int, ServeProcess] = {}
        self._singles: list[ServeProcess] = []
        self._singles_threads = 0
        self._started = 0

    def __enter__(self) -> ServerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        for process in [*self._shared.values(), *self._singles]:
            process.stop()

    def shared(self, threads: int) -> ServeProcess:
        if threads not in self._shared:
            self._shared[threads] = self._ready([self._launch(threads, self._most)])[0]
        return self._shared[threads]

    def singles(self, threads: int, count: int) -> list[ServeProcess]:
        if threads != self._singles_threads:
            for process in self._singles:
                process.stop()
            self._singles, self._singles_threads = [], threads
        missing = count - len(self._singles)
        self._singles += self._ready([self._launch(threads, 1) for _ in range(missing)])
        return self._singles[:count]

    def _launch(self, threads: int, sessions: int) -> ServeProcess:
        args = self._args
        self._started += 1
        return ServeProcess(
            self._checkpoint,
            free_port(),
            self._work / f"server_{self._started}.log",
            [
                "--device", args.device,
                "--dtype", args.dtype,
                "--torch-threads", str(threads),
                "--num-steps", str(args.steps),
                "--seed", str(args.seed),
                "--batch-window-ms", str(args.batch_window_ms),
                "--max-sessions", str(sessions),
                "--max-batch", str(sessions),
                "--log-level", "WARNING",
            ],
        )  # fmt: skip

    @staticmethod
    def _ready(processes: list[ServeProcess]) -> list[ServeProcess]:
        """``processes`` once all are healthy (all stopped if one is not)."""
        try:
            for process in processes:
                process.wait_healthy(START_TIMEOUT_S)
        except BaseException:
            for process in processes:
                process.stop()
            raise
        return processes


def measure(args: argparse.Namespace, uris: list[str]) -> dict[str, object]:
    """One client per uri, all running back to back at once: aggregate frames/s over the
    window all of them measure in, and each client's figures."""
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
        "clients": [client_figures(r, args.deadline_ms) for r in runs],
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
        run = ClientRun([], [], [], [], time.perf_counter(), 0.0)
        for i in range(args.frames):
            sent = time.perf_counter()
            reply = client.infer(messages[i % len(messages)], timeout_s=REPLY_TIMEOUT_S)
            run.latencies_ms.append((time.perf_counter() - sent) * 1e3)
            timing = reply["server_timing"]
            run.queue_ms.append(float(timing["queue_ms"]))
            run.infer_ms.append(float(timing["infer_ms"]))
            run.batch_sizes.append(int(timing["batch_size"]))
        run.end = time.perf_counter()
        return run


def client_figures(run: ClientRun, deadline_ms: float) -> dict[str, float]:
    """One client's round-trip p50/p99, deadline misses, and the server's median queueing and
    inference time of its frames and their mean batch size."""
    p50, p99 = np.percentile(run.latencies_ms, [50, 99])
    return {
        "p50_ms": float(p50),
        "p99_ms": float(p99),
        "deadline_misses": int(sum(latency > deadline_ms for latency in run.latencies_ms)),
        "queue_p50_ms": float(np.median(run.queue_ms)),
        "infer_p50_ms": float(np.median(run.infer_ms)),
        "mean_batch": float(np.mean(run.batch_sizes)),
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(
    view: str, clients: int, threads: dict[str, int], runs: dict[str, list[dict[str, object]]]
) -> dict[str, object]:
    """One client count's row in one view: each side's medians over its runs with their range,
    and the median of the runs' shared/separate ratios."""
    row: dict[str, object] = {"view": view, "clients": clients}
    for mode in MODES:
        samples = runs[mode]
        per_client = [c for sample in samples for c in sample["clients"]]
        fps = spread([s["frames_per_s"] for s in samples])
        row[mode] = {
            "threads_per_server": threads[mode],
            "frames_per_s": fps["median"],
            "frames_per_s_min": fps["min"],
            "frames_per_s_max": fps["max"],
            "p50_ms": statistics.median(c["p50_ms"] for c in per_client),
            "worst_p99_ms": max(c["p99_ms"] for c in per_client),
            "deadline_misses": sum(c["deadline_misses"] for c in per_client),
            "queue_p50_ms": statistics.median(c["queue_p50_ms"] for c in per_client),
            "infer_p50_ms": statistics.median(c["infer_p50_ms"] for c in per_client),
            "mean_batch": statistics.mean(c["mean_batch"] for c in per_client),
            "rss_bytes": statistics.median(s["rss_bytes"] for s in samples),
            "runs": samples,
        }
    ratios = spread(
        [
            s["frames_per_s"] / p["frames_per_s"]
            for s, p in zip(runs["shared"], runs["separate"], strict=True)
        ]
    )
    row["speedup_vs_separate"] = ratios["median"]
    row["speedup_min"], row["speedup_max"] = ratios["min"], ratios["max"]
    row["rss_ratio_vs_separate"] = row["shared"]["rss_bytes"] / max(row["separate"]["rss_bytes"], 1)
    return row


TABLE_COLUMNS = [
    "clients",
    "mode",
    "threads",
    "frames/s (min-max)",
    "p50 ms",
    "worst p99 ms",
    "misses",
    "queue ms",
    "infer ms",
    "batch",
    "RSS MiB",
    "speedup (min-max)",
]


def table_rows(rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """Two lines per client count: the shared server's (with the speedup) and the separate
    servers'."""
    table = []
    for row in rows:
        for mode in MODES:
            figures = row[mode]
            fps = (
                figures["frames_per_s"],
                figures["frames_per_s_min"],
                figures["frames_per_s_max"],
            )
            speedup = (row["speedup_vs_separate"], row["speedup_min"], row["speedup_max"])
            shared = mode == "shared"
            table.append(
                {
                    "clients": row["clients"],
                    "mode": mode,
                    "threads": str(figures["threads_per_server"])
                    + ("" if shared else f" x{row['clients']}"),
                    "frames/s (min-max)": "{:.1f} ({:.1f}-{:.1f})".format(*fps),
                    "p50 ms": figures["p50_ms"],
                    "worst p99 ms": figures["worst_p99_ms"],
                    "misses": figures["deadline_misses"],
                    "queue ms": figures["queue_p50_ms"],
                    "infer ms": figures["infer_p50_ms"],
                    "batch": figures["mean_batch"],
                    "RSS MiB": figures["rss_bytes"] / 2**20,
                    "speedup (min-max)": "{:.2f} ({:.2f}-{:.2f})".format(*speedup)
                    if shared
                    else "",
                }
            )
    return table
