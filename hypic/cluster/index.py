"""STUB (replaced by the real index at merge)."""
from dataclasses import dataclass
from enum import IntEnum


class Tier(IntEnum):
    MEMORY = 0
    HOST = 1
    DISK = 2


@dataclass(frozen=True)
class HoldingEvent:
    kind: str
    key: str = ""
    namespace: str | None = ""
    tier: Tier = Tier.MEMORY
    tokens: int = 0


@dataclass(frozen=True)
class Announcement:
    replica: str
    incarnation: str
    seq: int
    events: tuple[HoldingEvent, ...] = ()
    full: bool = False


class DocumentIndex:
    def __init__(self) -> None:
        self.held: dict[str, dict[str, Tier]] = {}
        self.seqs: dict[str, tuple[str, int]] = {}

    def apply(self, a: Announcement) -> bool:
        known = self.seqs.get(a.replica)
        if not a.full and (known is None or known[0] != a.incarnation or a.seq - len(a.events) != known[1]):
            return False
        if a.full:
            self.forget(a.replica)
        for e in a.events:
            if e.kind == "stored":
                self.held.setdefault(e.key, {})[a.replica] = e.tier
            elif e.kind == "evicted":
                self.held.get(e.key, {}).pop(a.replica, None)
        self.seqs[a.replica] = (a.incarnation, a.seq)
        return True

    def holders(self, namespace: str, key: str) -> dict[str, Tier]:
        return dict(self.held.get(key, {}))

    def forget(self, replica: str) -> None:
        for h in self.held.values():
            h.pop(replica, None)
        self.seqs.pop(replica, None)

    def documents_of(self, replica: str) -> int:
        return sum(replica in h for h in self.held.values())

    def record_prefix(self, replica, token_ids, namespace="") -> None:
        pass

    def prefix_matched(self, token_ids, namespace=""):
        return {}
