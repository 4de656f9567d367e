"""Refusals through the HTTP app and its real validation come back as OpenAI's error object:
{"error": {"message", "type", "param", "code"}}, ``param`` the field as the client spelled it and
``code`` a string or null."""
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from hypic import DEFAULT_SEPARATOR, Engine
from hypic.server.app import ServerInfo, build_app
from hypic.server.chat import load_chat_template
from hypic.server.gate import GateLimits
from hypic.scheduler.loop import EngineLoop, ErrorEvent

CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def app(tiny_checkpoint: Path) -> Iterator[Callable[[GateLimits], TestClient]]:
    """A client of the app on a running engine loop, behind a gate with the given limits."""
    loop = EngineLoop(Engine.from_pretrained(tiny_checkpoint, seam_width=4), "hypic")
    loop.start()
    template, from_model = load_chat_template(tiny_checkpoint)
    info = ServerInfo(str(tiny_checkpoint), "tiny", "test", True, from_model, template, "hypic", 4,
                      DEFAULT_SEPARATOR, 256, 8, None, None, "cpu", "float32")
    try:
        yield lambda limits: TestClient(build_app(loop, info, limits=limits))
    finally:
        loop.stop()


@pytest.fixture(scope="module")
def client(app: Callable[[GateLimits], TestClient]) -> TestClient:
    return app(GateLimits())


def _refused(client: TestClient, path: str, body: dict[str, Any], status: int = 400) -> dict[str, Any]:
    """The error object of a refused request, checked for OpenAI's shape."""
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] is None or isinstance(error["code"], str)
    return error


def test_a_negative_budget_is_refused_naming_the_field_the_client_sent(client: TestClient) -> None:
    bodies = {"max_tokens": ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
              "max_completion_tokens": ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": -1}),
              "max_new_tokens": ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}})}
    for field, (path, body) in bodies.items():
        error = _refused(client, path, body)
        assert error["param"] == field and error["code"] is None, (path, error)
        assert error["message"] == f"{field} must be an integer >= 0, got -1"


def test_min_tokens_over_max_tokens_names_both_as_sent(client: TestClient) -> None:
    error = _refused(client, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 3})
    assert error["param"] == "min_tokens"
    assert error["message"] == "min_tokens must be an integer in [0, max_tokens = 2], got 3"


def test_output_past_the_context_names_max_tokens(client: TestClient) -> None:
    error = _refused(client, "/v1/completions", {"prompt": "hi", "max_tokens": 10 ** 7})
    assert error["param"] == "max_tokens" and "max_tokens asks for 10000000 more" in error["message"]
    assert "max_new_tokens" not in error["message"]


def test_a_bad_json_schema_says_what_is_wrong_and_not_where_in_xgrammar(client: TestClient) -> None:
    schema = {"type": "objekt"}
    error = _refused(client, "/generate", {"text": "hi", "sampling_params": {"json_schema": schema}})
    assert error == {"message": 'invalid json_schema: Unsupported type "objekt"', "type": "invalid_request_error",
                     "param": "json_schema", "code": None}
    format_ = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    error = _refused(client, "/v1/chat/completions", {"messages": CHAT, "response_format": format_})
    assert error["param"] == "response_format" and error["message"].endswith('Unsupported type "objekt"')


def test_other_refusals_name_their_field_and_send_a_string_or_null_code(client: TestClient) -> None:
    assert _refused(client, "/v1/completions", {"prompt": "hi", "temperature": "hot"})["param"] == "temperature"
    assert _refused(client, "/v1/completions", {"prompt": "hi", "tools": [{"type": "function"}]})["param"] == "tools"
    assert _refused(client, "/v1/completions", {"prompt": "hi", "logprobs": 9})["param"] == "logprobs"
    assert _refused(client, "/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]})["param"] == \
        "messages[0].content"
    assert _refused(client, "/v1/completions", {"prompt": "hi", "model": "other"}, 404)["code"] == "model_not_found"
    assert _refused(client, "/v1/nothing", {}, 404)["code"] is None


def test_the_gate_s_refusals_have_the_same_shape(app: Callable[[GateLimits], TestClient]) -> None:
    limited = app(GateLimits(max_request_bytes=64))
    error = _refused(limited, "/generate", {"text": "x" * 100}, 413)
    assert error["code"] is None and "--max-request-bytes" in error["message"]


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_a_streamed_request_refused_before_its_first_token_gets_503_with_retry_after(
        client: TestClient, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """A refusal the loop decides after taking the request (a replicated service's ingress refuses as
    busy when no replica can answer within its SLO) comes back as the HTTP status an unstreamed
    request gets, not as an error chunk inside a 200 stream; a failure before the first token as 500."""
    def refusing(busy: bool):
        def enqueue(job, emit, peer_work=None):
            emit(ErrorEvent("every replica would give the first token too late", busy=busy))
            return job
        return enqueue

    body = {"text": "hi", "stream": True} if path == "/generate" else {"prompt": "hi", "stream": True}
    target = client.app.state.server.loop
    monkeypatch.setattr(target, "enqueue", refusing(True))
    response = client.post(path, json=body)
    assert response.status_code == 503 and int(response.headers["retry-after"]) > 0, response.text
    assert "too late" in response.json()["error"]["message"]
    monkeypatch.setattr(target, "enqueue", refusing(False))
    response = client.post(path, json=body)
    assert response.status_code == 500 and "too late" in response.json()["error"]["message"], response.text
