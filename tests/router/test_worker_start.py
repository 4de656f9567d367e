"""Starting ``hypic serve --workers 2``: a worker that cannot start fails the start at once, its
error in the server's output; workers import the package the server imports, whatever folder the
server was started in."""
import os
import subprocess
import sys
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
