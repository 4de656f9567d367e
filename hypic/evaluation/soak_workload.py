"""The soak study's clients: a mixed stream of the requests a shared HYPIC server sees, each sent
and judged on its own (what came back, how long the first token took, whether its answer is
checkable later against a quiet server).

Kinds: PIC prompts over a Zipf-popular document pool (larger than the pools), plain completions,
two-turn chats, structured output, ``n > 1``, chat streams the client drops, bad bodies, warm-ups,
one namespace's flush, reads of the info endpoints; PIC prompts, chats and warm-ups are spread
over two cache namespaces (``cache_salt``) and the shared one. A probe warms new documents in one namespace, then asks for them from a new
namespace and, in random order, for as many new documents nobody cached from another: the two
first-token times must come from one distribution (no timing leak across namespaces).
"""
import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

import httpx

from hypic import DEFAULT_SEPARATOR as SEP

WORDS = ("heron lynx otter crane river mill lake valley reed stone weather frog dawn record studied born coat call "
         "harbor tower garden forest island bridge market").split()
NAMESPACES = ("ns-a", "ns-b", None)  # None: the shared namespace
KINDS = {"pic": 0.28, "plain": 0.10, "chat": 0.11, "structured": 0.05, "samples": 0.05, "dropped": 0.07, "bad": 0.09,
         "warmup": 0.09, "flush": 0.03, "info": 0.06, "probe": 0.07}
PROBES = ("probe_other", "probe_cold")  # another namespace's documents, documents nobody has
REGEX = r"[a-z]{1,8}( [a-z]{1,8}){0,3}"
BAD_BODIES = [b"{bad", b'{"text": 5}', b'{"text": "a", "lora_path": "x"}', b"[]",
              b'{"text": "a", "sampling_params": {"max_new_tokens": 99999999}}',
              b'{"text": "a", "sampling_params": {"temperature": -1}}', b'{"text": "a", "cache_salt": 7}']


@dataclass
class Outcome:
    """One request as the client saw it. ``replay``: a greedy request's body and output ids, which a
    quiet server must reproduce; ``wrong``: why its answer is wrong on its face (empty if not)."""

    kind: str
    status: int | None  # None: no HTTP answer (connection refused or broken)
    start_s: float
    latency_s: float
    ttft_s: float | None = None
    namespace: str | None = None
    replay: dict[str, Any] | None = None
    wrong: str = ""
    error: str = ""
    disk_tokens: int = 0  # prompt tokens reused from the disk tier (--cache-dir)

    @property
    def outcome(self) -> str:
        if self.status is None:
            return "no_answer"
        if self.kind == "dropped" and self.status == 200:
            return "dropped"
        return "ok" if self.status < 400 else "4xx" if self.status < 500 else "5xx"


@dataclass
class Workload:
    """The document pool and the mix; ``pick`` draws the next request's kind."""

    documents: int = 80
    zipf: float = 1.1
    seed: int = 0
    pool: list[str] = field(init=False)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.pool = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 160))) + f" Record {i}."
                     for i in range(self.documents)]
        self.weights = [1 / (rank + 1) ** self.zipf for rank in range(self.documents)]

    def docs(self, rng: random.Random, count: int) -> list[str]:
        chosen: list[str] = []
        while len(chosen) < count:
            doc = rng.choices(self.pool, self.weights)[0]
            if doc not in chosen:
                chosen.append(doc)
        return chosen

    def pick(self, rng: random.Random) -> str:
        return rng.choices(list(KINDS), list(KINDS.values()))[0]


class Client:
    """One client thread's connection; ``send(kind)`` runs one request of that kind."""

    def __init__(self, url: str, workload: Workload, rng: random.Random, clock: Any, timeout_s: float = 300) -> None:
        self.http = httpx.Client(base_url=url, timeout=timeout_s)
        self.workload, self.rng, self.clock = workload, rng, clock

    def close(self) -> None:
        self.http.close()

    def send(self, kind: str) -> list[Outcome]:
        start = self.clock()
        try:
            return getattr(self, f"_{kind}")(start)
        except httpx.HTTPError as err:
            return [Outcome(kind, None, start, self.clock() - start, error=f"{type(err).__name__}: {err}"[:200])]

    # ----- kinds -------------------------------------------------------------------------------
    def _pic(self, start: float) -> list[Outcome]:
        rng, namespace = self.rng, self.rng.choice(NAMESPACES)
        text = SEP.join(["Answer from the records.", *self.workload.docs(rng, rng.randint(2, 5)),
                         f"Question {rng.randint(0, 999)}: who studied the {rng.choice(WORDS)}?"])
        greedy = rng.random() < 0.8
        params = {"max_new_tokens": rng.randint(1, 16), "temperature": 0 if greedy else 0.8,
                  **({} if greedy else {"seed": rng.randint(0, 999)})}
        body = {"text": text, "sampling_params": params, **({"cache_salt": namespace} if namespace else {})}
        return [self._generate("pic", body, rng.random() < 0.5, start, namespace)]

    def _plain(self, start: float) -> list[Outcome]:
        body = {"prompt": " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(20, 300))),
                "max_tokens": self.rng.randint(1, 16), "temperature": 0}
        response = self.http.post("/v1/completions", json=body)
        outcome = Outcome("plain", response.status_code, start, self.clock() - start)
        if response.status_code == 200:
            outcome.replay = {"path": "/v1/completions", "body": body, "text": response.json()["choices"][0]["text"]}
        return [outcome]

    def _chat(self, start: float) -> list[Outcome]:
        """Two turns: the second carries the first's answer (the private pool resumes it)."""
        rng, namespace = self.rng, self.rng.choice(NAMESPACES)
        messages = [{"role": "system", "content": SEP.join(["Use the records.", *self.workload.docs(rng, 2), ""])},
                    {"role": "user", "content": f"Where was the {rng.choice(WORDS)} born?"}]
        outcomes = []
        for turn in range(2):
            body = {"messages": messages, "max_tokens": rng.randint(2, 12), "temperature": 0,
                    **({"cache_salt": namespace} if namespace else {})}
            began = self.clock() if turn else start
            response = self.http.post("/v1/chat/completions", json=body)
            outcome = Outcome("chat", response.status_code, began, self.clock() - began, namespace=namespace)
            outcomes.append(outcome)
            if response.status_code != 200:
                break
            answer = response.json()["choices"][0]["message"]["content"]
            outcome.replay = {"path": "/v1/chat/completions", "body": body, "text": answer}  # the next turn makes a new list
            messages = [*messages, {"role": "assistant", "content": answer},
                        {"role": "user", "content": "And who studied it?"}]
        return outcomes

    def _structured(self, start: float) -> list[Outcome]:
        body = {"text": SEP.join(["Name it.", *self.workload.docs(self.rng, 2), "Answer in words:"]),
                "sampling_params": {"max_new_tokens": 24, "temperature": 0, "regex": REGEX}}
        outcome = self._generate("structured", body, False, start, None)
        if outcome.replay is not None and not re.fullmatch(REGEX, outcome.replay["text"]):
            outcome.wrong = f"output {outcome.replay['text']!r} does not match {REGEX}"
        return [outcome]

    def _samples(self, start: float) -> list[Outcome]:
        body = {"prompt": SEP.join(["Continue.", *self.workload.docs(self.rng, 2), "Next:"]), "max_tokens": 6,
                "n": 3, "temperature": 0.9, "seed": self.rng.randint(0, 999)}
        response = self.http.post("/v1/completions", json=body)
        outcome = Outcome("samples", response.status_code, start, self.clock() - start)
        if response.status_code == 200 and len(response.json()["choices"]) != 3:
            outcome.wrong = f"n=3 gave {len(response.json()['choices'])} choices"
        return [outcome]

    def _dropped(self, start: float) -> list[Outcome]:
        body = {"messages": [{"role": "user", "content": SEP.join(["Read.", *self.workload.docs(self.rng, 3), "Tell."])}],
                "max_tokens": 40, "stream": True, "ignore_eos": True}
        with self.http.stream("POST", "/v1/chat/completions", json=body) as stream:
            first = None
            for index, _ in enumerate(stream.iter_lines()):
                first = first or self.clock()
                if index > 3:
                    break  # the client goes away mid-stream
            status = stream.status_code
        return [Outcome("dropped", status, start, self.clock() - start, None if first is None else first - start)]

    def _bad(self, start: float) -> list[Outcome]:
        response = self.http.post("/generate", content=self.rng.choice(BAD_BODIES))
        outcome = Outcome("bad", response.status_code, start, self.clock() - start)
        if response.status_code < 400:
            outcome.wrong = "a bad body was accepted"
        return [outcome]

    def _warmup(self, start: float) -> list[Outcome]:
        namespace = self.rng.choice(NAMESPACES)
        body = {"documents": self.workload.docs(self.rng, 2), **({"cache_salt": namespace} if namespace else {})}
        response = self.http.post("/warmup", json=body)
        return [Outcome("warmup", response.status_code, start, self.clock() - start, namespace=namespace)]

    def _flush(self, start: float) -> list[Outcome]:
        namespace = self.rng.choice(NAMESPACES[:2])  # one namespace's cache, never everyone's
        response = self.http.post("/flush_cache", json={"cache_salt": namespace})
        return [Outcome("flush", response.status_code, start, self.clock() - start, namespace=namespace)]

    def _probe(self, start: float) -> list[Outcome]:
        rng = self.rng
        tag = f"{rng.getrandbits(48):012x}"
        owned, unseen = ([" ".join(rng.choice(WORDS) for _ in range(80)) + f" Probe {tag}-{side}-{i}." for i in range(3)]
                         for side in ("owned", "unseen"))
        warmed = self.http.post("/warmup", json={"documents": owned, "cache_salt": f"owner-{tag}"})
        if warmed.status_code != 200:
            return [Outcome("probe_other", warmed.status_code, start, self.clock() - start)]
        asks = [("probe_other", owned, f"other-{tag}"), ("probe_cold", unseen, f"cold-{tag}")]
        rng.shuffle(asks)
        outcomes = []
        for kind, docs, salt in asks:
            body = {"text": SEP.join(["Answer from the records.", *docs, "Who was born first?"]), "cache_salt": salt,
                    "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
            outcome = self._generate(kind, body, True, self.clock(), salt)
            outcome.replay = None  # single-use namespaces: nothing to compare a replay with
            outcomes.append(outcome)
        return outcomes

    def _info(self, start: float) -> list[Outcome]:
        response = self.http.get(self.rng.choice(["/get_server_info", "/metrics", "/v1/models"]))
        return [Outcome("info", response.status_code, start, self.clock() - start)]

    def _generate(self, kind: str, body: dict[str, Any], stream: bool, start: float, namespace: str | None) -> Outcome:
        """A /generate, streamed or not; greedy ones are kept for replay."""
        if not stream:
            response = self.http.post("/generate", json=body)
            outcome = Outcome(kind, response.status_code, start, self.clock() - start, namespace=namespace)
            answer = response.json() if response.status_code == 200 else None
            outcome.ttft_s = answer["meta_info"]["ttft"] if answer is not None else None  # the server's
        else:
            answer, first = None, None
            with self.http.stream("POST", "/generate", json={**body, "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        first, answer = first or self.clock(), json.loads(line[len("data: "):])
            outcome = Outcome(kind, response.status_code, start, self.clock() - start,
                              None if first is None else first - start, namespace)
            if answer is not None and "error" in answer:
                outcome.status, answer = 500, None  # an error chunk inside a 200 stream is a server error
        if answer is not None:
            outcome.disk_tokens = answer.get("meta_info", {}).get("cached_tokens_by_tier", {}).get("disk", 0)
        if answer is not None and body["sampling_params"].get("temperature") == 0:
            outcome.replay = {"path": "/generate", "body": body, "text": answer["text"]}
        return outcome
