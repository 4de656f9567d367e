"""One real ``hypic serve`` on the tiny checkpoint for every client contract test, and a wire-level
HTTP helper that reads responses the way those clients do (aiohttp's ``response.content`` yields
the body line by line, split on ``\\n``; each client strips a line, skips it when empty and drops
a ``data: `` prefix)."""
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from hypic.server.launch import ServerProcess, start_server

ALPHABET = "abcdefghijklmnop ,."


def client_chunks(lines: list[str]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a body as the benchmark clients read it, line by line: a ``data: ``
    prefix stripped, ``[DONE]`` skipped (a one-line JSON body reads the same way)."""
    for line in lines:
        chunk = line.removeprefix("data: ")
        if chunk != "[DONE]":
            yield json.loads(chunk)


def text(seed: int, n: int) -> str:
    """``n`` characters (``n`` tokens on the tiny byte-level tokenizer), distinct per seed."""
    rng = random.Random(seed)
    return "".join(rng.choice(ALPHABET) for _ in range(n))


@dataclass
class Streamed:
    """A response read line by line: its status, content type and the stripped non-empty lines."""

    status: int
    content_type: str
    lines: list[str]
    body: str  # the whole body (error responses)

    def events(self) -> list[str]:
        """The payloads after ``data: `` (the clients' ``remove_prefix(chunk, "data: ")``)."""
        return [line[len("data: "):] if line.startswith("data: ") else line for line in self.lines]

    def chunks(self) -> list[dict[str, Any]]:
        """The JSON events before ``[DONE]``."""
        return [json.loads(event) for event in self.events() if event != "[DONE]"]

    def assert_sse(self) -> None:
        """Server-sent events: 200, every line ``data: ...``, the last one ``data: [DONE]``, once."""
        assert self.status == 200, self.body
        assert self.content_type.startswith("text/event-stream"), self.content_type
        assert self.lines and all(line.startswith("data: ") for line in self.lines), self.lines[:3]
        assert self.lines[-1] == "data: [DONE]" and self.lines.count("data: [DONE]") == 1


class Wire:
    """Raw HTTP as the benchmark clients send it (``json=payload``: ``Content-Type: application/json``)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.http = httpx.Client(base_url=url, timeout=120)

    def post(self, path: str, body: Any = None, headers: dict[str, str] | None = None) -> httpx.Response:
        if body is None:  # requests.post(url) with no body, as the benchmarks flush the cache
            return self.http.post(path, headers=headers)
        return self.http.post(path, json=body, headers=headers)

    def get(self, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
        return self.http.get(path, headers=headers)

    def stream(self, path: str, body: Any, headers: dict[str, str] | None = None) -> Streamed:
        with self.http.stream("POST", path, json=body, headers=headers) as response:
            raw = b"".join(response.iter_bytes())
        lines = [line.strip().decode() for line in raw.split(b"\n") if line.strip()]
        return Streamed(response.status_code, response.headers.get("content-type", ""), lines, raw.decode())

    def server_info(self) -> dict[str, Any]:
        response = self.get("/get_server_info")
        assert response.status_code == 200, response.text
        return response.json()

    def count(self, prompt: str) -> int:
        """The tokenizer's count of ``prompt`` as ``/generate`` prefills it (``/tokenize``)."""
        response = self.post("/tokenize", {"prompt": prompt})
        assert response.status_code == 200, response.text
        return response.json()["count"]

    def model_id(self) -> str:
        """What every benchmark does first without ``--model``: ``GET /v1/models`` -> ``data[0].id``."""
        response = self.get("/v1/models")
        assert response.status_code == 200, response.text
        return response.json()["data"][0]["id"]


@pytest.fixture(scope="package")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The one server all client tests talk to (default mode, seam width and separator)."""
    log = tmp_path_factory.mktemp("client-contract") / "server.log"
    process = start_server(["--model", str(tiny_checkpoint), "--log-level", "warning"], log)
    yield process
    process.stop()


@pytest.fixture(scope="package")
def wire(server: ServerProcess) -> Iterator[Wire]:
    client = Wire(server.url)
    yield client
    client.http.close()


def refused(response: httpx.Response, field: str) -> bool:
    """A 400 whose ``error.message`` names ``field``."""
    if response.status_code != 400:
        return False
    return field in response.json()["error"]["message"]
