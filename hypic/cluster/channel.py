"""The ingress's side of the holdings streams: one follower per replica, which reads that replica's
stream into the index, reopens it from where it left off after a fault (the replica replays the
missing range), asks for a dump only when the index cannot take what comes (a stream that does not
follow on), and stops when the replica is gone."""
import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from .holdings import HoldingsMark
from .index import Announcement
from .state import ClusterState

log = logging.getLogger("hypic.cluster")
SILENCE_S = 10.0  # a holdings stream silent this long (keepalives come every 2 s) is reopened
REOPEN_S = 0.5  # the pause before a failed stream is reopened
CATCH_UP_POLL_S = 0.005

OpenStream = Callable[[str, tuple[str, int] | None], Any]  # (replica, after) -> its stream of announcements


class HoldingsChannel:
    """Follows the holdings stream of every replica ``state`` lists. ``open_stream(replica, after)``
    starts one replica's stream after (incarnation, seq) (None: from a dump)."""

    def __init__(self, state: ClusterState, open_stream: OpenStream, silence_s: float = SILENCE_S) -> None:
        self.state, self.open_stream, self.silence_s = state, open_stream, silence_s
        self.followers: dict[str, asyncio.Task] = {}
        self.applied: dict[str, tuple[str, int]] = {}  # replica -> (incarnation, seq) its index is at
        self.dumps = 0  # streams opened for a dump (new followers, and those the index could not follow)

    def sync(self) -> None:
        """Follow each replica the state lists (on the running event loop); stop following those gone."""
        with self.state.lock:
            live = set(self.state.replicas)
        for replica in sorted(r for r in live if r not in self.followers or self.followers[r].done()):
            self.followers[replica] = asyncio.get_running_loop().create_task(self._follow(replica))
        for replica in sorted(self.followers.keys() - live):
            self.followers.pop(replica).cancel()
            self.applied.pop(replica, None)

    def close(self) -> None:
        for task in self.followers.values():
            task.cancel()
        self.followers.clear()

    async def _follow(self, replica: str) -> None:
        after: tuple[str, int] | None = None
        while True:
            try:
                await self._read(replica, after)
                after = None  # the index could not follow on: a dump next
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - reopened from where it left off
                if replica not in self.state.replicas:
                    return  # it died: the router's news of it stops this follower
                after = self.applied.get(replica)
                log.warning("holdings stream of replica %s failed (%s: %s); reopened after event %s", replica,
                            type(err).__name__, str(err).splitlines()[0] if str(err) else "", after[1] if after else "0 (a dump)")
                await asyncio.sleep(REOPEN_S)

    async def _read(self, replica: str, after: tuple[str, int] | None) -> None:
        """Apply one opening of ``replica``'s stream (from ``after``; None: a dump first) until it
        fails, or sends what the index cannot follow on from (then it returns)."""
        self.dumps += after is None
        stream = self.open_stream(replica, after)
        try:
            async for told in _within(stream, self.silence_s, replica):
                if not self.state.announce(told):
                    log.warning("replica %s's holdings do not follow on from the index's: a dump is asked for", replica)
                    return
                self.applied[replica] = (told.incarnation, told.seq)
        finally:
            stream.cancel()

    def has(self, mark: HoldingsMark) -> bool:
        """Whether the index has applied ``mark``'s replica's stream up to it."""
        applied = self.applied.get(mark.replica)
        return applied is not None and applied[0] == mark.incarnation and applied[1] >= mark.seq

    async def caught_up(self, mark: HoldingsMark, within_s: float) -> bool:
        """Wait (at most ``within_s``) until the index has applied ``mark``; whether it has."""
        deadline = time.monotonic() + within_s
        while not self.has(mark):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(CATCH_UP_POLL_S)
        return True

    async def heard_from_all(self, within_s: float) -> None:
        """Wait until every replica's stream has been applied once (the index knows what each holds)."""
        deadline = time.monotonic() + within_s
        while missing := sorted(set(self.state.replicas) - self.applied.keys()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no holdings from replica(s) {', '.join(missing)} in {within_s:g} s")
            await asyncio.sleep(CATCH_UP_POLL_S)


async def _within(stream: Any, silence_s: float, replica: str) -> AsyncIterator[Announcement]:
    """``stream``'s messages, each within ``silence_s`` of the last, else ``TimeoutError``."""
    messages = stream.__aiter__()
    while True:
        try:
            yield await asyncio.wait_for(messages.__anext__(), silence_s)
        except StopAsyncIteration:
            raise ConnectionError(f"replica {replica} ended its holdings stream") from None
        except TimeoutError:
            raise TimeoutError(f"replica {replica} sent no holdings in {silence_s:g} s") from None
