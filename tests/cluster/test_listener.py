"""The ingress's own HTTP listener (``Listener``): it serves the application on its address, a taken
address fails its start naming it, and one that stopped serving fails the health probe."""
import asyncio
import json
import urllib.request
from typing import Any

import pytest

from hypic.cluster.launch import Listener
from hypic.errors import HypicError
from hypic.net import free_port


async def _hello(scope: Any, receive: Any, send: Any) -> None:
    """A one-route ASGI app: its body names the path it was asked for."""
    body = json.dumps({"path": scope["path"]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def _get(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
        return json.loads(answer.read())


def test_it_serves_the_app_a_taken_port_is_named_and_a_stopped_one_fails_its_check() -> None:
    port = free_port()

    async def scenario() -> None:
        listener = await Listener.start(_hello, "127.0.0.1", port)
        assert await asyncio.to_thread(_get, port, "/health") == {"path": "/health"}
        listener.check()  # serving: healthy
        with pytest.raises(HypicError, match=f"cannot listen on 127.0.0.1:{port}"):
            await Listener.start(_hello, "127.0.0.1", port)
        listener.server.should_exit = True
        await asyncio.wait_for(listener.task, 10)
        with pytest.raises(HypicError, match=f"stopped listening on 127.0.0.1:{port}"):
            listener.check()

    asyncio.run(scenario())
