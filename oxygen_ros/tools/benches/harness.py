"""One harness for the closed-loop benches (``closed-loop``, ``faults``, ``failover``) and the sim
demo: their shared arguments, the setup of a run (the checkpoint, the policy node's parameters, a
work folder for logs) and the processes they start, watch and stop in a private ROS graph.

* :func:`add_arguments`, :func:`prepare`: ``--checkpoint``, ``--params-file``, ``--timeout-s``,
  ``--seed``, ``--json``, ``--work`` (and ``--warm-s`` where a bench drives before its fault), and
  what they resolve to (:class:`Setup`);
* :class:`Rig`: the bench's own ROS node (:class:`.closed_loop_ros.BenchNode`, which records and
  drives an episode) and every process of the run: the sim (``oxygen-sim``), the policy node (a
  process, or in this process where a bench audits its engine), ``oxygen-serve`` policy servers,
  a busy competitor; all stopped together, in reverse order, when the run ends or fails;
* :func:`round_task`: round r's task and layout seed, the same in every bench; :func:`rounds`
  runs a bench's turns;
* :func:`report`: the printed table and the ``--json`` file.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from oxygen_ros.sim.tasks import PLACE, TOUCH, TWO_STEP, Task, two_step
from oxygen_ros.tools.benches import common
from oxygen_ros.tools.benches.closed_loop_ros import POLICY_NODE, BenchNode
from oxygen_ros.tools.benches.serve_processes import ServeProcess, free_port
from oxygen_ros.tools.processes import LoggedProcess, wait_for
from oxygen_ros.tools.ros_graph import private_graph_environment

CUBES = ("red", "green", "blue")
PADS = ("green", "blue")
REMAPS = (  # the node's two trajectory outputs onto the sim's controllers
    "-r",
    "~/joint_trajectory:=arm_controller/joint_trajectory",
    "-r",
    "~/gripper_trajectory:=gripper_controller/joint_trajectory",
)


# -- arguments and setup ---------------------------------------------------------------------------
def add_arguments(
    parser: argparse.ArgumentParser,
    *,
    timeout_s: float,
    warm_s: float | None = None,
    two_step_timeout_s: float | None = None,
) -> None:
    """The arguments every closed-loop bench takes; ``timeout_s`` and ``warm_s`` are the bench's
    defaults (``--warm-s`` only where ``warm_s`` is given). With ``two_step_timeout_s`` the
    bench runs two-step tasks too: ``--timeout-s`` defaults to None, resolved by
    :func:`episode_timeout_s`."""
    timeout_help = f"episode timeout in sim seconds (default {timeout_s:g})"
    if two_step_timeout_s is not None:
        timeout_help = (
            f"episode timeout in sim seconds (default {timeout_s:g}; {two_step_timeout_s:g} "
            "with --tasks two_step)"
        )
        parser.set_defaults(default_timeout_s=timeout_s, two_step_timeout_s=two_step_timeout_s)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=Path("models/sim_so101"),
        help="the policy (a LeRobot pi05 folder; default models/sim_so101)",
    )
    parser.add_argument(
        "--params-file",
        type=Path,
        default=None,
        help="the policy node's parameters (default config/sim_policy.yaml)",
    )
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=timeout_s if two_step_timeout_s is None else None,
        help=timeout_help,
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=777,
        help="seed of the rounds' tasks; round r's layout seed is SEED*1000+r (default 777: "
        "layouts 777000.., apart from the shipped policy's training episodes)",
    )
    if warm_s is not None:
        parser.add_argument(
            "--warm-s",
            type=float,
            default=warm_s,
            help="wall seconds of driving before the fault, after the first trajectory "
            f"(default {warm_s:g})",
        )
    parser.add_argument("--json", type=Path, help="write the table and each episode's details")
    parser.add_argument("--work", type=Path, help="logs and files of the run (default: a temp dir)")


@dataclass(frozen=True)
class Setup:
    """What a run's shared arguments resolve to."""

    bench: str  # its oxygen-bench subcommand, for messages
    checkpoint: Path
    params_file: Path
    base: dict[str, Any]  # the policy node's ros__parameters from ``params_file``
    work: Path

    def fail(self, message: str) -> SystemExit:
        return SystemExit(f"oxygen-bench {self.bench}: {message}")


def shipped(relative: str) -> Path:
    """A file shipped with the package (``config/...``, ``models/...``): the repository's (a
    source checkout) or share/oxygen_ros/'s."""
    repo = Path(__file__).resolve().parents[3] / relative
    if repo.exists():
        return repo
    from ament_index_python.packages import get_package_share_directory

    return Path(get_package_share_directory("oxygen_ros")) / relative


def prepare(args: argparse.Namespace, bench: str) -> Setup:
    """Resolve the shared arguments; make the work folder.

    Raises:
        SystemExit: no checkpoint (a folder with config.json) at ``--checkpoint``.
    """
    checkpoint = args.checkpoint.resolve()
    if not (checkpoint / "config.json").is_file():
        raise SystemExit(f"oxygen-bench {bench}: no checkpoint (config.json) in {checkpoint}")
    params_file = (args.params_file or shipped("config/sim_policy.yaml")).resolve()
    base = yaml.safe_load(params_file.read_text())["/**"]["ros__parameters"]
    work = args.work or Path(tempfile.mkdtemp(prefix=f"{bench.replace('-', '_')}_"))
    work.mkdir(parents=True, exist_ok=True)
    return Setup(bench, checkpoint, params_file, base, work)


def choose(text: str, choices: Sequence[Any], what: str) -> list[Any]:
    """``all`` or comma-separated keys of ``choices`` (things with a ``key``), in their order.

    Raises:
        ValueError: an unknown key, or none.
    """
    if text == "all":
        return list(choices)
    keys = {key.strip() for key in text.split(",") if key.strip()}
    unknown = sorted(keys - {choice.key for choice in choices})
    if unknown or not keys:
        known = ", ".join(choice.key for choice in choices)
        raise ValueError(f"unknown {what} {unknown}; choose from {known} or all")
    return [choice for choice in choices if choice.key in keys]


def selected(text: str, choices: Sequence[Any], what: str, bench: str) -> list[Any]:
    """:func:`choose`, an unknown key ending ``oxygen-bench BENCH`` with the choices."""
    try:
        return choose(text, choices, what)
    except ValueError as exc:
        raise SystemExit(f"oxygen-bench {bench}: {exc}") from exc


def episode_timeout_s(args: argparse.Namespace, kind: str) -> float:
    """``--timeout-s``, else the bench's default for tasks of ``kind`` (see
    :func:`add_arguments`'s ``two_step_timeout_s``)."""
    if args.timeout_s is not None:
        return float(args.timeout_s)
    return args.two_step_timeout_s if kind == TWO_STEP else args.default_timeout_s


def round_task(round_index: int, seed: int, kind: str) -> tuple[Task, int]:
    """Round ``round_index``'s task of ``kind`` (touch | place | two_step) and its layout seed
    (the same for every setting and every bench). Touch and place draw as they always have; a
    two-step round's place comes first, then a touch (even rounds) or a place (odd rounds) of
    another cube (and pad)."""
    rng = random.Random(seed * 100_003 + round_index)
    cube, pad = rng.choice(CUBES), rng.choice(PADS)
    if kind == TWO_STEP:
        other = rng.choice([c for c in CUBES if c != cube])
        other_pad = next(p for p in PADS if p != pad)
        then = Task(TOUCH, other) if round_index % 2 == 0 else Task(PLACE, other, other_pad)
        return two_step(Task(PLACE, cube, pad), then), seed * 1000 + round_index
    task = Task(TOUCH, cube) if kind == TOUCH else Task(PLACE, cube, pad)
    return task, seed * 1000 + round_index


def report(
    setup: Setup,
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    columns: list[str],
    started: float,
    shown: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """Print the table (``shown``: the rows as printed, default ``rows``), write ``--json``; the
    run's record: checkpoint, params file, ``extra``, wall seconds and the rows."""
    common.print_table(rows if shown is None else shown, columns)
    out = {
        "checkpoint": str(setup.checkpoint),
        "params_file": str(setup.params_file),
        **extra,
        "wall_s": time.monotonic() - started,
        "rows": rows,
    }
    common.write_json(args.json, out)
    return out


# -- processes -------------------------------------------------------------------------------------
class Servers:
    """Two ``oxygen-serve`` processes of the checkpoint, each on its own port for the whole run;
    ready once ``/healthz`` says so (oxygen-serve pays its first-call costs before: 0.3-1 s here,
    long enough for a node with a 100 ms deadline to take a cold server for a hung one)."""

    def __init__(self, checkpoint: Path, work: Path, serve_args: Sequence[str]) -> None:
        self.checkpoint, self.work, self.serve_args = checkpoint, work, list(serve_args)
        self.processes = [self._start(free_port(), name) for name in ("a", "b")]

    def _start(self, port: int, name: str) -> ServeProcess:
        return ServeProcess(self.checkpoint, port, self.work / f"serve_{name}.log", self.serve_args)

    @property
    def uris(self) -> list[str]:
        return [process.uri for process in self.processes]

    def wait_ready(self, timeout_s: float) -> None:
        for process in self.processes:
            process.wait_healthy(timeout_s)

    def by_uri(self, uri: str) -> ServeProcess:
        return next(p for p in self.processes if p.uri == uri)

    def restore(self, hit: ServeProcess, timeout_s: float) -> None:
        """After a fault: continue a stopped server, start a killed one again on its port."""
        if hit.alive():
            hit.process.send_signal(signal.SIGCONT)
            return
        index = self.processes.index(hit)
        self.processes[index] = self._start(hit.port, "ab"[index])
        self.processes[index].wait_healthy(timeout_s)

    def stop(self) -> None:
        for process in self.processes:
            if process.alive():
                process.process.send_signal(signal.SIGCONT)  # a stopped one cannot take SIGTERM
            process.stop()


def serve_args(base: dict[str, Any]) -> list[str]:
    """What servers need to serve the node as its local engine would run the model."""
    return [
        "--prompt-format",
        str(base.get("prompt_format", "openpi")),
        "--action-dt",
        str(float(base.get("action_dt", 0.02))),
        "--torch-threads",
        "1",
    ]


def remote_parameters(base: dict[str, Any], uris: Sequence[str], timeout_ms: float) -> dict:
    """The node's parameters file: ``base`` with the model in the servers at ``uris``."""
    return {
        "/**": {
            "ros__parameters": {
                **base,
                "engine": "remote",
                "server_uris": list(uris),
                "server_timeout_ms": float(timeout_ms),
                "autostart": False,
            }
        }
    }


class InProcessPolicy:
    """The policy node (``OxygenNode`` with the params file and the remaps a node process gets),
    spun by a single-threaded executor with ``spin_forever`` as ``oxygen_node`` does, in a thread
    of this process, so that a bench can read its engine and counters directly."""

    def __init__(self, params_file: Path, checkpoint: Path) -> None:
        import rclpy
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.parameter import Parameter

        from oxygen_ros.ros.node import OxygenNode, spin_forever

        self._parameter = Parameter
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = OxygenNode(
            POLICY_NODE,
            context=self.context,
            cli_args=["--ros-args", "--params-file", str(params_file), *REMAPS],
            parameter_overrides=[
                Parameter("checkpoint_dir", value=str(checkpoint)),
                Parameter("autostart", value=False),
            ],
        )
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=spin_forever,
            args=(self.executor, self.node.record_executor_error, self._stop),
            daemon=True,
        )
        self._thread.start()

    @property
    def engine(self) -> Any:
        return self.node._engine

    def counters(self) -> dict[str, int]:
        return self.node._loop.counters.snapshot()

    def ros_now_ns(self) -> int:
        return self.node.get_clock().now().nanoseconds

    def transition(self, name: str) -> None:
        """configure | activate | deactivate.

        Raises:
            RuntimeError: the transition failed (the node's log says why).
        """
        result = getattr(self.node, f"trigger_{name}")()
        if result.name != "SUCCESS":
            raise RuntimeError(f"{name} failed: {self.node._last_error or result.name}")

    def set_task(self, text: str) -> None:
        (result,) = self.node.set_parameters([self._parameter("task", value=text)])
        if not result.successful:
            raise RuntimeError(f"the policy node refused task {text!r}: {result.reason}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.node.release()
        self.executor.shutdown()
        self.node.destroy_node()
        self.context.try_shutdown()


class Rig:
    """A run's processes and the bench's own ROS node, in a private ROS graph; leaving the
    ``with`` block stops them all, the last started first.

    ``env``: more environment for the processes (e.g. the node's log format); ``joint_names``:
    the bench node records the sim's inputs too (:class:`.closed_loop_ros.BenchNode`)."""

    def __init__(
        self,
        work: Path,
        namespaces: Sequence[str] = ("",),
        env: dict[str, str] | None = None,
        joint_names: Sequence[str] | None = None,
    ) -> None:
        self.work = work
        self.env = private_graph_environment() | (env or {})  # before rclpy starts in this process
        self._stops: list[Callable[[], Any]] = []
        self.bench = self.keep(BenchNode(namespaces, joint_names), BenchNode.close)

    def keep(self, thing: Any, stop: Callable[[Any], Any] | None = None) -> Any:
        """Stop ``thing`` with the rig (``stop(thing)``, default its ``stop()``); returns it."""
        self._stops.append(lambda: (stop or type(thing).stop)(thing))
        return thing

    def sim(self, timeout_s: float, namespace: str = "", expert: bool = False) -> LoggedProcess:
        """``oxygen-sim`` (no episode until a reset), its /clock under its namespace when it has
        one (so the policy node's sim time follows the main sim only); not kept: the caller stops
        it (:meth:`start_sim` keeps it)."""
        args = [sys.executable, "-m", "oxygen_ros.tools.sim", *(["--expert"] if expert else [])]
        args += ["--ros-args", "--params-file", str(shipped("config/sim_so101.yaml"))]
        args += ["-p", "autostart:=false", "-p", f"episode_timeout_s:={float(timeout_s)}"]
        if namespace:
            args += ["-r", f"__ns:=/{namespace}", "-r", f"/clock:=/{namespace}/clock"]
        log = self.work / f"sim{'_' + namespace if namespace else ''}.log"
        return LoggedProcess(args, self.env, log)

    def start_sim(self, timeout_s: float) -> LoggedProcess:
        """The run's sim, stopped with the rig."""
        return self.keep(self.sim(timeout_s))

    def start_policy(self, params_file: Path, checkpoint: Path | None = None) -> LoggedProcess:
        """The policy node as a process with ``params_file`` (and ``checkpoint`` when given),
        unconfigured; returns once its lifecycle services answer."""
        args = [sys.executable, "-m", "oxygen_ros.ros.node", "--ros-args"]
        args += ["--params-file", str(params_file), "-p", "autostart:=false", *REMAPS]
        if checkpoint is not None:
            args += ["-p", f"checkpoint_dir:={checkpoint}"]
        policy = self.keep(LoggedProcess(args, self.env, self.work / "policy_node.log"))
        self.bench.wait_for_policy()
        return policy

    def start_policy_here(self, params_file: Path, checkpoint: Path) -> InProcessPolicy:
        """The policy node in this process (:class:`InProcessPolicy`), unconfigured."""
        return self.keep(InProcessPolicy(params_file, checkpoint), InProcessPolicy.close)

    def start_servers(self, checkpoint: Path, args: Sequence[str]) -> Servers:
        """Two ``oxygen-serve`` processes of ``checkpoint`` (not yet ready: see
        :meth:`Servers.wait_ready`)."""
        return self.keep(Servers(checkpoint, self.work, args))

    def start_busy(self) -> LoggedProcess:
        """A competing process that keeps one core busy until stopped (the caller stops it)."""
        code = (
            "import signal,sys\nsignal.signal(signal.SIGINT, lambda *a: sys.exit(0))\nwhile 1: pass"
        )
        return LoggedProcess([sys.executable, "-c", code], self.env, self.work / "busy.log")

    def write_parameters(self, name: str, parameters: dict) -> Path:
        """A parameters file for a node in the work folder (JSON is YAML)."""
        path = self.work / name
        path.write_text(json.dumps(parameters, indent=2))
        return path

    def close(self) -> None:
        while self._stops:
            self._stops.pop()()

    def __enter__(self) -> Rig:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rounds(
    run: Callable[[Any, int], dict[str, Any]],
    turns: Sequence[Any],
    line: Callable[[dict[str, Any]], str],
) -> list[dict[str, Any]]:
    """``run(turn, round_index)`` for each turn (things with a ``label``), a line printed each."""
    rows = []
    for round_index, turn in enumerate(turns):
        rows.append(run(turn, round_index))
        print(f"{turn.label:>20}: {line(rows[-1])}", flush=True)
    return rows


def drive(trajectory_times: Callable[[], list[float]], since: float, warm_s: float) -> None:
    """Wait for the node's first trajectory after ``since`` (monotonic s), then drive ``warm_s``.

    Raises:
        RuntimeError: no trajectory within 120 s.
    """
    if not wait_for(lambda: any(t > since for t in trajectory_times()), 120.0):
        raise RuntimeError("the node sent no trajectory after activation")
    time.sleep(warm_s)
