"""Stopping ``oxygen_node`` on SIGINT/SIGTERM without losing what is open.

rclpy's own signal handler shuts the ROS context down the moment the signal arrives; everything
the node then does to finish (publish an Ask goal's last feedback, send its result) fails on
invalid publishers, and the clients never hear back. So the node installs no rclpy handler
(:func:`.rclpy_compat.init_without_signal_handlers`) and its own :class:`StopSignals` only
*requests* a stop. ``main()`` then takes the node down in an order that keeps the promise of
docs/ros_interfaces.md (open goals end ABORTED with ``cancelled``) with :func:`close_node`:

1. release the node while the context is valid (the engine closes, open questions and answers end
   their Ask goals, which schedules each goal's result on the executor);
2. spin the executor until every ended goal has sent its result (bounded by ``drain_timeout_s``),
   then a little longer so the middleware can deliver it;
3. shut the executor down, destroy the node, shut the context down.

Each step's failure is reported on stderr and the next step still runs: a teardown error never
turns a clean stop into a failing exit status. A second signal while stopping ends the waiting.

A tool that spins its nodes on a background thread uses :class:`SpinThread`, never a daemon
thread running ``executor.spin``: on Jazzy ``Executor.shutdown`` neither wakes nor waits for a
thread blocked in rclpy's wait, and such a thread still alive when the interpreter finalises is
ended as it takes the GIL back; the unwind through rclpy's C++ frame calls std::terminate
("terminate called without an active exception", exit status 134) after everything else
succeeded. :meth:`SpinThread.stop` joins it first.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import rclpy

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
DRAIN_TIMEOUT_S = 3.0
"""Longest wait for ended goals to send their results."""
LINGER_S = 0.3
"""Spinning after the last result was sent, so the middleware delivers (and if need be resends) it
before the node's endpoints go away."""


class StopSignals:
    """SIGINT and SIGTERM set :attr:`event` (main thread only); a second one raises
    KeyboardInterrupt, which ends any wait still running. :meth:`restore` puts the previous
    handlers back."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        return self

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            if handler is not None:
                signal.signal(signum, handler)
        self._previous = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if self.event.is_set():
            raise KeyboardInterrupt
        self.event.set()


def close_node(
    node: Any,
    executor: Any,
    *,
    context: rclpy.Context | None = None,
    drain_timeout_s: float = DRAIN_TIMEOUT_S,
    linger_s: float = LINGER_S,
) -> list[str]:
    """Take ``node`` (an :class:`~.node.OxygenNode` in ``executor``) and ``context`` (default: the
    default context) down in the order described in the module docstring. Never raises; returns
    the errors met (each is also printed on stderr)."""
    errors: list[str] = []

    def step(what: str, action: Callable[[], Any]) -> None:
        try:
            action()
        except KeyboardInterrupt:  # a second signal: the user wants out now, not an error
            print(f"oxygen_node: interrupted again; skipped {what}", file=sys.stderr)
        except BaseException as exc:  # noqa: BLE001 - teardown goes on whatever happened
            message = f"oxygen_node: {what} failed during shutdown: {type(exc).__name__}: {exc}"
            errors.append(message)
            print(message, file=sys.stderr)

    context_ok = rclpy.ok(context=executor.context)
    step("releasing the node", node.release)
    if context_ok:
        step(
            "sending the results of ended goals",
            lambda: _drain(executor, node.goals_awaiting_result, drain_timeout_s, linger_s),
        )
    step("shutting the executor down", executor.shutdown)
    step("destroying the node", node.destroy_node)
    step("shutting the ROS context down", lambda: rclpy.try_shutdown(context=context))
    return errors


def _drain(executor: Any, awaiting: Callable[[], int], timeout_s: float, linger_s: float) -> None:
    """Spin until ``awaiting()`` is 0 (or ``timeout_s`` passes), then ``linger_s`` more."""
    deadline = time.monotonic() + timeout_s
    while awaiting() and time.monotonic() < deadline:
        executor.spin_once(timeout_sec=0.02)
    if awaiting():
        print(
            f"oxygen_node: {awaiting()} Ask goal(s) had not sent their result after "
            f"{timeout_s:g} s; stopping anyway",
            file=sys.stderr,
        )
    linger_end = time.monotonic() + linger_s
    while time.monotonic() < linger_end:
        executor.spin_once(timeout_sec=0.02)


class SpinThread:
    """Spins ``executor`` on a thread of its own until :meth:`stop`, which joins the thread.

    ``period_s`` bounds each wait, hence how long :meth:`stop` takes."""

    def __init__(self, executor: Any, name: str = "ros_spin", period_s: float = 0.05) -> None:
        self._executor = executor
        self._period_s = period_s
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._spin, name=name)

    def start(self) -> SpinThread:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop spinning and wait until the thread has left rclpy; callbacks already handed to a
        multi-threaded executor's workers may still finish after this returns."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join()

    def _spin(self) -> None:
        while not self._stopping.is_set() and rclpy.ok(context=self._executor.context):
            self._executor.spin_once(timeout_sec=self._period_s)
