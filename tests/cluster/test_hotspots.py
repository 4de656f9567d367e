"""Hot documents copied ahead of need: which copies ``HotDocuments`` asks for, on hand-built
clusters, and the ingress making them (the holder sends, the target keeps)."""
import asyncio
from typing import Any

from hypic.cluster.hotspots import Copy, HotDocuments
from hypic.cluster.index import Announcement, DocumentIndex, HoldingEvent, Tier
from hypic.cluster.ingress import ReplicaLoop
from hypic.cluster.routing import ReplicaLoad, RouteRequest, policy_named
from hypic.cluster.state import ClusterState

HOT = RouteRequest("t", (("hot", 500),), 600)
IDS = [(1, 2, 3)]


def cluster(holdings: dict[str, list[tuple[str, Tier]]]) -> DocumentIndex:
    index = DocumentIndex()
    for replica, held in holdings.items():
        events = tuple(HoldingEvent("stored", key, "t", tier, 500) for key, tier in held)
        assert index.apply(Announcement(replica, "i", len(events), events, full=True))
    return index


def busy_r0(**r1: Any) -> list[ReplicaLoad]:
    return [ReplicaLoad("r0", queued_prefill_tokens=9000), ReplicaLoad("r1", **r1), ReplicaLoad("r2", queued_prefill_tokens=3000)]


def test_a_document_asked_often_whose_only_copy_is_on_a_busy_replica_is_copied_to_the_least_busy() -> None:
    """Asked 5 times in a row (heat 4.91 of the threshold 4, the earlier uses halved every 64
    requests), held in memory by r0 alone with 9,000 tokens queued: copied to r1 (0 queued, 9,000
    below r0), not r2 (3,000). Asked 4 times (heat 3.93): not hot yet."""
    hot, index = HotDocuments(), cluster({"r0": [("hot", Tier.MEMORY)], "r1": [], "r2": []})
    for _ in range(4):
        hot.seen(HOT, IDS)
    assert hot.heat_of(("t", "hot")) == sum(0.5 ** (j / 64) for j in range(4)) < 4
    assert hot.copies(busy_r0(), index, now=0.0) == []
    hot.seen(HOT, IDS)
    assert hot.copies(busy_r0(), index, now=0.0) == [Copy("hot", "t", (1, 2, 3), "r0", "r1")]
    assert hot.copies(busy_r0(), index, now=10.0) == []  # asked already: its copy may not be announced yet
    assert hot.copies(busy_r0(), index, now=31.0) == [Copy("hot", "t", (1, 2, 3), "r0", "r1")]


def test_no_copy_when_a_second_copy_exists_the_holder_is_not_far_busier_or_the_target_pool_is_full() -> None:
    hot = HotDocuments()
    for _ in range(6):
        hot.seen(HOT, IDS)
    two = cluster({"r0": [("hot", Tier.MEMORY)], "r1": [], "r2": [("hot", Tier.MEMORY)]})
    assert hot.copies(busy_r0(), two, now=0.0) == []
    one = cluster({"r0": [("hot", Tier.MEMORY)], "r1": [], "r2": []})
    close = [ReplicaLoad("r0", queued_prefill_tokens=9000), ReplicaLoad("r1", queued_prefill_tokens=6000),
             ReplicaLoad("r2", queued_prefill_tokens=5000)]
    assert hot.copies(close, one, now=0.0) == []  # 4,000 below r0 at best
    full = [ReplicaLoad("r0", queued_prefill_tokens=9000), ReplicaLoad("r1", pool_fill=0.95),
            ReplicaLoad("r2", pool_fill=0.95)]
    assert hot.copies(full, one, now=0.0) == []


def test_a_document_no_longer_asked_cools_down_and_is_forgotten() -> None:
    """Heat halves every 64 requests: 6 uses (5.8), then 64 requests for other documents leave 2.9."""
    hot, index = HotDocuments(), cluster({"r0": [("hot", Tier.MEMORY)], "r1": [], "r2": []})
    for _ in range(6):
        hot.seen(HOT, IDS)
    for n in range(64):
        hot.seen(RouteRequest("t", ((f"other{n}", 500),), 600), [(9,)])
    assert abs(hot.heat_of(("t", "hot")) - 0.5 * sum(0.5 ** (j / 64) for j in range(6))) < 1e-9
    assert hot.copies(busy_r0(), index, now=0.0) == [] and ("t", "hot") not in hot.hot


class CopyingReplicas:
    """A handle over stand-in replicas answering ``build`` (the holder's entries) and ``keep_copies``
    (the keys kept), recording each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.method = ""

    def options(self, method_name: str, stream: bool = False) -> Any:
        self.method = method_name
        return self

    def remote(self, route: Any, *args: Any) -> Any:
        self.calls.append((self.method, route.replica, args))
        return self._build(args[0]) if self.method == "build" else self._keep(args[0])

    async def _build(self, jobs: list) -> list:
        return [f"entry of {job.key}" for job in jobs]

    async def _keep(self, sent: Any) -> list[str]:
        entries = await sent  # Ray Serve hands the target the holder's answer
        return [entry.removeprefix("entry of ") for entry in entries]


def test_the_ingress_has_the_holder_send_the_hot_document_and_the_target_keep_it() -> None:
    state = ClusterState(policy_named("cache_aware"))
    state.set_replicas(["r0", "r1", "r2"])
    assert state.announce(Announcement("r0", "i", 1, (HoldingEvent("stored", "hot", "t", Tier.MEMORY, 500),), full=True))
    state.loads["r0"] = ReplicaLoad("r0", queued_prefill_tokens=9000)
    state.loads["r2"] = ReplicaLoad("r2", queued_prefill_tokens=3000)
    replicas = CopyingReplicas()
    loop = ReplicaLoop(None, replicas, state, "hypic", None, spreads=False)  # type: ignore[arg-type]
    for _ in range(5):
        loop.hot.seen(HOT, IDS)

    async def run() -> None:
        loop.running = asyncio.get_running_loop()
        await asyncio.gather(*loop.copy_hot_documents())

    asyncio.run(run())
    assert [(method, replica) for method, replica, _ in replicas.calls] == [("build", "r0"), ("keep_copies", "r1")]
    [job] = replicas.calls[0][2][0]
    assert (job.key, job.token_ids, job.namespace) == ("hot", (1, 2, 3), "t")
    assert state.counters["documents_copied"] == 1
