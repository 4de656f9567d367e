"""Real ``hypic serve`` processes on free ports, talking HTTP like any client would."""
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hypic.server.launch import ServerProcess, start_server


@pytest.fixture(scope="module")
def launch(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., ServerProcess]]:
    """``launch(*cli_args)`` -> a running server on the tiny checkpoint (stopped after the module)."""
    servers: list[ServerProcess] = []
    log_dir = tmp_path_factory.mktemp("server-logs")

    def factory(*args: str) -> ServerProcess:
        log = log_dir / f"server-{len(servers)}.log"
        servers.append(start_server(["--model", str(tiny_checkpoint), "--log-level", "warning", *args], log))
        return servers[-1]

    yield factory
    for server in servers:
        server.stop()
