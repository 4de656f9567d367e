"""Starting ``hypic serve --workers 2``: a worker that cannot start fails the start at once, its
error in the server's output; workers import the package the server imports, whatever folder the
server was started in."""
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import ray

from hypic.net import free_port
from hypic.router import PeerPrefill

BROKEN = "this module is broken on purpose"


def test_a_worker_that_cannot_import_fails_the_start_with_its_error(tmp_path: Path) -> None:
    """The workers find a broken ``torch`` first on their path (the server removes it from its own
    before importing anything): the server exits within 30 s of starting Ray (it waited 300 s on a
    group the dead worker never joined), printing the worker's ImportError."""
    shadow = tmp_path / "shadow"
    (shadow / "torch").mkdir(parents=True)
    (shadow / "torch" / "__init__.py").write_text(f"raise ImportError({BROKEN!r})\n")
    serve = ("import sys; sys.path.remove(sys.argv[1]); from hypic.cli import main; "
             f"sys.argv = ['hypic', 'serve', '--workers', '2', '--threads', '1', '--port', '{free_port()}']; "
             "sys.exit(main())")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])}
    server = subprocess.Popen([sys.executable, "-c", serve, str(shadow)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    assert server.stderr is not None
    output, ray_up, stop = [], None, threading.Timer(120, server.kill)  # a server that serves has failed this
    stop.start()
    for line in server.stderr:  # until it exits
        output.append(line)
        if ray_up is None and "Started a local Ray instance" in line:
            ray_up = time.monotonic()
    ended = time.monotonic()
    stop.cancel()
    text = "".join(output)
    assert server.wait(timeout=10) != 0 and ray_up is not None, text[-2000:]
    assert "could not start" in text and BROKEN in text, text[-2000:]
    assert ended - ray_up < 30, f"the start failed {ended - ray_up:.0f} s after Ray was up"


def test_workers_import_the_servers_package_from_any_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Started in a folder that holds a ``hypic`` directory (a clone's parent): the workers start."""
    (tmp_path / "hypic").mkdir()
    (tmp_path / "hypic" / "__init__.py").write_text(f"raise ImportError({BROKEN!r})\n")
    monkeypatch.chdir(tmp_path)
    peers = PeerPrefill("default", 2, threads=1)
    try:
        assert peers.status()["workers"] == [0, 1]
    finally:
        peers.shutdown()
        ray.shutdown()


def test_a_plain_start_runs_a_ray_of_its_own_whatever_the_environment_names() -> None:
    """Without ``--ray-address`` the service starts its own local Ray, even where ``RAY_ADDRESS`` (as
    ``ray start`` users set it) names another runtime: here an address nothing listens on, which a
    plain ``ray.init`` would try to join and fail on."""
    start = ("from hypic.router.pool import start_ray, stop_ray, _started_sessions; import ray; "
             "start_ray(1, None); print('own' if _started_sessions else 'joined', ray.cluster_resources()['CPU']); "
             "stop_ray()")
    env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{free_port()}"}
    done = subprocess.run([sys.executable, "-c", start], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["own", "1.0"], done.stderr[-2000:]


def _serve_joining(address: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "hypic.cli", "serve", "--dp-size", "2", "--ray-address", address],
                          env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - start


def test_a_ray_address_nothing_listens_on_fails_the_start_at_once_in_one_line() -> None:
    done, took_s = _serve_joining(f"127.0.0.1:{free_port()}")
    assert done.returncode == 2 and took_s < 30
    assert done.stderr.strip().splitlines()[-1].startswith("hypic: error: cannot join the Ray cluster at 127.0.0.1:")
    assert "Connection refused" in done.stderr and "Traceback" not in done.stderr


def test_a_cluster_that_refuses_this_machines_auth_token_fails_the_start_within_30_s_naming_it() -> None:
    """A Ray head with token auth (this Ray's default) and a client holding another token."""
    port, temp = free_port(), tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's sockets live in it
    head = subprocess.Popen([sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--port", str(port), "--num-cpus", "1",
                             "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout.strip() == "":
            assert time.monotonic() < deadline and head.poll() is None, "the Ray head did not start"
            time.sleep(0.5)
        done, took_s = _serve_joining(f"127.0.0.1:{port}", {"RAY_AUTH_TOKEN": "f" * 32})
        assert done.returncode == 2 and took_s < 30, (took_s, done.stderr[-2000:])
        assert "it refused this machine's auth token" in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)  # its daemons are in its process group (a SIGTERM drains for 30 s)
        head.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)
