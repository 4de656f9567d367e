"""The tier settings of a server (``--host-cache-size``, ``--cache-dir``, ``--disk-cache-size``,
``--mooncake-master``, ``--write-policy``) and the tiers they make."""
from dataclasses import dataclass

from .disk import DiskTier
from .entry_file import EntryIdentity
from ..store import LowerTiers
from .hierarchy import BlobTier, PrefetchPolicy, StorageTiers, WritePolicy
from .host import HostTier
from .mooncake import DEFAULT_SEGMENT_BYTES, MooncakeTier  # the mooncake package itself is imported on first use
from .resume import ResumeStore
from .shared_resume import SharedResumePoints


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
    host_bytes: int | None = None  # L2: host memory below a GPU's pool (None: none)

    @property
    def storage(self) -> bool:
        """Whether any storage tier (disk, Mooncake) is asked for."""
        return self.cache_dir is not None or self.mooncake_master is not None

    @property
    def enabled(self) -> bool:
        return self.storage or self.host_bytes is not None


@dataclass(frozen=True)
class Tiers:
    """What ``build_tiers`` makes: the public pool's lower tiers, and the private pool's resume
    points in the disk tier and Mooncake (None: neither)."""

    public: LowerTiers | None = None
    resume: ResumeStore | None = None


def build_tiers(options: TierOptions, identity: EntryIdentity) -> Tiers:
    """The tiers ``options`` ask for, opened; one that cannot be opened now is reported unhealthy and
    retried, never fatal. Below the public pool host memory (L2) comes first, then the disk, then
    Mooncake; the private pool keeps its resume points on the disk (sharing its budget) and in
    Mooncake (beside the public pool's entries)."""
    disk = DiskTier(options.cache_dir, options.disk_bytes) if options.cache_dir is not None else None
    storage = build_storage(options, identity, disk) if options.storage else None
    public = storage if options.host_bytes is None else HostTier(options.host_bytes, identity.device, storage)
    shared = next((SharedResumePoints(tier, storage) for tier in storage.tiers if tier.name == "mooncake"),
                  None) if storage is not None else None
    resume = ResumeStore(disk, identity, shared, options.write_policy) if disk is not None or shared is not None else None
    return Tiers(public, resume)


def build_storage(options: TierOptions, identity: EntryIdentity, disk: DiskTier | None = None) -> StorageTiers:
    """The storage tiers (``disk``, then Mooncake) ``options`` ask for."""
    tiers: list[BlobTier] = []
    if disk is not None:
        tiers.append(disk)
    if options.mooncake_master is not None:
        tiers.append(MooncakeTier(options.mooncake_master, options.mooncake_metadata, options.mooncake_segment_bytes))
    return StorageTiers(tiers, identity, options.write_policy, options.prefetch_policy)
