"""Start ``hypic serve`` as a child process on a free port and wait until it is healthy
(used by the tests and the load benchmark, which talk to a real server over HTTP)."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..net import free_port  # noqa: F401 - importable from here (tests, eval)


@dataclass
class ServerProcess:
    """A running server process, with small blocking helpers to call it."""

    url: str
    process: subprocess.Popen
    log: Path

    def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
                timeout: float = 300, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """(status, parsed JSON or text); HTTP errors are returned, not raised."""
        return self.exchange(method, path, body, raw, timeout, headers)[:2]

    def exchange(self, method: str, path: str, body: Any = None, raw: bytes | None = None, timeout: float = 300,
                 headers: dict[str, str] | None = None) -> tuple[int, Any, dict[str, str]]:
        """``request`` with extra request ``headers``, also returning the response's headers (lower-case names)."""
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                status, text, got = response.status, response.read().decode(), response.headers
        except urllib.error.HTTPError as err:
            status, text, got = err.code, err.read().decode(), err.headers
        returned = {name.lower(): value for name, value in got.items()}
        try:
            return status, json.loads(text), returned
        except json.JSONDecodeError:
            return status, text, returned

    def post(self, path: str, body: Any) -> Any:
        status, payload = self.request("POST", path, body)
        if status != 200:
            raise RuntimeError(f"POST {path} -> {status}: {payload}")
        return payload

    def get(self, path: str) -> Any:
        status, payload = self.request("GET", path)
        if status != 200:
            raise RuntimeError(f"GET {path} -> {status}: {payload}")
        return payload

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


def port_in_use(port: int) -> bool:
    """Whether a socket holds 127.0.0.1:``port`` (one a stopped server left in TIME_WAIT is free)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def start_server(args: list[str], log: Path, threads: int | None = 1, timeout_s: float = 180,
                 port: int | None = None, host: str | None = None, prefix: list[str] | None = None) -> ServerProcess:
    """``hypic serve ARGS --port PORT`` (a free port if None); returns once /health answers 200.
    A ``port`` something already listens on is refused (its /health would answer for it).
    ``host``: passed as ``--host`` and called there (else 127.0.0.1); ``prefix``: the command runs
    under it (``["ip", "netns", "exec", NAME]`` starts the server on another network)."""
    if port is not None and port_in_use(port):
        raise RuntimeError(f"port {port} is in use")
    port = free_port() if port is None else port
    command = [*(prefix or []), shutil.which("hypic") or sys.executable,
               *([] if shutil.which("hypic") else ["-m", "hypic.cli"]), "serve", "--port", str(port),
               *(["--host", host] if host else []), *args]
    env = dict(os.environ)
    if threads is not None:
        command += ["--threads", str(threads)]
        env["OMP_NUM_THREADS"] = str(threads)
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(f"http://{host or '127.0.0.1'}:{port}", process, log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}:\n{log.read_text()}")
        try:
            if server.request("GET", "/health", timeout=2)[0] == 200:
                return server
        except OSError:
            pass
        time.sleep(0.3)
    server.stop()
    raise RuntimeError(f"the server did not become healthy in {timeout_s:.0f} s:\n{log.read_text()}")
