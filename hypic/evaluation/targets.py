"""Where a study's requests run: the in-process engine, or a running server's SGLang ``/generate``.

Both start every sample from empty pools and apply the warm-up policy of ``methods``. A server
serves one mode and seam width (``hypic serve --mode --seam-width``), read from its
``/get_server_info``; a study against it runs only that method. A server that does not say its
mode (another SGLang-compatible server) is taken as ``prefix``: its radix cache is prefix caching.
"""
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from hypic import DEFAULT_SEPARATOR, Engine
from hypic.cache.modes import Mode

from .data import Sample
from .methods import Method, MethodError, run_sample


class TargetError(RuntimeError):
    """A server that cannot be reached or answers with an error."""


@dataclass(frozen=True)
class Outcome:
    """What one timed request gave."""

    text: str
    output_ids: list[int]
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    segments_hit: int


class Target(Protocol):
    def can_run(self, method: Method) -> bool: ...

    def run(self, sample: Sample, method: Method, warm: bool) -> Outcome: ...


class EngineTarget:
    """The in-process engine: every method, each on fresh pools sharing the weights."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def can_run(self, method: Method) -> bool:
        return True

    def run(self, sample: Sample, method: Method, warm: bool) -> Outcome:
        result = run_sample(self.engine, sample, method, warm)
        return Outcome(result.text, result.output_ids, result.ttft_s, result.prompt_tokens, result.cached_tokens,
                       result.recomputed_tokens, result.segments_hit)


def salted(cache_salt: str | None) -> dict[str, str]:
    """A request body's ``cache_salt`` field, or none (servers that know no salt see no new field)."""
    return {} if cache_salt is None else {"cache_salt": cache_salt}


class ServerTarget:
    """A running server at ``url``: its pools flushed before each sample, its own mode only."""

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.client = httpx.Client(base_url=self.url, timeout=timeout_s)
        info = self._call("GET", "/get_server_info")
        self.method = Method(Mode.parse(info["mode"]), int(info.get("seam_width", 8))) if "mode" in info else Method(Mode.PREFIX)
        self.separator = info.get("pic_separator", DEFAULT_SEPARATOR)

    def _call(self, verb: str, path: str, body: Any = None) -> Any:
        try:
            response = self.client.request(verb, path, json=body)
        except httpx.HTTPError as err:
            raise TargetError(f"cannot reach the server at {self.url}{path}: {err}") from None
        if response.status_code != 200:
            raise TargetError(f"{verb} {self.url}{path} answered {response.status_code}: {response.text[:300]}")
        return response.json()

    def can_run(self, method: Method) -> bool:
        return method == self.method

    def run(self, sample: Sample, method: Method, warm: bool) -> Outcome:
        if not self.can_run(method):
            raise MethodError(f"the server at {self.url} serves {self.method.label}, not {method.label}")
        self.flush()
        if warm and method.mode in ("hypic", "naive"):
            self.warmup(list(sample.documents))
        elif warm and method.mode == "prefix":
            for earlier in sample.earlier_prompts(self.separator):
                self.generate(earlier, 1)
        reply = self.generate(sample.prompt(self.separator), sample.max_new_tokens)
        meta = reply["meta_info"]
        cached = int(meta.get("cached_tokens", 0))
        return Outcome(reply["text"], list(reply["output_ids"]), float(meta.get("ttft", meta.get("e2e_latency", 0.0))),
                       int(meta["prompt_tokens"]), cached,
                       int(meta.get("recomputed_tokens", int(meta["prompt_tokens"]) - cached)),
                       int(meta.get("segments_hit", 0)))

    def flush(self) -> None:
        """Empty the server's pools (``/flush_cache``)."""
        self._call("POST", "/flush_cache")

    def warmup(self, documents: list[str]) -> dict[str, Any]:
        """Cache ``documents`` in the server's public pool (``/warmup``)."""
        return self._call("POST", "/warmup", {"documents": documents})

    def info(self) -> dict[str, Any]:
        """The server's ``/get_server_info``."""
        return self._call("GET", "/get_server_info")

    def generate(self, text: str, max_new_tokens: int, cache_salt: str | None = None) -> dict[str, Any]:
        """One greedy ``/generate`` call (in ``cache_salt``'s namespace, if given): its JSON answer."""
        return self._call("POST", "/generate", {"text": text, **salted(cache_salt), "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0.0}})
