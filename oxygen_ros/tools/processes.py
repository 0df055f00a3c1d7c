"""Child processes of the demo and the benches: started with their output in a log file, stopped
gently (a signal) then surely (SIGKILL), and the polling wait they are watched with. No ROS
import here, so code that runs before rclpy starts can use it."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


class LoggedProcess:
    """A subprocess whose stdout and stderr go to ``log_path`` (appended to when ``append``)."""

    def __init__(
        self,
        args: Sequence[str],
        env: dict[str, str] | None,
        log_path: Path,
        append: bool = False,
    ) -> None:
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "a" if append else "w") as log:
            self.process = subprocess.Popen(
                list(args), env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 20.0, signum: int = signal.SIGINT) -> int:
        """Send ``signum``, SIGKILL if it has not exited within ``timeout`` s; its exit code
        (idempotent)."""
        if self.alive():
            self.process.send_signal(signum)
            try:
                return self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                return self.process.wait()
        return self.process.returncode
