"""The server's front door, before any route: API keys (401), the request body limit (413) and
the per-key limit on requests in flight (429). A plain ASGI middleware, so it also bounds streamed
responses (a request is in flight until its last chunk) and bodies sent without a length."""
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .tenancy import ApiKeys

OPEN_PATHS = ("/health",)  # load balancers probe it without a key
RETRY_AFTER_S = 1
DRAIN_LIMIT_BYTES = 64 * 2**20  # most of a body over the limit read (and dropped) before its 413, see ``_drain``


@dataclass(frozen=True)
class GateLimits:
    """``--api-key`` digests, ``--max-request-bytes`` and ``--max-concurrent-per-key`` (None: unlimited)."""

    keys: ApiKeys = field(default_factory=ApiKeys)
    max_request_bytes: int | None = None
    max_concurrent_per_key: int | None = None


class BodyTooLarge(Exception):
    """A body over ``--max-request-bytes``: declared so, or grown past it while read."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"the request body has {size} bytes or more, over the limit of {limit} (--max-request-bytes)")


def _error(status: int, message: str, kind: str, code: str | None) -> tuple[bytes, int]:
    """OpenAI's error object (``app.error_body``'s shape: ``code`` a string or null)."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}, "detail": message}
    return json.dumps(body).encode(), status


class Gate:
    """Wraps the FastAPI app; puts the caller's key id in ``request.state.caller`` (None without keys)."""

    def __init__(self, app: ASGIApp, limits: GateLimits) -> None:
        self.app, self.limits = app, limits
        self.in_flight: Counter[str | None] = Counter()

    @property
    def state(self) -> Any:
        """The wrapped application's state (``state.server``: the ``Server``)."""
        return getattr(self.app, "state")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        caller = None
        if self.limits.keys.required and scope["path"] not in OPEN_PATHS:
            caller = self.limits.keys.identify(Headers(scope=scope).get("authorization"))
            if caller is None:
                return await _reply(send, *_error(401, "a valid API key is required: send 'Authorization: Bearer "
                                                       "<key>'", "invalid_request_error", "invalid_api_key"),
                                    [(b"www-authenticate", b"Bearer")])
        scope.setdefault("state", {})["caller"] = caller
        limit = self.limits.max_request_bytes
        length = Headers(scope=scope).get("content-length")
        if limit is not None and length is not None and length.isdigit() and int(length) > limit:
            if int(length) <= DRAIN_LIMIT_BYTES:
                await _drain(receive)
            return await _reply(send, *_too_large(BodyTooLarge(int(length), limit)), [(b"connection", b"close")])
        if scope["method"] != "POST" or self.limits.max_concurrent_per_key is None:
            return await self._run(scope, receive, send)
        if self.in_flight[caller] >= self.limits.max_concurrent_per_key:
            message = (f"this API key has {self.in_flight[caller]} requests in flight, the limit "
                       f"(--max-concurrent-per-key); retry when one has finished")
            return await _reply(send, *_error(429, message, "rate_limit_error", "rate_limit_exceeded"),
                                [(b"retry-after", str(RETRY_AFTER_S).encode())])
        self.in_flight[caller] += 1
        try:
            await self._run(scope, receive, send)
        finally:
            self.in_flight[caller] -= 1

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit, started, read = self.limits.max_request_bytes, False, 0

        async def counted() -> Message:
            nonlocal read
            message = await receive()
            read += len(message.get("body", b""))
            if limit is not None and read > limit:
                if message.get("more_body", False):
                    await _drain(receive, read)
                raise BodyTooLarge(read, limit)
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted if limit is not None else receive, watched)
        except BodyTooLarge as err:  # raised outside a route (the app's handler answers those)
            if not started:
                await _reply(send, *_too_large(err))


async def _drain(receive: Receive, read: int = 0) -> None:
    """Read and drop the rest of a request body, up to ``DRAIN_LIMIT_BYTES`` in all. A client that
    sends its whole body before it reads the answer (urllib, curl without Expect) would otherwise see
    the connection reset under its feet instead of the 413 sent while its body was still coming."""
    while read <= DRAIN_LIMIT_BYTES:
        message = await receive()
        read += len(message.get("body", b""))
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


def _too_large(err: BodyTooLarge) -> tuple[bytes, int]:
    return _error(413, str(err), "invalid_request_error", None)


async def _reply(send: Send, body: bytes, status: int, headers: list[tuple[bytes, bytes]] | None = None) -> Any:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
