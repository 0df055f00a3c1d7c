"""Serve a pi0.5 checkpoint to openpi clients, robots batched on one model (``oxygen-serve``).

Wire-compatible with openpi's ``WebsocketClientPolicy`` (docs/serving.md): DROID, LIBERO and
ALOHA clients connect unchanged. Each connection is a robot session with its own frames, RTC
state and language; frames arriving together are prefilled and denoised as one batch.

Example::

    oxygen-make-checkpoint --preset tiny --out /tmp/tiny
    oxygen-serve --checkpoint /tmp/tiny --robot droid --port 8000
    curl http://127.0.0.1:8000/healthz; curl http://127.0.0.1:8000/stats

Binds 127.0.0.1 unless ``--host`` says otherwise. ``--api-key-file FILE`` (or the environment
variable ``OXYGEN_SERVE_API_KEY``) makes every handshake carry ``Authorization: Api-Key <key>``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from oxygen_ros.engine.runtime import ModelSpec, load_policy
from oxygen_ros.engine.settings import EngineConfig
from oxygen_ros.engine.subtasks import HeldGate, PhaseOrder
from oxygen_ros.policy_io.robots import ROBOTS
from oxygen_ros.serving.batching import BatchSettings
from oxygen_ros.serving.idle import DEFAULT_IDLE_GRACE_S
from oxygen_ros.serving.server import DEFAULT_IDLE_TIMEOUT_S, PolicyServer, ServerSettings
from oxygen_ros.serving.sessions import LanguageSettings

API_KEY_ENV = "OXYGEN_SERVE_API_KEY"


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="oxygen-serve", description=__doc__.split("\n\n")[0], allow_abbrev=False
    )
    model = parser.add_argument_group("model")
    model.add_argument("--checkpoint", required=True, help="openpi-layout or LeRobot pi05 folder")
    model.add_argument("--robot", default="generic", choices=sorted(ROBOTS))
    model.add_argument("--tokenizer", default="", help="default: the checkpoint's tokenizer.model")
    model.add_argument("--device", default="cpu")
    model.add_argument("--dtype", default="float32")
    model.add_argument("--torch-threads", type=int, default=1)
    model.add_argument("--num-steps", type=int, default=10, help="denoising steps per chunk")
    model.add_argument("--seed", type=int, default=0, help="session N draws noise from seed+N-1")
    model.add_argument("--prompt-format", default="openpi")
    model.add_argument(
        "--chunk-continuity", default="none", choices=("none", "rtc"), help="per session"
    )
    model.add_argument("--action-dt", type=float, default=0.02, help="controller step (RTC)")
    subtasks = parser.add_argument_group("subtasks (with --subtask-conditioning; per session)")
    subtasks.add_argument(
        "--subtask-conditioning", default="none", choices=("none", "prompt", "same_frame")
    )
    subtasks.add_argument(
        "--subtask-period-s", type=float, default=1.0, help="0: one subtask per task"
    )
    subtasks.add_argument(
        "--subtask-confirmations",
        type=int,
        default=1,
        help="a changed subtask conditions the actions once decoded this many times in a row",
    )
    subtasks.add_argument(
        "--subtask-phase-order",
        nargs="+",
        default=[],
        metavar="PATTERN",
        help="the task's phases in order (regular expressions): a later phase at once",
    )
    subtasks.add_argument(
        "--subtask-held-pattern",
        default="",
        help="regex of subtasks adopted only while the gripper holds (e.g. '^(carry|release) ')",
    )
    subtasks.add_argument(
        "--subtask-held-dims",
        type=int,
        nargs="+",
        default=[],
        metavar="DIM",
        help="the gripper's indices in the observation state (needed with the pattern)",
    )
    subtasks.add_argument(
        "--subtask-held-range",
        type=float,
        nargs=2,
        default=None,
        metavar=("LOW", "HIGH"),
        help="the gripper state between which it holds an object (needed with the pattern)",
    )
    net = parser.add_argument_group("network and limits")
    net.add_argument("--host", default="127.0.0.1", help="default: this machine only")
    net.add_argument("--port", type=int, default=8000)
    net.add_argument("--api-key-file", type=Path, help=f"else ${API_KEY_ENV}; none: no key")
    net.add_argument("--max-sessions", type=int, default=8)
    net.add_argument("--max-queued-frames", type=int, default=16)
    net.add_argument("--max-message-bytes", type=int, default=8 * 1024 * 1024)
    net.add_argument(
        "--idle-timeout-s",
        type=_idle_timeout,
        default=DEFAULT_IDLE_TIMEOUT_S,
        help="close a session that sends no observation for this long, freeing its place "
        f"(default {DEFAULT_IDLE_TIMEOUT_S:g} s; 0: never)",
    )
    net.add_argument(
        "--idle-grace-s",
        type=_idle_grace,
        default=DEFAULT_IDLE_GRACE_S,
        help="when every place is taken, a session idle this long yields its place to a robot "
        f"that connects (default {DEFAULT_IDLE_GRACE_S:g} s; 0: at once)",
    )
    batch = parser.add_argument_group("batching and language")
    batch.add_argument("--batch-window-ms", type=float, default=5.0)
    batch.add_argument("--max-batch", type=int, default=8)
    batch.add_argument("--language-budget-ms", type=float, default=20.0)
    batch.add_argument("--deadline-ms", type=float, default=0.0, help="count later replies")
    batch.add_argument("--narration-every", type=int, default=0, help="frames; 0: no narration")
    batch.add_argument("--max-requests-per-session", type=int, default=4)
    batch.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def _seconds(text: str, zero_means: str) -> float:
    """Finite seconds >= 0 from ``text``, or an argparse error saying what 0 means."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds < math.inf:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0 (0: {zero_means}), got {text!r}")
    return seconds


def _idle_timeout(text: str) -> float:
    """``--idle-timeout-s``."""
    return _seconds(text, "never close")


def _idle_grace(text: str) -> float:
    """``--idle-grace-s``."""
    return _seconds(text, "yield at once")


def read_api_key(path: Path | None) -> str:
    """The key from ``path`` (stripped), else from ``$OXYGEN_SERVE_API_KEY``; "" for none.

    Raises:
        ValueError: an empty key file.
    """
    if path is None:
        return os.environ.get(API_KEY_ENV, "").strip()
    key = path.read_text().strip()
    if not key:
        raise ValueError(f"API key file {path} is empty")
    return key


def subtask_rules(args: argparse.Namespace) -> tuple[HeldGate | None, PhaseOrder | None]:
    """The subtask loop's held-object gate and phase order from their flags (None: not given).

    Raises:
        ValueError: a pattern without its dims or range, or what `HeldGate` / `PhaseOrder` refuse.
    """
    order = PhaseOrder.of(args.subtask_phase_order)
    if not args.subtask_held_pattern:
        return None, order
    if not args.subtask_held_dims or args.subtask_held_range is None:
        raise ValueError(
            "--subtask-held-pattern needs --subtask-held-dims (the gripper's indices in the "
            "observation state) and --subtask-held-range LOW HIGH"
        )
    gate = HeldGate(
        args.subtask_held_pattern, tuple(args.subtask_held_dims), *args.subtask_held_range
    )
    return gate, order


def build_server(args: argparse.Namespace) -> PolicyServer:
    held_gate, phase_order = subtask_rules(args)
    engine_config = EngineConfig(
        num_steps=args.num_steps,
        seed=args.seed,
        prompt_format=args.prompt_format,
        chunk_continuity=args.chunk_continuity,
        action_dt=args.action_dt,
        subtask_conditioning=args.subtask_conditioning,
        subtask_period_s=args.subtask_period_s,
        subtask_confirmations=args.subtask_confirmations,
        subtask_held_gate=held_gate,
        subtask_phase_order=phase_order,
        max_active_requests=args.max_requests_per_session,
        default_max_tokens=args.max_tokens,
    )
    spec = ModelSpec(
        checkpoint_dir=args.checkpoint,
        tokenizer_path=args.tokenizer,
        device=args.device,
        dtype=args.dtype,
        robot=args.robot,
        torch_threads=args.torch_threads,
    )
    policy = load_policy(spec)
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_key=read_api_key(args.api_key_file),
        max_sessions=args.max_sessions,
        max_message_bytes=args.max_message_bytes,
        idle_timeout_s=args.idle_timeout_s,
        idle_grace_s=args.idle_grace_s,
        batch=BatchSettings(
            window_s=args.batch_window_ms / 1e3,
            max_batch=args.max_batch,
            max_queued_frames=args.max_queued_frames,
            language_budget_s=args.language_budget_ms / 1e3,
            deadline_s=args.deadline_ms / 1e3,
        ),
        language=LanguageSettings(narration_every=args.narration_every, max_tokens=args.max_tokens),
    )
    return PolicyServer(policy, engine_config, settings)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s: %(message)s")
    try:
        server = build_server(args)
    except (ValueError, FileNotFoundError, OSError) as error:
        print(f"oxygen-serve: {error}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(server.serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
