"""The replicated service deployed by Ray Serve's own command line, as people who run Ray Serve
already deploy it: ``serve run`` on a config file naming ``hypic.cli:serve_application``. It must
be the same service ``hypic serve --dp-size 2`` runs: two replicas, answers equal to one engine per
replica, a reordered request sent where its documents are."""
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from .test_replicas import Replay, _prompt

START_S = 240.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _call(url: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


def _wait_for_service(url: str, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"serve run exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            _call(f"{url}/get_server_info", timeout=5)  # the ingress answers once it has its replicas
            return
        except (OSError, ValueError):  # refused, timed out, or the proxy's 404 before the application is up
            time.sleep(1.0)
    pytest.fail(f"the application was not up within {START_S:.0f} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("serve_run")
    port, log = _free_port(), folder / "serve.log"
    (folder / "config.yaml").write_text(
        f"http_options:\n  host: 127.0.0.1\n  port: {port}\n"
        "applications:\n  - name: hypic\n    route_prefix: /\n    import_path: hypic.cli:serve_application\n"
        '    args:\n      args: "--dp-size 2 --dtype float32 --log-level warning"\n')
    environment = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}  # a Ray of its own
    serve = Path(sys.executable).parent / "serve"
    with log.open("w") as out:
        process = subprocess.Popen([str(serve), "run", str(folder / "config.yaml")], stdout=out, stderr=subprocess.STDOUT,
                                   env=environment, start_new_session=True)
    try:
        _wait_for_service(f"http://127.0.0.1:{port}", process, log)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGINT)  # serve run shuts the application and its Ray down
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)


def test_serve_run_deploys_two_replicas_that_answer_as_one_engine_each(served: str) -> None:
    info = _call(f"{served}/get_server_info")
    assert info["data_parallel"]["dp_size"] == 2 and info["data_parallel"]["policy"] == "cache_aware"
    assert len({replica["pid"] for replica in info["data_parallel"]["replicas"]}) == 2
    replay, replicas = Replay(), []
    for indices in ([0, 1, 2], [1, 2, 0]):
        answer = _call(f"{served}/generate", {"text": _prompt(indices),
                                               "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
        meta = answer["meta_info"]
        expected = replay.generate(meta["replica"], _prompt(indices), max_new_tokens=6)
        assert answer["output_ids"] == expected.output_ids
        assert (meta["segments_hit"], meta["segments_missed"]) == (expected.segments_hit, expected.segments_missed)
        replicas.append(meta["replica"])
    assert replicas[0] == replicas[1]
