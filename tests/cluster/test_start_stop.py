"""``hypic serve --dp-size 2`` stopped by SIGTERM while it starts: whatever moment the signal comes,
the process exits within seconds and leaves nothing behind, no Ray process of its runtime (its
daemons, agents and replicas, found by the session folder they name) and no session folder."""
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hypic.net import free_port
from hypic.router.leftovers import processes_naming, ray_processes_below, sessions_of
from hypic.router.pool import RAY_TEMP_DIR


def _session_started(pid: int) -> bool:
    return bool(sessions_of(pid, RAY_TEMP_DIR))


def _replica_loading(pid: int) -> bool:
    names = [Path(f"/proc/{p}/comm").read_text().strip() for p in ray_processes_below(pid)
             if Path(f"/proc/{p}/comm").exists()]
    return any(name.startswith("ray::ServeRepli") for name in names)


@pytest.mark.parametrize("moment", [_session_started, _replica_loading], ids=["ray-starting", "replicas-loading"])
def test_a_sigterm_while_the_service_starts_stops_it_and_leaves_nothing(moment: Callable[[int], bool],
                                                                         tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "-m", "hypic.cli", "serve", "--dp-size", "2", "--threads", "1",
                                   "--port", str(free_port())], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not moment(server.pid):
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        sessions = sessions_of(server.pid, RAY_TEMP_DIR)
        server.terminate()
        code = server.wait(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert code in (0, 15), log.read_text()[-3000:]  # 15: the signal came during Ray's own start
    assert sessions and not sessions_of(server.pid, RAY_TEMP_DIR)
    time.sleep(1.0)
    assert processes_naming(sessions) == [], log.read_text()[-3000:]
