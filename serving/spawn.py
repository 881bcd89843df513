"""Start `python -m serving.run` as a subprocess and wait until it is ready (tests, notebooks, benchmarks).

`spawn_server(args)` runs `python -m serving.run --port 0 --grpc-port 0 ARGS` on free ports and returns once the
server printed its addresses (no blind sleeps); the `SpawnedServer` keeps the last 400 output lines.
`terminate()` sends SIGTERM and returns the exit status.
"""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time

_READY = {"http": re.compile(r"HTTP server listening on (https?://\S+)"),
          "grpc": re.compile(r"gRPC server listening on (\S+)")}


class SpawnedServer:
    def __init__(self, proc: subprocess.Popen, want: set[str], timeout: float):
        self.proc = proc
        self.lines: collections.deque[str] = collections.deque(maxlen=400)
        self.addr: dict[str, str] = {}
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, name="server-output", daemon=True)
        self._reader.start()
        deadline = time.monotonic() + timeout
        with self._cond:
            while not want <= set(self.addr):
                left = deadline - time.monotonic()
                if proc.poll() is not None or left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
        if not want <= set(self.addr):
            self.kill()
            why = f"exited with status {proc.returncode}" if proc.returncode is not None else "timed out"
            raise RuntimeError(f"the server {why} before it was ready; its output:\n" + self.output())

    def _read(self):
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                for k, rx in _READY.items():
                    m = rx.search(line)
                    if m:
                        self.addr[k] = m.group(1)
                self._cond.notify_all()

    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    @property
    def http_url(self) -> str | None:
        return self.addr.get("http")

    @property
    def grpc_target(self) -> str | None:
        return self.addr.get("grpc")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait (bounded); returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reader.join(5)
        return self.proc.returncode

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.terminate()


def spawn_server(args: list[str], *, timeout: float = 300.0, env: dict | None = None, grpc: bool = True,
                 cwd: str | None = None) -> SpawnedServer:
    """Start `python -m serving.run --port 0 --grpc-port 0 ARGS` and wait until it is ready."""
    cmd = [sys.executable, "-u", "-m", "serving.run", "--port", "0", "--grpc-port", "0" if grpc else "-1", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                            env={**os.environ, **(env or {})}, cwd=cwd)
    return SpawnedServer(proc, {"http", "grpc"} if grpc else {"http"}, timeout)
