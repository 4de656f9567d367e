"""Flushes that do not stop the engine loop: memory is emptied on the loop thread between two of its
steps (quick), the tiers below memory on a thread of their own (a disk's files, a Mooncake store:
slow), while decoding goes on; until that is done no request of the namespace being flushed starts."""
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..cache.hybrid_cache import HybridCache
from .jobs import Command


class BackgroundFlushes:
    """``post``: hands a command to the loop thread (the flush's end is taken there)."""

    def __init__(self, cache: HybridCache, post: Callable[[Command], None]) -> None:
        self.cache, self.post = cache, post
        self.namespaces: list[str | None] = []  # being flushed below memory (None: every namespace)

    def holds(self, namespace: str) -> bool:
        """Whether a request of ``namespace`` must wait (its entries are being deleted below memory)."""
        return None in self.namespaces or namespace in self.namespaces

    def start(self, namespace: str | None, tiers: frozenset[str], flushed: Future) -> None:
        """On the loop thread: empty memory now, and start on the tiers below; ``flushed`` gets the counts
        (public entries, private-pool nodes, entries per tier below) or the error."""
        try:
            public, private = self.cache.flush_memory(namespace) if "memory" in tiers else (0, 0)
        except Exception as err:  # noqa: BLE001 - handed to the flush's caller
            flushed.set_exception(err)
            return
        if not tiers - {"memory"}:
            flushed.set_result((public, private, {}))
            return
        self.namespaces.append(namespace)

        def below() -> None:
            try:
                outcome: Any = (public, private, self.cache.flush_below(namespace, tiers))
            except Exception as err:  # noqa: BLE001 - handed to the flush's caller
                outcome = err
            self.post(Command(lambda: self._done(namespace, flushed, outcome)))
        threading.Thread(target=below, name="hypic-flush", daemon=True).start()

    def _done(self, namespace: str | None, flushed: Future, outcome: Any) -> None:
        """On the loop thread: requests of ``namespace`` may start again; the caller hears."""
        self.namespaces.remove(namespace)
        if isinstance(outcome, Exception):
            flushed.set_exception(outcome)
        else:
            flushed.set_result(outcome)
