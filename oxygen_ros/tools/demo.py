"""The live demo (``oxygen-demo``): the node on a synthetic bag, with stats printed as it runs
(``--sim``: the policy trained here driving the simulated arm instead, see ``sim_demo``).

Steps: build (once, cached) a random-weight checkpoint and a synthetic bag; start ``oxygen_node``
in a subprocess (this Python, ``-m oxygen_ros.ros.node``) on an isolated ROS graph
(``ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST`` and a random ``ROS_DOMAIN_ID`` unless set); replay the
bag in this process; print a line per second (frame rate, deadline misses, tokens/s, active
requests, the latest narration); ask one question on ``~/ask`` half-way; when the bag ends, stop
the node with SIGINT and print a summary (``--json PATH`` also writes it as JSON: requested and
effective rate, chunks, deadline misses counted against the effective rate, narrations, tok/s and
this machine's load average).

    oxygen-demo                       # tiny model, 15 s bag, 60 Hz loop
    oxygen-demo --duration 30 --rate-hz 20 --preset small
    oxygen-demo --json demo.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from oxygen_ros.tools.cli import positive_float
from oxygen_ros.tools.processes import LoggedProcess
from oxygen_ros.tools.ros_graph import private_graph_environment

NODE_NAME = "oxygen_node"
QUESTION = "what is on the table?"
STARTUP_TIMEOUT_S = 60.0
ANSWER_WAIT_S = 5.0  # after the bag ends


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="oxygen-demo", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--duration", type=positive_float, default=15.0, help="bag length in seconds (default 15)"
    )
    parser.add_argument(
        "--rate-hz",
        type=positive_float,
        default=60.0,
        help="node loop rate (default 60, as the node)",
    )
    parser.add_argument(
        "--preset", choices=("tiny", "small"), default="tiny", help="random-weight model size"
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="where checkpoint, bag and node log are kept (default ~/.cache/oxygen_ros/demo)",
    )
    parser.add_argument(
        "--narration-period", type=float, default=1.0, help="seconds between narrations"
    )
    parser.add_argument(
        "--json", type=Path, default=None, metavar="PATH", help="also write the summary as JSON"
    )
    parser.add_argument(
        "--sim",
        action="store_true",
        help="instead of the bag: the policy trained here (models/sim_so101) drives the simulated "
        "arm through the node, narrating (oxygen_ros/tools/sim_demo.py)",
    )
    parser.add_argument(
        "--episodes", type=int, default=3, help="with --sim: episodes to run (default 3)"
    )
    parser.add_argument(
        "--timeout", type=positive_float, default=10.0, help="with --sim: sim seconds an episode"
    )
    return parser


# ----------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------


def prepare_inputs(work: Path, preset: str, duration: float) -> tuple[Path, Path]:
    """(checkpoint dir, bag dir), created on first use."""
    from oxygen_ros.tools.make_bag import write_synthetic_bag
    from oxygen_ros.tools.make_checkpoint import random_checkpoint

    started = time.monotonic()
    checkpoint = random_checkpoint(preset, root=work)
    bag = work / "bags" / f"synthetic-{duration:g}s"
    if not bag.exists():
        bag.parent.mkdir(parents=True, exist_ok=True)
        scratch = bag.with_name(bag.name + f".partial-{os.getpid()}")
        write_synthetic_bag(scratch, duration)
        os.replace(scratch, bag)
    print(f"oxygen-demo: checkpoint {checkpoint}, bag {bag} ({time.monotonic() - started:.1f} s)")
    return checkpoint, bag


def find_config(name: str = "oxygen.yaml") -> Path | None:
    """config/<name> from the source tree, else from the installed package's share directory
    (found through AMENT_PREFIX_PATH, which :func:`private_graph_environment` sets in a venv)."""
    source = Path(__file__).resolve().parents[2] / "config" / name
    if source.is_file():
        return source
    try:
        from ament_index_python.packages import get_package_share_directory

        installed = Path(get_package_share_directory("oxygen_ros")) / "config" / name
        return installed if installed.is_file() else None
    except (ImportError, LookupError, ValueError):
        return None


def write_overrides(path: Path, parameters: dict[str, object]) -> Path:
    """A ROS params file (JSON is valid YAML) applying ``parameters`` to any node name."""
    path.write_text(json.dumps({"/**": {"ros__parameters": parameters}}, indent=2))
    return path


# ----------------------------------------------------------------------------------------------
# Watching the node
# ----------------------------------------------------------------------------------------------


@dataclass
class Monitor:
    """What the demo has seen of the node's outputs (updated from executor threads)."""

    chunk_times: list[float] = field(default_factory=list)
    deadline_misses: int = 0
    tokens: int = 0  # tokens of finished requests
    finished: dict[str, int] = field(default_factory=dict)
    latest_text: str = ""
    answer: str = ""
    diagnostics: dict[str, str] = field(default_factory=dict)
    effective_rates: list[float] = field(default_factory=list)  # one per /diagnostics message
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_chunk(self, msg) -> None:
        with self.lock:
            self.chunk_times.append(time.monotonic())
            self.deadline_misses += not msg.deadline_met

    def on_narration(self, msg) -> None:
        if msg.final:
            with self.lock:
                self.tokens += msg.token_count
                self.finished[msg.kind] = self.finished.get(msg.kind, 0) + 1

    def on_text(self, msg) -> None:
        with self.lock:
            self.latest_text = msg.data
            if msg.data.startswith("[answer]"):
                self.answer = msg.data

    def on_diagnostics(self, msg) -> None:
        values = {
            kv.key: kv.value
            for st in msg.status
            if st.name.startswith(NODE_NAME)
            for kv in st.values
        }
        if values:
            with self.lock:
                self.diagnostics.update(values)
                if values.get("state") == "active" and "effective_rate_hz" in values:
                    self.effective_rates.append(float(values["effective_rate_hz"]))

    def frames_since(self, since: float) -> int:
        with self.lock:
            return sum(1 for t in self.chunk_times if t >= since)


def _subscribe(node, monitor: Monitor) -> None:
    from diagnostic_msgs.msg import DiagnosticArray
    from std_msgs.msg import String

    from oxygen_ros.msg import ActionChunk, Narration

    node.create_subscription(ActionChunk, f"/{NODE_NAME}/action_chunk", monitor.on_chunk, 10)
    node.create_subscription(Narration, f"/{NODE_NAME}/narration", monitor.on_narration, 100)
    node.create_subscription(String, f"/{NODE_NAME}/narration_text", monitor.on_text, 10)
    node.create_subscription(DiagnosticArray, "/diagnostics", monitor.on_diagnostics, 10)


def _wait_until_ready(node, player, process: LoggedProcess, stop: threading.Event) -> bool:
    """Wait for the node to subscribe to every bag topic and to offer its action output."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline and not stop.is_set():
        if not process.alive():
            return False
        if node.count_publishers(f"/{NODE_NAME}/action_chunk") and player.wait_for_subscribers(
            0.05, stop
        ):
            return True
        time.sleep(0.1)
    return False


def _report(monitor: Monitor, started: float, stop: threading.Event) -> None:
    """Print a status line every second until ``stop``."""
    while not stop.wait(1.0):
        now = time.monotonic()
        with monitor.lock:
            diag = dict(monitor.diagnostics)
            text = monitor.latest_text
        hz = monitor.frames_since(now - 1.0)
        print(
            f"  t={now - started:5.1f} s  frame {hz:5.1f} Hz (of "
            f"{diag.get('effective_rate_hz', '?')})  "
            f"misses {monitor.deadline_misses:3d}  "
            f"tok/s {float(diag.get('tokens_per_s', 0)):6.1f}  active "
            f"{diag.get('active_requests', '0'):>2}  "
            f"| {text[:60]!r}",
            flush=True,
        )


# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from oxygen_ros.tools.make_checkpoint import cache_dir

    work = (args.work or cache_dir() / "demo").expanduser().resolve()
    work.mkdir(parents=True, exist_ok=True)
    checkpoint, bag = prepare_inputs(work, args.preset, args.duration)
    env = private_graph_environment()
    overrides = write_overrides(
        work / "demo_params.yaml",
        {
            "checkpoint_dir": str(checkpoint),
            "rate_hz": float(args.rate_hz),
            "narration_period_s": float(args.narration_period),
            # Random weights make near-flat logits: greedy decoding repeats one (blank) token,
            # sampling
            # shows the text streaming. Real weights: the config's temperature (0 = greedy) applies.
            "temperature": 1.0,
            "camera_topics": ["camera/base/image_raw", "camera/wrist/image_raw"],
            "camera_slots": ["base_0_rgb", "left_wrist_0_rgb"],
            "joint_names": [f"joint_{i}" for i in range(1, 8)],
            "autostart": True,
        },
    )
    config = find_config()
    files = (["--params-file", str(config)] if config else []) + ["--params-file", str(overrides)]
    log_path = work / "node.log"
    command = [sys.executable, "-m", "oxygen_ros.ros.node", "--ros-args", *files]
    print(
        f"oxygen-demo: ROS_DOMAIN_ID={env['ROS_DOMAIN_ID']}; starting {' '.join(command[1:])} (log "
        f"{log_path})"
    )

    import rclpy
    from rclpy.executors import SingleThreadedExecutor
    from std_msgs.msg import String

    from oxygen_ros.ros.node import spin_forever
    from oxygen_ros.tools.replay import BagPlayer

    process = LoggedProcess(command, env, log_path)
    context = rclpy.Context()
    rclpy.init(args=["oxygen-demo"], context=context)
    stop = threading.Event()  # after rclpy.init, so these handlers replace rclpy's
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    node = rclpy.create_node("oxygen_demo", context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)

    def report(exc: Exception) -> None:
        print(
            f"oxygen-demo: executor error, spinning on: {type(exc).__name__}: {exc}",
            file=sys.stderr,
        )

    spinner = threading.Thread(target=spin_forever, args=(executor, report), daemon=True)
    spinner.start()
    monitor = Monitor()
    try:
        _subscribe(node, monitor)
        ask = node.create_publisher(String, f"/{NODE_NAME}/ask", 10)
        player = BagPlayer(node, bag, rate=1.0, restamp=True)
        if not _wait_until_ready(node, player, process, stop):
            print(
                f"oxygen-demo: the node did not come up; last lines of {log_path}:", file=sys.stderr
            )
            print("".join(log_path.read_text().splitlines(True)[-15:]), file=sys.stderr)
            return 1
        print(
            f"oxygen-demo: node ready; playing {bag.name} ({player.duration_s:.1f} s). The model "
            "has random weights: its actions and text are meaningless, the timing is real."
        )
        started = time.monotonic()
        reporter_stop = threading.Event()
        reporter = threading.Thread(
            target=_report, args=(monitor, started, reporter_stop), daemon=True
        )
        reporter.start()
        question = threading.Timer(
            args.duration / 2,
            lambda: (
                ask.publish(String(data=QUESTION)),
                print(f"  >> asked: {QUESTION!r}", flush=True),
            ),
        )
        question.start()
        player.play(stop)
        played = time.monotonic() - started
        question.cancel()
        answer_deadline = time.monotonic() + ANSWER_WAIT_S
        while not monitor.answer and time.monotonic() < answer_deadline and not stop.is_set():
            time.sleep(0.05)
        reporter_stop.set()
        reporter.join()
        summary = _summary(monitor, played, args.rate_hz)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(summary, indent=2) + "\n")
            print(f"oxygen-demo: summary written to {args.json}")
        return 0 if monitor.chunk_times else 1
    finally:
        code = process.stop(15.0)
        print(f"oxygen-demo: node stopped (exit status {code})")
        executor.shutdown()
        # a spin thread still inside rcl at interpreter exit aborts the process
        spinner.join(timeout=5.0)
        node.destroy_node()
        context.try_shutdown()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _summary(monitor: Monitor, played: float, requested_hz: float) -> dict[str, object]:
    """Print the summary; returns it as the JSON-ready dict ``--json`` writes."""
    with monitor.lock:
        times = list(monitor.chunk_times)
        finished = dict(monitor.finished)
        tokens, misses, answer = monitor.tokens, monitor.deadline_misses, monitor.answer
        diag = dict(monitor.diagnostics)
        rates = list(monitor.effective_rates)
    span = times[-1] - times[0] if len(times) > 1 else 0.0
    hz = (len(times) - 1) / span if span > 0 else 0.0
    late = misses / len(times) if times else 0.0
    summary: dict[str, object] = {
        "requested_rate_hz": requested_hz,
        "effective_rate_hz": rates[-1] if rates else requested_hz,
        "effective_rate_hz_min": min(rates) if rates else requested_hz,
        "rate_changes": int(diag.get("rate_changes", 0)),
        "mean_frame_rate_hz": round(hz, 2),
        "duration_s": round(played, 2),
        "chunks": len(times),
        "deadline_misses": misses,  # counted by the node against the effective rate
        "late_fraction": round(late, 4),
        "narrations_finished": finished.get("narration", 0),
        "answers_finished": finished.get("answer", 0),
        "tokens": tokens,
        "tokens_per_s": round(tokens / played, 2) if played else 0.0,
        "action_latency_p50_ms": float(diag.get("action_latency_p50_ms", 0.0)),
        "action_latency_p99_ms": float(diag.get("action_latency_p99_ms", 0.0)),
        "warmup_tick_ms": float(diag.get("warmup_tick_ms", 0.0)),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "cpu_count": os.cpu_count(),
    }
    print("oxygen-demo summary")
    print(
        f"  action chunks     {len(times)} in {played:.1f} s  (mean frame rate {hz:.1f} Hz, "
        f"{misses} deadline misses = {100 * late:.1f}% late)"
    )
    print(
        f"  replanning rate   requested {requested_hz:g} Hz, effective "
        f"{summary['effective_rate_hz']:g} Hz "
        f"(lowest {summary['effective_rate_hz_min']:g} Hz, {summary['rate_changes']} changes; "
        f"warm-up tick {summary['warmup_tick_ms']:.1f} ms)"
    )
    print(
        f"  action latency    p50 {diag.get('action_latency_p50_ms', '?')} ms, "
        f"p99 {diag.get('action_latency_p99_ms', '?')} ms"
    )
    print(
        f"  language          {tokens} tokens in finished requests, "
        f"{tokens / played if played else 0:.1f} tok/s; "
        f"{finished.get('narration', 0)} narrations, {finished.get('answer', 0)} answers"
    )
    print(f"  answer            {answer or '(none)'}")
    print(
        f"  kv memory         peak {diag.get('kv_peak_bytes', '?')} of "
        f"{diag.get('kv_capacity_bytes', '?')} bytes"
    )
    print(
        f"  machine           load average {summary['load_average_1min']} on "
        f"{summary['cpu_count']} CPUs"
    )
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.sim:
        from oxygen_ros.tools.sim_demo import run_sim_demo  # the sim's processes and plumbing

        return run_sim_demo(args.episodes, args.timeout, args.work)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
