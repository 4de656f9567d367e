"""The ingress's holdings channel over replicas' logs (``HoldingsLog``, as a replica runs it): what
the index holds after streams that fail, deliver out of order or fall silent, replicas that leave,
and the bounds on what the index keeps. The oracle is each log's own record of what it holds (the
cache's stores and drops, made here by hand)."""
import asyncio
from collections.abc import AsyncIterator
from typing import Any

from hypic.cluster.channel import HoldingsChannel
from hypic.cluster.holdings import HoldingsLog, HoldingsMark
from hypic.cluster.index import Announcement, DocumentIndex, HoldingEvent, Tier
from hypic.cluster.routing import policy_named
from hypic.cluster.state import ClusterState

from .test_request_life import Stream  # a streamed call as the ingress reads it


class Replicas:
    """Stand-in replicas, each a ``HoldingsLog``; ``faults`` (replica -> a script) replace the next
    opening of that replica's stream."""

    def __init__(self, names: list[str]) -> None:
        self.logs = {name: HoldingsLog(name, lambda: 0.25, capacity=64) for name in names}
        self.opened: list[tuple[str, tuple[str, int] | None]] = []
        self.streams: list[Stream] = []
        self.faults: dict[str, Any] = {}

    def open(self, replica: str, after: tuple[str, int] | None) -> Stream:
        self.opened.append((replica, after))
        fault = self.faults.pop(replica, None)
        stream = Stream(fault(self.logs[replica], after) if fault else self.logs[replica].follow(after, 0.05))
        self.streams.append(stream)
        return stream


def _channel(names: list[str]) -> tuple[ClusterState, Replicas, HoldingsChannel]:
    state = ClusterState(policy_named("cache_aware"))
    state.set_replicas(names)
    replicas = Replicas(names)
    return state, replicas, HoldingsChannel(state, replicas.open, silence_s=0.5)


def _store(log: HoldingsLog, *keys: str, namespace: str = "") -> None:
    for key in keys:
        log.stored(key, namespace, "device", 10)


def _believed(state: ClusterState, replicas: Replicas) -> dict[str, set[str]]:
    keys = {key for log in replicas.logs.values() for key in log.held} | {f"d{i}" for i in range(40)}
    return {name: {key for key in keys if name in state.index.holders("", key)} for name in replicas.logs}


def _truth(replicas: Replicas) -> dict[str, set[str]]:
    return {name: set(log.held) for name, log in replicas.logs.items()}


async def _settle(channel: HoldingsChannel, replicas: Replicas) -> None:
    for name, log in replicas.logs.items():
        assert await channel.caught_up(log.mark(), 2.0), name


def test_a_failed_stream_is_reopened_where_it_left_off_and_the_gap_replayed() -> None:
    """r0's stream dies after its first message; meanwhile r0 stores more: the reopened stream starts
    after the last event applied and replays the rest; one dump in all (the first opening's)."""

    async def dies_after_one(log: HoldingsLog, after: Any) -> AsyncIterator[Announcement]:
        yield log.since(after)
        _store(log, "d3", "d4")
        raise ConnectionError("the replica's stream broke")

    async def run() -> None:
        state, replicas, channel = _channel(["r0"])
        _store(replicas.logs["r0"], "d1", "d2")
        replicas.faults["r0"] = dies_after_one
        channel.sync()
        assert await channel.caught_up(HoldingsMark("r0", replicas.logs["r0"].incarnation, 4), 2.0)
        assert _believed(state, replicas) == _truth(replicas) == {"r0": {"d1", "d2", "d3", "d4"}}
        assert replicas.opened[1] == ("r0", (replicas.logs["r0"].incarnation, 2)) and channel.dumps == 1
        channel.close()

    asyncio.run(run())


def test_five_batches_out_of_order_cost_one_dump() -> None:
    """A stream that delivers five batches out of order: the first that does not follow on makes the
    channel ask for one dump (the others are never read); the index is then right."""

    async def out_of_order(log: HoldingsLog, after: Any) -> AsyncIterator[Announcement]:
        yield log.since(None)
        for seq in (9, 7, 12, 8, 11):  # far ahead of the dump's seq: none follows on
            yield Announcement(log.replica, log.incarnation, seq, (HoldingEvent("stored", f"d{seq}"),))

    async def run() -> None:
        state, replicas, channel = _channel(["r0"])
        _store(replicas.logs["r0"], "d1")
        replicas.faults["r0"] = out_of_order
        channel.sync()
        await asyncio.sleep(0.05)
        _store(replicas.logs["r0"], "d2")
        await _settle(channel, replicas)
        assert [after for _, after in replicas.opened] == [None, None] and channel.dumps == 2
        assert _believed(state, replicas) == _truth(replicas) == {"r0": {"d1", "d2"}}
        channel.close()

    asyncio.run(run())


def test_a_silent_stream_is_reopened_within_its_deadline() -> None:
    async def silent(log: HoldingsLog, after: Any) -> AsyncIterator[Announcement]:
        yield log.since(after)
        await asyncio.sleep(3600)
        yield log.since(after)

    async def run() -> None:
        state, replicas, channel = _channel(["r0"])
        replicas.faults["r0"] = silent
        channel.sync()
        await asyncio.sleep(0.05)
        _store(replicas.logs["r0"], "d5")
        assert await channel.caught_up(replicas.logs["r0"].mark(), 2.0)  # silence_s 0.5, reopen 0.5
        assert len(replicas.opened) == 2 and replicas.streams[0].cancelled
        assert _believed(state, replicas) == {"r0": {"d5"}}
        channel.close()

    asyncio.run(run())


def test_the_index_follows_replicas_that_come_and_go() -> None:
    """r1 leaves: its follower stops and its stream is cancelled, its holdings leave the index; r2
    joins and is followed from a dump of what it already holds."""

    async def run() -> None:
        state, replicas, channel = _channel(["r0", "r1"])
        replicas.logs["r2"] = HoldingsLog("r2", lambda: 0.0)
        _store(replicas.logs["r1"], "d1")
        _store(replicas.logs["r2"], "d2")
        channel.sync()
        await channel.heard_from_all(2.0)
        state.set_replicas(["r0", "r2"])
        channel.sync()
        assert await channel.caught_up(replicas.logs["r2"].mark(), 2.0)
        await asyncio.sleep(0)
        assert sorted(channel.followers) == ["r0", "r2"] and replicas.streams[1].cancelled
        assert state.index.holders("", "d1") == {} and state.index.holders("", "d2") == {"r2": Tier.MEMORY}
        channel.close()

    asyncio.run(run())


def test_an_answer_waits_until_its_replicas_holdings_are_in_the_index() -> None:
    async def run() -> None:
        state, replicas, channel = _channel(["r0"])
        channel.sync()
        log = replicas.logs["r0"]
        _store(log, "d7")
        mark = log.mark()
        assert not channel.has(mark)
        assert await channel.caught_up(mark, 2.0) and state.index.holders("", "d7") == {"r0": Tier.MEMORY}
        ahead = HoldingsMark("r0", log.incarnation, log.seq + 1)  # an event never made
        assert not await channel.caught_up(ahead, 0.1)
        channel.close()

    asyncio.run(run())


def test_a_stale_dump_after_a_newer_batch_is_not_applied() -> None:
    index = DocumentIndex()
    assert index.apply(Announcement("a", "i", 1, (HoldingEvent("stored", "old"),), full=True))
    assert index.apply(Announcement("a", "i", 3, (HoldingEvent("evicted", "old"), HoldingEvent("stored", "new"))))
    assert index.apply(Announcement("a", "i", 1, (HoldingEvent("stored", "old"),), full=True))  # late: ignored
    assert index.holders("", "new") == {"a": Tier.MEMORY} and index.holders("", "old") == {}
    assert index.apply(Announcement("a", "j", 1, (HoldingEvent("stored", "old"),), full=True))  # a new process: applied
    assert index.holders("", "old") == {"a": Tier.MEMORY} and index.holders("", "new") == {}


def test_namespaces_left_empty_are_forgotten() -> None:
    """20,000 client-named namespaces, each with one entry, come and go (evicted, or cleared): none
    is left in the index, and the ids of the forgotten are reused (the index does not grow)."""
    index = DocumentIndex()
    index.apply(Announcement("a", "i", 0, (), full=True))
    seq = 0
    for round_ in range(2):
        for n in range(10_000):
            namespace = f"tenant-{round_}-{n}"
            gone = HoldingEvent("evicted", f"k{n}", namespace) if n % 2 else HoldingEvent("cleared", namespace=namespace)
            index.apply(Announcement("a", "i", seq + 2, (HoldingEvent("stored", f"k{n}", namespace), gone)))
            seq += 2
    assert index.namespaces() == 0 and index.documents() == 0
    assert len(index._namespace_names) <= 1
    index.apply(Announcement("a", "i", seq + 1, (HoldingEvent("stored", "k", "t"),)))
    assert index.namespace_holders("t") == {"a": 1} and index.holders("t", "k") == {"a": Tier.MEMORY}


def test_a_replica_that_leaves_and_comes_back_is_followed_again() -> None:
    """The router may list a replica, drop it and list it again: its follower, which stopped when it
    left, starts again, and what it stores meanwhile reaches the index."""

    left = asyncio.Event()

    async def dies_once_gone(log: HoldingsLog, after: Any) -> AsyncIterator[Announcement]:
        yield log.since(after)
        await left.wait()
        raise ConnectionError("the replica's stream broke")

    async def run() -> None:
        state, replicas, channel = _channel(["r0"])
        replicas.faults["r0"] = dies_once_gone
        channel.sync()
        await channel.heard_from_all(2.0)
        state.set_replicas([])  # gone, and its stream fails: the follower stops
        left.set()
        await asyncio.sleep(0.1)
        assert channel.followers["r0"].done()
        state.set_replicas(["r0"])
        _store(replicas.logs["r0"], "d9")
        channel.sync()
        assert await channel.caught_up(replicas.logs["r0"].mark(), 2.0)
        assert state.index.holders("", "d9") == {"r0": Tier.MEMORY}
        channel.close()

    asyncio.run(run())
