"""The ingress's request loop (``ReplicaLoop``) over a stand-in replica deployment: what the router
believes of a replica's load when the client hears its answer."""
import asyncio
import threading
import time
from types import SimpleNamespace
from typing import Any

from hypic.cluster.ingress import ReplicaLoop
from hypic.cluster.routing import policy_named
from hypic.cluster.state import ClusterState
from hypic.scheduler.jobs import DoneEvent

PROMPT = (5, 6, 7, 8)


class OneReplica:
    """A deployment handle whose run calls all go to replica "r0", routed as Ray Serve's router tells
    the state; the answer's stream closes a while after its last event (as a real one closes a message
    later)."""

    def __init__(self, state: ClusterState, closes_after_s: float) -> None:
        self.state, self.closes_after_s = state, closes_after_s
        self.load_at_call: tuple[int, int] | None = None

    def options(self, method_name: str, stream: bool = False) -> "OneReplica":
        return self

    def remote(self, route: Any, work: Any, *builds: Any) -> Any:
        self.state.routed(route.key, "r0", route.request, route.decode_tokens, "load")
        load = self.state.loads["r0"]
        self.load_at_call = (load.running, load.queued_prefill_tokens)
        return self._answer()

    async def _answer(self) -> Any:
        yield [DoneEvent(SimpleNamespace(text="done"))]
        await asyncio.sleep(self.closes_after_s)


def _job(rid: str) -> Any:
    plan = SimpleNamespace(documents=lambda: [], interior_tokens=lambda index: 0)
    request = SimpleNamespace(stream=False, params=SimpleNamespace(max_new_tokens=4))
    return SimpleNamespace(rid=rid, parts=SimpleNamespace(namespace="", token_ids=list(PROMPT)), plan=plan,
                           request=request, sequences=[None], start=time.perf_counter(), cancelled=threading.Event())


def test_a_requests_load_leaves_its_replica_before_its_client_hears_the_answer() -> None:
    """A client that sends its next request on hearing an answer must find the replica as idle as it is:
    a finished request still counted as queued prefill would send the next one elsewhere (away from its
    documents). While routed, the request counts its whole prompt (nothing held) and one running."""
    state = ClusterState(policy_named("cache_aware"))
    state.set_replicas(["r0"])
    replicas = OneReplica(state, closes_after_s=2.0)

    async def load_when_answered() -> tuple[int, int, int]:
        loop = ReplicaLoop(None, replicas, state, "hypic", None, spreads=False)  # type: ignore[arg-type]
        heard: asyncio.Queue[tuple[int, int, int]] = asyncio.Queue()
        load = state.loads

        def emit(event: Any) -> None:
            r0 = load["r0"]
            heard.put_nowait((r0.running, r0.queued_prefill_tokens, r0.decode_tokens))

        loop.enqueue(_job("q1"), emit)
        return await asyncio.wait_for(heard.get(), 1.0)

    assert asyncio.run(load_when_answered()) == (0, 0, 0)
    assert replicas.load_at_call == (1, len(PROMPT))
