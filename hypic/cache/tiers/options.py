"""The tier settings of a server (``--cache-dir``, ``--disk-cache-size``, ``--mooncake-master``,
``--write-policy``) and the tiers they make."""
from dataclasses import dataclass

from .disk import DiskTier
from .entry_file import EntryIdentity
from .hierarchy import BlobTier, PrefetchPolicy, StorageTiers, WritePolicy

DEFAULT_SEGMENT_BYTES = 1 << 30  # hypic.cache.tiers.mooncake's default, without importing Mooncake


@dataclass(frozen=True)
class TierOptions:
    """Which lower tiers the public pool has (none by default) and when entries are written there."""

    cache_dir: str | None = None  # L3, local: a directory that outlives the server
    disk_bytes: int | None = None  # its budget (None: unbounded)
    mooncake_master: str | None = None  # L3, shared: a Mooncake master's HOST:PORT
    mooncake_metadata: str | None = None  # its metadata server (default: the master's HTTP one)
    mooncake_segment_bytes: int = DEFAULT_SEGMENT_BYTES  # memory this server lends the shared store
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.TIMEOUT

    @property
    def enabled(self) -> bool:
        return self.cache_dir is not None or self.mooncake_master is not None


def build_tiers(options: TierOptions, identity: EntryIdentity) -> StorageTiers | None:
    """The lower tiers ``options`` ask for (None: memory only), opened; one that cannot be opened
    now is reported unhealthy and retried, never fatal."""
    if not options.enabled:
        return None
    tiers: list[BlobTier] = []
    if options.cache_dir is not None:
        tiers.append(DiskTier(options.cache_dir, options.disk_bytes))
    if options.mooncake_master is not None:
        from .mooncake import MooncakeTier  # the package is optional

        tiers.append(MooncakeTier(options.mooncake_master, options.mooncake_metadata, options.mooncake_segment_bytes))
    return StorageTiers(tiers, identity, options.write_policy, options.prefetch_policy)
