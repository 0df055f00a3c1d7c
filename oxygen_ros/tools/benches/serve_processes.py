"""``oxygen-serve`` in a subprocess, for the serve bench and the tests that need a real server
to stop and start: started on a port, ready when ``/healthz`` answers, its resident memory read
from /proc, stopped with SIGTERM."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServeProcess:
    """``python -m oxygen_ros.tools.serve --checkpoint CHECKPOINT --port PORT ARGS...``, its
    output appended to ``log``."""

    def __init__(self, checkpoint: Path, port: int, log: Path, args: Sequence[str] = ()) -> None:
        self.port = port
        self.log_path = log
        with open(log, "a") as out:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "oxygen_ros.tools.serve",
                    "--checkpoint",
                    str(checkpoint),
                    "--port",
                    str(port),
                    *args,
                ],
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    @property
    def uri(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def healthy(self) -> bool:
        """Whether ``/healthz`` answers 200 now.

        Raises:
            RuntimeError: the process has exited (with the end of its log).
        """
        if self.process.poll() is not None:
            raise RuntimeError(
                f"oxygen-serve on port {self.port} exited with {self.process.returncode}: "
                f"{self.log_path.read_text(errors='replace')[-2000:]}"
            )
        with contextlib.suppress(OSError):
            url = f"http://127.0.0.1:{self.port}/healthz"
            with urllib.request.urlopen(url, timeout=5) as reply:
                return reply.status == 200
        return False

    def wait_healthy(self, timeout_s: float) -> None:
        """Raises RuntimeError when it exits or is not healthy within ``timeout_s``."""
        end = time.monotonic() + timeout_s
        while not self.healthy():
            if time.monotonic() > end:
                raise RuntimeError(
                    f"oxygen-serve on port {self.port} not healthy within {timeout_s:g} s: "
                    f"{self.log_path.read_text(errors='replace')[-2000:]}"
                )
            time.sleep(0.2)

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

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within ``timeout_s`` (idempotent)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
