"""Start a real `streamsd serve` (uvicorn) subprocess on 127.0.0.1 for tests."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    log: Path
    health_seen: list[int] = field(default_factory=list)
    scheme: str = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"{'wss' if self.scheme == 'https' else 'ws'}://127.0.0.1:{self.port}/v1/ws"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait()
        return self.proc.returncode


def start_server(model: Path | str | None, log_dir: Path, *extra: str, env: dict[str, str] | None = None,
                 timeout: float = 120, tls: ssl.SSLContext | None = None) -> Server:
    """`tls`: the server speaks https (its flags in `extra`); the context the health check trusts it by."""
    port = free_port()
    cmd = [sys.executable, "-m", "streamsd.cli", "serve", "--port", str(port), "--device", "cpu", *extra]
    if model is not None:
        cmd += ["--model", str(model)]
    log = log_dir / f"server-{port}.log"
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=full_env)
    server = Server(proc, port, log, scheme="https" if tls else "http")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{log.read_text()}")
        try:
            r = httpx.get(f"{server.url}/health", timeout=2, verify=tls or True)
            server.health_seen.append(r.status_code)
            if r.status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.01)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not become healthy:\n{log.read_text()}")


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def wait_metric(base_url: str, name: str, want: float, timeout: float) -> float:
    """The metric's value once it reads `want`, or its last value when `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    value = metric(base_url, name)
    while value != want and time.monotonic() < deadline:
        time.sleep(0.02)
        value = metric(base_url, name)
    return value


def spawned(pid: int) -> list[int]:
    """The live processes `pid` started through multiprocessing's spawn (an engine process, tensor-parallel
    ranks), not its resource tracker; from /proc."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"spawn_main" in cmdline:
            out.append(int(stat.parent.name))
    return out
