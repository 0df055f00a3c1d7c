"""``oxygen-serve`` in a subprocess, for the serve bench and the tests that need a real server
to stop and start: started on a port, ready when ``/healthz`` answers, its resident memory read
from /proc, stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from oxygen_ros.tools.processes import LoggedProcess, wait_for


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess(LoggedProcess):
    """``python -m oxygen_ros.tools.serve --checkpoint CHECKPOINT --port PORT ARGS...``, its
    output appended to ``log``."""

    def __init__(self, checkpoint: Path, port: int, log: Path, args: Sequence[str] = ()) -> None:
        self.port = port
        command = [sys.executable, "-m", "oxygen_ros.tools.serve", "--checkpoint", str(checkpoint)]
        command += ["--port", str(port), *args]
        super().__init__(command, dict(os.environ, PYTHONUNBUFFERED="1"), log, append=True)

    @property
    def uri(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        """Whether ``/healthz`` answers 200 now.

        Raises:
            RuntimeError: the process has exited (with the end of its log).
        """
        if not self.alive():
            raise RuntimeError(
                f"oxygen-serve on port {self.port} exited with {self.process.returncode}: "
                f"{self.log_text()[-2000:]}"
            )
        with contextlib.suppress(OSError):
            url = f"http://127.0.0.1:{self.port}/healthz"
            with urllib.request.urlopen(url, timeout=5) as reply:
                return reply.status == 200
        return False

    def wait_healthy(self, timeout_s: float) -> None:
        """Raises RuntimeError when it exits or is not healthy within ``timeout_s``."""
        if not wait_for(self.healthy, timeout_s, interval=0.2):
            raise RuntimeError(
                f"oxygen-serve on port {self.port} not healthy within {timeout_s:g} s: "
                f"{self.log_text()[-2000:]}"
            )

    def rss_bytes(self) -> int:
        """Resident memory now (Linux /proc; 0 where it cannot be read)."""
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return 0
        for line in status.splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self, timeout: float = 30.0, signum: int = signal.SIGTERM) -> int:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout`` s (idempotent)."""
        return super().stop(timeout, signum)
