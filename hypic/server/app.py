"""The HTTP surface: SGLang-native ``/generate``, OpenAI completions and chat, warmup,
health, info, flush and metrics. Handlers validate and tokenize; the engine loop does the rest."""
import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..errors import HypicError, InvalidRequest
from ..cache.modes import Mode
from ..cache.plan import RequestPlan
from .chat import chat_renderer
from ..scheduler.loop import (
    DoneEvent, EngineLoop, ErrorEvent, Event, Job, LoopStopped, PeerWork, ProgressEvent, QueueFull, ServingLoop)
from .fields import check_fields
from .gate import BodyTooLarge, Gate, GateLimits
from .protocol import (Completion, GenerationRequest, json_object, parse_chat, parse_completion, parse_flush,
                       flush_tiers,
                       parse_generate, parse_tokenize, parse_warmup)
from .tenancy import namespace_of
from .shapes import OpenAIStream, Shaper
from .stats import prometheus_text

DISCONNECT_POLL_S = 0.25
LOOP_CHECK_S = 1.0  # how often a client waiting for its next event looks whether the engine loop still runs
QUEUE_RETRY_AFTER_S = 2  # a full queue drains in about this long at the default limits
log = logging.getLogger("hypic.server")


@dataclass(frozen=True)
class ServerInfo:
    """What the server says about itself in /get_model_info and /get_server_info."""

    model_path: str
    served_model_name: str
    description: str
    random_weights: bool
    chat_template_from_model: bool
    chat_template: str
    mode: Mode
    seam_width: int
    pic_separator: str
    max_segments: int
    max_running_requests: int
    public_pool_bytes: int | None
    private_pool_bytes: int | None
    device: str
    dtype: str
    isolate_by_key: bool = False  # each API key is its own cache namespace
    max_warmup_documents: int = 256  # per /warmup call
    api_keys: int = 0  # how many keys are accepted (0: no authentication); never the keys
    max_request_bytes: int | None = None
    max_concurrent_per_key: int | None = None
    tp_size: int = 1  # tensor-parallel ranks the model is split over
    rank_pids: tuple[int, ...] = ()  # process ids of ranks 1..tp_size-1


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: ``param`` names the request field at fault, ``code`` is a string or
    null (the HTTP status says the class of error); ``detail`` is where FastAPI's clients look."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}, "detail": message}


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, code), status_code=status)


async def _json_body(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        raise InvalidRequest("the request body is empty: send a JSON object")
    return _parse_json(raw)


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InvalidRequest(f"the request body is not valid JSON: {err}") from err


def _sse(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class Peers(Protocol):
    """Other workers that prefill a request's cold documents alongside this server's engine
    (``hypic serve --workers N``: ``hypic.router.PeerPrefill``). Worker 0 is this server; the peer
    work of a request or a warm-up happens there, in one place."""

    def prefill_for(self, loop: EngineLoop, request: RequestPlan) -> Future: ...
    def warmup_for(self, loop: EngineLoop, documents: list[str], namespace: str = "") -> Future: ...
    def flush(self, namespace: str | None = None) -> int: ...
    def status(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


Prepared = tuple[GenerationRequest, Job]  # a request as checked, and its job (planned, not queued yet)
Shape = Callable[[int, Event], list[Any]]


class Server:
    """Binds the FastAPI routes to one engine loop."""

    def __init__(self, loop: ServingLoop, info: ServerInfo, peers: Peers | None = None) -> None:
        self.loop, self.info, self.peers = loop, info, peers
        self.render_chat = chat_renderer(info.chat_template)
        self.shaper = Shaper(loop.engine.tokenizer, info.served_model_name)
        self.started = time.time()

    def close(self) -> None:
        """At shutdown: stop waiting on peers (requests still waiting are cancelled)."""
        if self.peers is not None:
            self.peers.close()

    # ----- request plumbing ------------------------------------------------------------------
    def _namespace(self, http: Request, salt: tuple[str, ...]) -> str:
        """The cache namespace of a request naming ``salt``, from its caller (``Gate``)."""
        return namespace_of(salt, getattr(http.state, "caller", None), self.info.isolate_by_key)

    def _prepare(self, request: GenerationRequest, namespace: str) -> Prepared:
        """Tokenize and check one request and make its samples, before any work is queued; a refusal
        names the request's fields as its client spelled them."""
        try:
            return self._checked(request, namespace)
        except InvalidRequest as err:
            raise request.in_its_words(err) from err.__cause__

    def _checked(self, request: GenerationRequest, namespace: str) -> Prepared:
        parts = self.loop.engine.parse(request.prompt, namespace)
        if len(parts.segments) > self.info.max_segments:
            raise InvalidRequest(f"the prompt has {len(parts.segments)} segments, over the limit of "
                                 f"{self.info.max_segments} (--max-segments)")
        request = request.fitted(len(parts.token_ids), self.loop.engine.model.config.max_position_embeddings)
        request = replace(request, warnings=parts.warnings) if parts.warnings else request
        if request.logprobs is not None:
            request.logprobs.input_from(len(parts.token_ids))
        top = request.logprobs.top if request.logprobs is not None else None
        sequences = self.loop.engine.sequences(request.params, parts.token_ids, top, seed=self.loop.sample_seed())
        return request, self.loop.job_for(parts, request, sequences)  # planned here, off the event loop

    async def _submit(self, http: Request, requests: list[GenerationRequest],
                      arrived: float) -> tuple[list[GenerationRequest], list[Job], asyncio.Queue[tuple[int, Event]]]:
        """Queue every request (all checked first, off the event loop: tokenizing and compiling a
        grammar take time; a bad one in a batch starts none); returns the requests as checked (their
        budgets fitted, the warnings about their prompts) to shape the answers by, their jobs, and
        the one queue their events arrive on as (position in the batch, event). ``arrived``: when the
        HTTP request came in (its TTFT starts there)."""
        prepared = [await asyncio.to_thread(self._prepare, request, self._namespace(http, request.salt))
                    for request in requests]
        events: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        jobs = []
        for position, (request, job) in enumerate(prepared):
            def emit(event: Event, position: int = position) -> None:
                loop.call_soon_threadsafe(events.put_nowait, (position, event))

            job.start = arrived
            jobs.append(self.loop.enqueue(job, emit, self._peer_work()))
        return [request for request, _ in prepared], jobs, events

    def _peer_work(self) -> PeerWork | None:
        """With peers (and a mode that caches documents): what starts a request's documents' builds on
        them (``Peers.prefill_for``), called by the loop once the request is admitted."""
        peers, loop = self.peers, self.loop
        if peers is None or not loop.engine.policy(loop.mode).caches_segments:
            return None
        return lambda plan: peers.prefill_for(loop, plan)

    async def _collect(self, http: Request, jobs: list[Job], events: asyncio.Queue[tuple[int, Event]]) -> list[Completion]:
        """Every job's finished completion, in order; all are cancelled as soon as the client goes away."""
        watcher = asyncio.create_task(self._cancel_on_disconnect(http, jobs))
        done: dict[int, Completion] = {}
        try:
            while len(done) < len(jobs):
                position, event = await self._next_event(events)
                if isinstance(event, DoneEvent):
                    done[position] = event.completion
                elif isinstance(event, ErrorEvent):
                    raise (QueueFull if event.busy else HypicError)(event.message)
        finally:
            watcher.cancel()
            for job in jobs:
                job.cancel()  # no-op for finished jobs; the rest of a failed batch stops
        return [done[position] for position in range(len(jobs))]

    async def _opening(self, http: Request, jobs: list[Job],
                       events: asyncio.Queue[tuple[int, Event]]) -> tuple[int, Event]:
        """A stream's first event, waited for before its response starts: one that ends the request
        before its first token (a refusal as busy, a failure) is answered with its HTTP status (503 and
        retry-after, 500), as an unstreamed request's is, not as an error inside a 200 stream."""
        watcher = asyncio.create_task(self._cancel_on_disconnect(http, jobs))
        try:
            position, event = await self._next_event(events)
        finally:
            watcher.cancel()
        if isinstance(event, ErrorEvent):
            for job in jobs:
                job.cancel()
            raise (QueueFull if event.busy else HypicError)(event.message)
        return position, event

    async def _next_event(self, events: asyncio.Queue[tuple[int, Event]]) -> tuple[int, Event]:
        """The next event of a client's requests; if the engine loop stopped without sending it, the
        loop's failure (the loop tells its clients as it stops; this covers any it could not reach)."""
        while True:
            try:
                return await asyncio.wait_for(events.get(), timeout=LOOP_CHECK_S)
            except TimeoutError:
                if not self.loop.alive or self.loop.failure is not None:
                    return 0, ErrorEvent(self.loop.failure or "the engine loop has stopped")

    @staticmethod
    async def _cancel_on_disconnect(http: Request, jobs: list[Job]) -> None:
        """Polls the connection while the jobs run (tokens flowing or not) and cancels them on a disconnect."""
        while not await http.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_S)
        for job in jobs:
            job.cancel()

    async def _stream(self, jobs: list[Job], events: asyncio.Queue[tuple[int, Event]], shape: Shape,
                      tail: Callable[[list[Completion]], list[Any]], first: tuple[int, Event]) -> AsyncIterator[str]:
        """SSE chunks shaped per API from ``first`` (``_opening``'s) on, ending in ``data: [DONE]``; a
        disconnect cancels the jobs."""
        done: dict[int, Completion] = {}
        pending: tuple[int, Event] | None = first
        try:
            while len(done) < len(jobs):
                position, event = pending or await self._next_event(events)
                pending = None
                for payload in shape(position, event):
                    yield _sse(payload)
                if isinstance(event, ErrorEvent):
                    break
                if isinstance(event, DoneEvent):
                    done[position] = event.completion
            else:
                for payload in tail([done[p] for p in range(len(jobs))]):
                    yield _sse(payload)
            yield "data: [DONE]\n\n"
        finally:
            for job in jobs:
                job.cancel()  # no-op once finished; stops the work when the client left mid-stream

    @staticmethod
    def _error_chunk(event: Event) -> list[Any]:
        if isinstance(event, ErrorEvent):
            return [{"error": error_body(event.message, "internal_error")["error"]}]
        return []

    # ----- endpoints -------------------------------------------------------------------------
    async def generate(self, http: Request) -> Any:
        arrived = time.perf_counter()
        requests, batched = parse_generate(await _json_body(http))
        listed = batched or requests[0].params.n > 1
        requests, jobs, events = await self._submit(http, requests, arrived)
        if requests[0].stream:
            def shape(position: int, event: Event) -> list[Any]:
                if not isinstance(event, ProgressEvent):
                    return self._error_chunk(event)
                item = self.shaper.sglang_item(event.completion, event.index, requests[position])
                return [{**item, "index": position * requests[position].params.n + event.index} if listed else item]

            first = await self._opening(http, jobs, events)
            return StreamingResponse(self._stream(jobs, events, shape, lambda _: [], first), media_type="text/event-stream")
        completions = await self._collect(http, jobs, events)
        return self.shaper.sglang_body(completions, requests, listed)

    async def openai(self, http: Request, chat: bool) -> Any:
        arrived = time.perf_counter()
        body = await _json_body(http)
        self.check_model(body.get("model") if isinstance(body, dict) else None)
        if chat:
            request, options = parse_chat(body, self.render_chat)
            requests = [request]
        else:
            requests, options = parse_completion(body)
        requests, jobs, events = await self._submit(http, requests, arrived)
        rid = jobs[0].rid
        if requests[0].stream:
            stream = OpenAIStream(self.shaper, rid, chat, options, requests[0].params.n)

            def shape(position: int, event: Event) -> list[Any]:
                if not isinstance(event, ProgressEvent):
                    return self._error_chunk(event)
                return stream.progress(position, event.index, event.completion)

            first = await self._opening(http, jobs, events)
            return StreamingResponse(self._stream(jobs, events, shape, stream.tail, first), media_type="text/event-stream")
        completions = await self._collect(http, jobs, events)
        return self.shaper.openai_body(rid, completions, requests, options, chat)

    def check_model(self, model: Any) -> None:
        """The served name and the model path are this model; any other name is 404 model_not_found."""
        if model in (None, "", self.info.served_model_name, self.info.model_path):
            return
        raise ModelNotFound(str(model))

    def model_card(self) -> dict[str, Any]:
        return {"id": self.info.served_model_name, "object": "model", "created": int(self.started), "owned_by": "hypic",
                "root": self.info.model_path, "parent": None,
                "max_model_len": self.loop.engine.model.config.max_position_embeddings}

    async def tokenize(self, http: Request) -> Any:
        """The ids ``/generate`` would prefill for a prompt (separators split it into parts, each
        tokenized alone and without special tokens, as prompts are)."""
        body = json_object(await _json_body(http))
        self.check_model(body.get("model"))
        prompts, listed = parse_tokenize(body, self.render_chat)
        tokens = [self.loop.engine.parse(p).token_ids if p else [] for p in prompts]
        limit = self.loop.engine.model.config.max_position_embeddings
        if listed:
            return {"tokens": tokens, "count": [len(t) for t in tokens], "max_model_len": limit}
        return {"tokens": tokens[0], "count": len(tokens[0]), "max_model_len": limit}

    async def detokenize(self, http: Request) -> Any:
        body = json_object(await _json_body(http))
        check_fields(body, {"model", "tokens", "skip_special_tokens"}, "/detokenize")
        self.check_model(body.get("model"))
        if body.get("skip_special_tokens") not in (None, True):
            raise InvalidRequest("'skip_special_tokens' = false is not supported: special tokens are never shown")
        tokens, vocab = body.get("tokens"), self.loop.engine.model.config.vocab_size
        batch = isinstance(tokens, list) and bool(tokens) and all(isinstance(t, list) for t in tokens)
        lists = tokens if batch else [tokens]
        for ids in lists:
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                    for t in ids):
                raise InvalidRequest(f"'tokens' must be token ids in [0, {vocab}) or lists of them")
        texts = [self.loop.engine.tokenizer.decode(ids) for ids in lists]
        return {"text": texts if batch else texts[0]}

    async def warmup(self, http: Request) -> Any:
        documents, salt = parse_warmup(await _json_body(http))
        if len(documents) > self.info.max_warmup_documents:
            raise InvalidRequest(f"{len(documents)} documents in one /warmup, over the limit of "
                                 f"{self.info.max_warmup_documents} (--max-warmup-documents): send them in several calls")
        start, namespace = time.perf_counter(), self._namespace(http, salt)
        if self.peers is not None and self.loop.engine.policy(self.loop.mode).caches_segments:
            self.loop.engine.check_documents(documents)  # as the engine's own warm-up would, before any planning
            counts = await asyncio.wrap_future(self.peers.warmup_for(self.loop, documents, namespace))
        else:
            counts = await asyncio.wrap_future(await asyncio.to_thread(self.loop.warmup, documents, namespace))
        return {"token_counts": counts, "documents": len(counts), "elapsed_s": time.perf_counter() - start}

    async def flush_cache(self, http: Request) -> Any:
        """Every namespace's entries; with a ``cache_salt``, or under ``--isolate-by-key``, only the
        caller's namespace (a tenant never empties another's cache)."""
        raw = await http.body()
        request = parse_flush(_parse_json(raw) if raw.strip() else None)
        if "tiers" in http.query_params:
            request = replace(request, tiers=flush_tiers(http.query_params["tiers"]))
        salt = request.salt
        namespace = self._namespace(http, salt or ()) if salt is not None or self.info.isolate_by_key else None

        public, private, lower = await asyncio.wrap_future(self.loop.flush(namespace, request.tiers))
        flushed = {"public_entries_dropped": public, "private_nodes_dropped": private,
                   "tiers": sorted(request.tiers), "tier_entries_dropped": lower}
        if self.peers is not None:
            flushed["peer_entries_dropped"] = await asyncio.to_thread(self.peers.flush, namespace)
        return {"flushed": True, "namespace": "all" if namespace is None else "one", **flushed}

    def model_info(self) -> dict[str, Any]:
        """The checkpoint's shape; ``quantization``: how its weights were stored (None: float), held
        dequantized in ``dtype``."""
        engine = self.loop.engine
        config, quantization = engine.model.config, engine.quantization
        return {"model_path": self.info.model_path, "served_model_name": self.info.served_model_name,
                "description": self.info.description, "random_weights": self.info.random_weights,
                "is_generation": True, "model_type": config.model_type, "fingerprint": self.loop.engine.fingerprint,
                "num_layers": config.num_hidden_layers, "layer_types": list(config.layer_types),
                "vocab_size": config.vocab_size, "max_position_embeddings": config.max_position_embeddings,
                "chat_template_from_model": self.info.chat_template_from_model,
                "dtype": str(engine.model.dtype).removeprefix("torch."),
                "quantization": quantization.describe() if quantization is not None else None}

    def server_info(self) -> dict[str, Any]:
        engine, budget = self.loop.engine, self.loop.policy.max_state_bytes
        limit, per_token = engine.model.config.max_position_embeddings, engine.state_bytes(2) - engine.state_bytes(1)
        tokens = budget // max(per_token, 1) if budget is not None else limit * self.info.max_running_requests
        skipped = ("chat_template", "rank_pids")
        return {**{k: v for k, v in asdict(self.info).items() if k not in skipped}, **self.loop.snapshot,
                "tensor_parallel": self.tensor_parallel(),
                "uptime_s": time.time() - self.started, "version": __version__, "max_total_num_tokens": tokens,
                "max_req_input_len": limit - 1, "snapshot_interval": engine.snapshot_interval,
                "workers": {**(self.peers.status() if self.peers is not None else {"workers": [0], "lost_workers": []}),
                            "peer_prefill_failures": self.loop.snapshot["peer_prefill_failures"]}}


    def tensor_parallel(self) -> dict[str, Any]:
        """The ranks the model is split over and what one rank holds (rank 0's numbers: every rank's
        shard and pools have the same sizes)."""
        weights = self.loop.snapshot.get("weight_bytes")  # a replicated service's: its replicas' (the ingress has none)
        if weights is None:
            weights = self.loop.engine.weight_bytes()
        return {"tp_size": self.info.tp_size, "rank_pids": [os.getpid(), *self.info.rank_pids],
                "per_rank": {"weight_bytes": weights, "public_pool_budget_bytes": self.info.public_pool_bytes,
                             "private_pool_budget_bytes": self.info.private_pool_bytes,
                             "note": "rank 0's numbers; every rank holds a shard of the same size"}}


class ModelNotFound(HypicError):
    """An OpenAI request named a model this server does not serve."""


def build_app(loop: ServingLoop, info: ServerInfo, peers: Peers | None = None,
              limits: GateLimits = GateLimits()) -> Gate:
    """The application behind its ``Gate`` (API keys and request limits); errors always come back
    as ``{"error": {"message", ...}}``."""
    info = replace(info, api_keys=len(limits.keys.digests), max_request_bytes=limits.max_request_bytes,
                   max_concurrent_per_key=limits.max_concurrent_per_key)
    return Gate(_routes(loop, info, peers), limits)


def _routes(loop: ServingLoop, info: ServerInfo, peers: Peers | None) -> FastAPI:
    server = Server(loop, info, peers)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        server.close()

    app = FastAPI(title="HYPIC", description="Position-independent caching for hybrid-attention LLMs", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(InvalidRequest)
    async def invalid(_: Request, err: InvalidRequest) -> JSONResponse:
        return error_response(400, str(err), param=err.param)

    @app.exception_handler(ModelNotFound)
    async def unknown_model(_: Request, err: ModelNotFound) -> JSONResponse:
        message = f"The model '{err}' does not exist: this server serves '{info.served_model_name}'"
        return error_response(404, message, param="model", code="model_not_found")

    @app.exception_handler(QueueFull)
    async def busy(_: Request, err: QueueFull) -> JSONResponse:
        response = error_response(503, str(err), "service_unavailable")
        response.headers["retry-after"] = str(QUEUE_RETRY_AFTER_S)
        return response

    @app.exception_handler(LoopStopped)
    async def stopped(_: Request, err: LoopStopped) -> JSONResponse:
        return error_response(503, str(err), "service_unavailable")

    @app.exception_handler(BodyTooLarge)
    async def too_large(_: Request, err: BodyTooLarge) -> JSONResponse:
        return error_response(413, str(err))

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

    for path in ("/tokenize", "/v1/tokenize"):
        app.post(path)(server.tokenize)
    for path in ("/detokenize", "/v1/detokenize"):
        app.post(path)(server.detokenize)
    app.post("/warmup")(server.warmup)
    app.post("/flush_cache")(server.flush_cache)
    app.get("/get_model_info")(server.model_info)

    @app.get("/health")
    async def health() -> Any:
        if loop.failure is not None:
            return error_response(503, loop.failure, "internal_error")
        if not loop.alive:
            return error_response(503, "the engine loop has stopped", "internal_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Any:
        server.check_model(model)
        return server.model_card()

    for path in ("/get_server_info", "/server_info"):
        app.get(path)(server.server_info)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        workers = peers.status() if peers is not None else None
        return PlainTextResponse(prometheus_text(loop.snapshot, workers), media_type="text/plain; version=0.0.4")

    return app
