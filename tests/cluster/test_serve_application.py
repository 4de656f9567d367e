"""The replicated service deployed by Ray Serve's own command line, as people who run Ray Serve
already deploy it: ``serve run`` on a config file naming ``hypic.cli:serve_application``. It must
be the same service ``hypic serve --dp-size 2`` runs: two replicas, answers equal to one engine per
replica, a reordered request sent where its documents are."""
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hypic.net import free_port
from hypic.server.launch import ServerProcess

from .test_replicas import Replay, _generate, _prompt

START_S = 240.0


def _wait_for_service(served: ServerProcess) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if served.process.poll() is not None:
            pytest.fail(f"serve run exited with {served.process.returncode}:\n{served.log.read_text()[-3000:]}")
        try:
            if served.request("GET", "/get_server_info", timeout=5)[0] == 200:  # the ingress has its replicas
                return
        except OSError:  # refused or timed out; the proxy answers 404 before the application is up
            pass
        time.sleep(1.0)
    pytest.fail(f"the application was not up within {START_S:.0f} s:\n{served.log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    folder = tmp_path_factory.mktemp("serve_run")
    port, log = free_port(), folder / "serve.log"
    (folder / "config.yaml").write_text(
        f"http_options:\n  host: 127.0.0.1\n  port: {port}\n"
        "applications:\n  - name: hypic\n    route_prefix: /\n    import_path: hypic.cli:serve_application\n"
        '    args:\n      args: "--dp-size 2 --dtype float32 --log-level warning"\n')
    environment = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}  # a Ray of its own
    serve = Path(sys.executable).parent / "serve"
    with log.open("w") as out:
        process = subprocess.Popen([str(serve), "run", str(folder / "config.yaml")], stdout=out, stderr=subprocess.STDOUT,
                                   env=environment, start_new_session=True)
    served = ServerProcess(f"http://127.0.0.1:{port}", process, log)
    try:
        _wait_for_service(served)
        yield served
    finally:
        process.send_signal(signal.SIGINT)  # serve run shuts the application and its Ray down
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def test_serve_run_deploys_two_replicas_that_answer_as_one_engine_each(served: ServerProcess) -> None:
    info = served.get("/get_server_info")
    assert info["data_parallel"]["dp_size"] == 2 and info["data_parallel"]["policy"] == "cache_aware"
    assert len({replica["pid"] for replica in info["data_parallel"]["replicas"]}) == 2
    replay = Replay()
    replicas = [replay.check(_generate(served, _prompt(indices)), _prompt(indices))["replica"]
                for indices in ([0, 1, 2], [1, 2, 0])]
    assert replicas[0] == replicas[1]
