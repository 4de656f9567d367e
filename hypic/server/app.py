"""The HTTP surface (DESIGN §8): SGLang-native ``/generate``, OpenAI completions and chat, warmup,
health, info, flush and metrics. Handlers validate and tokenize; the engine loop does the rest."""
import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import HypicError, InvalidRequest
from ..segments import PromptParts
from .chat import chat_renderer
from .loop import DoneEvent, EngineLoop, ErrorEvent, Event, Job, TokenEvent
from .protocol import Completion, GenerationRequest, parse_chat, parse_completion, parse_generate, parse_warmup
from .stats import prometheus_text

DISCONNECT_POLL_S = 0.25


@dataclass(frozen=True)
class ServerInfo:
    """What the server says about itself in /get_model_info and /get_server_info."""

    model_path: str
    served_model_name: str
    description: str
    random_weights: bool
    chat_template_from_model: bool
    chat_template: str
    mode: str
    seam_width: int
    pic_separator: str
    max_segments: int
    max_running_requests: int
    public_pool_bytes: int | None
    private_pool_bytes: int | None
    device: str
    dtype: str


def error_response(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}, "detail": message}, status_code=status)


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        raise InvalidRequest("the request body is empty: send a JSON object")
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidRequest(f"the request body is not valid JSON: {err}") from err


def _finish_reason_sglang(c: Completion) -> dict[str, Any]:
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.matched_stop}
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.output_ids)}
    return {"type": "abort", "message": "the client disconnected"}


def meta_info(c: Completion) -> dict[str, Any]:
    """SGLang's meta_info plus HYPIC's breakdown of what was reused."""
    return {"id": c.rid, "finish_reason": _finish_reason_sglang(c), "prompt_tokens": c.prompt_tokens,
            "completion_tokens": len(c.output_ids), "cached_tokens": c.cached_tokens, "e2e_latency": c.e2e_s,
            "ttft": c.ttft_s, "recomputed_tokens": c.recomputed_tokens, "prefix_hit_tokens": c.prefix_hit_tokens,
            "segments_hit": c.segments_hit, "segments_missed": c.segments_missed, "combine_tokens": c.combine_tokens,
            "mode": c.mode, **({"output_token_logprobs": [[lp, t, None] for lp, t in zip(c.output_logprobs, c.output_ids)]}
                               if c.output_logprobs else {})}


def _usage(c: Completion) -> dict[str, Any]:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": len(c.output_ids),
            "total_tokens": c.prompt_tokens + len(c.output_ids), "prompt_tokens_details": {"cached_tokens": c.cached_tokens}}


def _openai_reason(c: Completion) -> str:
    return "length" if c.finish_reason == "length" else "stop"


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class Server:
    """Binds the FastAPI routes to one engine loop."""

    def __init__(self, loop: EngineLoop, info: ServerInfo) -> None:
        self.loop, self.info = loop, info
        self.render_chat = chat_renderer(info.chat_template)
        self.started = time.time()

    # ----- request plumbing ------------------------------------------------------------------
    def _parts(self, request: GenerationRequest) -> PromptParts:
        parts = self.loop.engine.parse(request.prompt)
        if len(parts.segments) > self.info.max_segments:
            raise InvalidRequest(f"the prompt has {len(parts.segments)} segments, over the limit of "
                                 f"{self.info.max_segments} (--max-segments)")
        return parts

    def _start(self, request: GenerationRequest) -> tuple[Job, asyncio.Queue[Event]]:
        parts = self._parts(request)
        events: asyncio.Queue[Event] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        job = self.loop.submit(parts, request, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        return job, events

    async def _wait_done(self, http: Request, job: Job, events: asyncio.Queue[Event]) -> Completion:
        """The finished completion; the job is cancelled as soon as the client goes away."""
        watcher = asyncio.create_task(self._cancel_on_disconnect(http, job))
        try:
            while True:
                event = await events.get()
                if isinstance(event, DoneEvent):
                    return event.completion
                if isinstance(event, ErrorEvent):
                    raise HypicError(event.message)
        finally:
            watcher.cancel()

    @staticmethod
    async def _cancel_on_disconnect(http: Request, job: Job) -> None:
        """Polls the connection while the job runs (tokens flowing or not) and cancels it on a disconnect."""
        while not await http.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        job.cancel()

    async def _stream(self, job: Job, events: asyncio.Queue[Event],
                      shape: Callable[[Event], list[Any]]) -> AsyncIterator[str]:
        """SSE chunks shaped per API, ending in ``data: [DONE]``; a disconnect cancels the job."""
        try:
            while True:
                event = await events.get()
                for payload in shape(event):
                    yield _sse(payload)
                if isinstance(event, (DoneEvent, ErrorEvent)):
                    break
            yield "data: [DONE]\n\n"
        finally:
            job.cancel()  # no-op once finished; stops the work when the client left mid-stream

    # ----- API shapes ------------------------------------------------------------------------
    def sglang_chunks(self, event: Event) -> list[Any]:
        if isinstance(event, TokenEvent):
            return [{"text": event.text, "output_ids": event.output_ids, "meta_info": {"completion_tokens": len(event.output_ids)}}]
        if isinstance(event, DoneEvent):
            c = event.completion
            return [{"text": c.text, "output_ids": c.output_ids, "meta_info": meta_info(c)}]
        return [{"error": {"message": event.message, "type": "internal_error", "code": 500}}]

    def openai_chunks(self, rid: str, chat: bool) -> Callable[[Event], list[Any]]:
        """Shapes events into OpenAI stream chunks; the last chunk carries the text not yet sent."""
        base = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": int(time.time()),
                "model": self.info.served_model_name}
        sent = [""]

        def choice(delta: str, reason: str | None) -> dict[str, Any]:
            body = {"delta": {"role": "assistant", "content": delta}} if chat else {"text": delta, "logprobs": None}
            return {"index": 0, **body, "finish_reason": reason}

        def shape(event: Event) -> list[Any]:
            if isinstance(event, TokenEvent):
                sent[0] = event.text
                return [{**base, "choices": [choice(event.delta, None)]}]
            if isinstance(event, DoneEvent):
                c = event.completion
                return [{**base, "choices": [choice(c.text[len(sent[0]):], _openai_reason(c))], "usage": _usage(c)}]
            return [{"error": {"message": event.message, "type": "internal_error", "code": 500}}]

        return shape

    def openai_body(self, c: Completion, chat: bool) -> dict[str, Any]:
        choice = ({"message": {"role": "assistant", "content": c.text}} if chat else {"text": c.text, "logprobs": None})
        return {"id": c.rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.info.served_model_name, "choices": [{"index": 0, **choice, "finish_reason": _openai_reason(c)}],
                "usage": _usage(c), "meta_info": meta_info(c)}

    # ----- endpoints -------------------------------------------------------------------------
    async def generate(self, http: Request) -> Any:
        request = parse_generate(await _json_body(http))
        job, events = self._start(request)
        if request.stream:
            return StreamingResponse(self._stream(job, events, self.sglang_chunks), media_type="text/event-stream")
        c = await self._wait_done(http, job, events)
        return {"text": c.text, "output_ids": c.output_ids, "meta_info": meta_info(c)}

    async def openai(self, http: Request, chat: bool) -> Any:
        body = await _json_body(http)
        self._check_model(body)
        request = parse_chat(body, self.render_chat) if chat else parse_completion(body)
        job, events = self._start(request)
        if request.stream:
            chunks = self._stream(job, events, self.openai_chunks(job.rid, chat))
            return StreamingResponse(chunks, media_type="text/event-stream")
        return self.openai_body(await self._wait_done(http, job, events), chat)

    def _check_model(self, body: Any) -> None:
        model = body.get("model") if isinstance(body, dict) else None
        if model not in (None, "", "default", self.info.served_model_name):
            raise InvalidRequest(f"unknown model {model!r}: this server serves {self.info.served_model_name!r}")

    async def warmup(self, http: Request) -> Any:
        documents = parse_warmup(await _json_body(http))
        start = time.perf_counter()
        counts = await asyncio.wrap_future(self.loop.call(lambda: self.loop.engine.warmup(documents, self.loop.mode)))
        return {"token_counts": counts, "documents": len(counts), "elapsed_s": time.perf_counter() - start}

    async def flush_cache(self) -> Any:
        def flush() -> dict[str, int]:
            return {"public_entries_dropped": self.loop.engine.store.clear(),
                    "private_nodes_dropped": self.loop.engine.prefix_cache.clear()}

        return {"flushed": True, **await asyncio.wrap_future(self.loop.call(flush))}

    def model_info(self) -> dict[str, Any]:
        config = self.loop.engine.model.config
        return {"model_path": self.info.model_path, "served_model_name": self.info.served_model_name,
                "description": self.info.description, "random_weights": self.info.random_weights,
                "is_generation": True, "model_type": config.model_type, "fingerprint": self.loop.engine.fingerprint,
                "num_layers": config.num_hidden_layers, "layer_types": list(config.layer_types),
                "vocab_size": config.vocab_size, "max_position_embeddings": config.max_position_embeddings,
                "chat_template_from_model": self.info.chat_template_from_model}


def build_app(loop: EngineLoop, info: ServerInfo) -> FastAPI:
    """The FastAPI application; errors always come back as ``{"error": {"message", ...}}``."""
    server = Server(loop, info)
    app = FastAPI(title="HYPIC", description="Position-independent caching for hybrid-attention LLMs")

    @app.exception_handler(InvalidRequest)
    async def invalid(_: Request, err: InvalidRequest) -> JSONResponse:
        return error_response(400, str(err))

    @app.exception_handler(HypicError)
    async def failed(_: Request, err: HypicError) -> JSONResponse:
        return error_response(500, str(err), "internal_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = f"unknown endpoint {request.method} {request.url.path}" if err.status_code == 404 else str(err.detail)
        if err.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return error_response(err.status_code, message)

    app.post("/generate")(server.generate)

    @app.post("/v1/completions")
    async def completions(http: Request) -> Any:
        return await server.openai(http, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Any:
        return await server.openai(http, chat=True)

    app.post("/warmup")(server.warmup)
    app.post("/flush_cache")(server.flush_cache)
    app.get("/get_model_info")(server.model_info)

    @app.get("/health")
    async def health() -> Any:
        if not loop.alive:
            return error_response(503, "the engine loop has stopped", "internal_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": info.served_model_name, "object": "model", "created": int(server.started),
                                            "owned_by": "hypic", "max_model_len": loop.engine.model.config.max_position_embeddings}]}

    @app.get("/get_server_info")
    async def server_info() -> Any:
        return {**{k: v for k, v in asdict(info).items() if k != "chat_template"}, **loop.snapshot,
                "uptime_s": time.time() - server.started}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus_text(loop.snapshot), media_type="text/plain; version=0.0.4")

    return app
