"""Load time of one stored document's entry at Qwen3.5-35B-A3B's shapes: before and after, one run.

The entry is the one ``hypic eval tiers`` loads (1k tokens: 30 Gated DeltaNet layers' dense T_C and
S_C|0 in fp32, 10 attention layers' KV in bf16, 141 MB). Every way is timed ``--repeats`` times
after one warm-up, the ways interleaved within each repeat so that other work on the machine weighs
on all of them alike. Two comparisons (``--compare``):

**pool** (the default): a hit loaded into the public pool, ``SegmentStore.fetch`` until the entry is
resident in the pool's slots (what a request waits for):

- **before** (``DecodedThenPlaced`` below, the baseline): the load path as it was, decoded into
  tensors of its own (one pass: copy and XXH3-128 a chunk at a time), then each linear layer's T_C
  and S_C|0 copied again into a slot of the pool's arenas as the pool stores it.
- **after** (``hypic.cache`` as it is): the storage tiers decode each linear layer's T_C and S_C|0
  straight into a slot taken before the copy; the pool stores the entry without another copy.

**format**: from the tier's read to a decoded, checked entry (what ``StorageTiers`` did on a hit):

- **before** (``legacy_*`` below, copied from the code as it was at commit 225229d and kept here
  as the baseline): format ``hypic-segment-entry/1``, each tensor copied out of the memory map into
  a ``bytearray``, then a SHA-256 over every tensor; Mooncake read with ``is_exist`` + ``get`` (the
  object returned as a new ``bytes``).
- **after** (``hypic.cache.tiers`` as it is): the current format, one pass that copies each tensor
  straight into its own tensor a chunk at a time and hashes the chunk just copied (XXH3-128);
  Mooncake read with ``get_size`` + ``batch_get_into`` into a registered buffer kept between reads.

Disk: the file in the page cache, and dropped from it first (``posix_fadvise(DONTNEED)``; the disk
is whatever backs the working directory). Mooncake (``--mooncake``): a ``mooncake_master`` started
here on loopback, TCP transport. Every way's entry is compared with the original, tensor by tensor,
before the timings. Writes ``OUT/NAME.json`` (every timing with this thread's CPU time and page
faults, the machine, its load average and CPU pressure before and after) and prints the medians.

    taskset -c 1 python eval/bench_entry_load.py --mooncake --out eval/results/entry_load --name slots_run1
"""
import argparse
import contextlib
import hashlib
import json
import mmap
import os
import platform
import resource
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from hypic.cache.entry_check import EntryMismatch, check_entry
from hypic.cache.store import Role, SegmentEntry, SegmentStore, entry_tensors
from hypic.cache.tiers import entry_file
from hypic.cache.tiers.disk import DiskTier
from hypic.cache.tiers.entry_file import EntryIdentity, decode_entry, encode_entry
from hypic.cache.tiers.hierarchy import BlobTier, StorageTiers, WritePolicy
from hypic.evaluation.tiers import _qwen35_entry
from hypic.server.launch import free_port

# ----- before: the entry file code as it was (commit 225229d), the baseline -------------------
LEGACY_FORMAT = "hypic-segment-entry/1"


def legacy_checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(entry_file._raw(tensors[name]))
    return digest.hexdigest()


def legacy_encode(entry: SegmentEntry, identity: EntryIdentity) -> bytes:
    """The old file: the new encoder's header with the old format name and a SHA-256 of the tensors."""
    data = encode_entry(entry, identity)
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    tensors = entry_file.unpack(data)[1]
    meta = header["__metadata__"]
    meta["format"], meta["checksum"] = LEGACY_FORMAT, legacy_checksum(tensors)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + data[8 + size:]


def legacy_tensors(buffer: bytes | memoryview, header: dict, start: int) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, end = (start + int(o) for o in spec["data_offsets"])
            dtype, shape = entry_file._DTYPES[spec["dtype"]], [int(s) for s in spec["shape"]]
        except (KeyError, TypeError, ValueError) as err:
            raise entry_file.BadEntryFile(f"tensor {name}: unreadable spec") from err
        if end > len(buffer) or begin > end:
            raise entry_file.BadEntryFile(f"truncated: tensor {name} ends at byte {end} of {len(buffer)}")
        data = bytearray(buffer[begin:end])
        flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        if flat.numel() != dtype.itemsize * torch.Size(shape).numel():
            raise entry_file.BadEntryFile(f"tensor {name}: {flat.numel()} bytes for shape {shape}")
        tensors[name] = flat.view(dtype).reshape(shape)
    return tensors


def legacy_check_identity(meta: dict, identity: EntryIdentity, key: str, token_ids: tuple[int, ...]) -> None:
    expected = {"format": LEGACY_FORMAT, "key": key, "fingerprint": identity.fingerprint,
                "model_dtype": str(identity.model_dtype), "state_dtype": str(identity.state_dtype)}
    for name, value in expected.items():
        if meta.get(name) != value:
            raise entry_file.BadEntryFile(f"{name} is {meta.get(name)!r}, expected {value!r}")
    if meta.get("token_ids") != json.dumps(list(token_ids)):
        raise entry_file.BadEntryFile("the file holds another document's tokens")


def legacy_decode(buffer: bytes | memoryview, identity: EntryIdentity, key: str, token_ids: tuple[int, ...]) -> SegmentEntry:
    header, start = entry_file._header(buffer)
    meta = header.get("__metadata__", {})
    legacy_check_identity(meta, identity, key, token_ids)
    tensors = legacy_tensors(buffer, header, start)
    if legacy_checksum(tensors) != meta.get("checksum"):
        raise entry_file.BadEntryFile("checksum mismatch: the file is damaged")
    tensors = {name: t.to(identity.device) for name, t in tensors.items()}
    try:
        entry = entry_file._entry(meta, tensors, token_ids)
        check_entry(entry, identity.fingerprint, Role(meta["role"]), identity.config)
    except (EntryMismatch, KeyError, ValueError) as err:
        raise entry_file.BadEntryFile(f"not an entry this model can splice: {err}") from err
    return entry


@contextlib.contextmanager
def legacy_mapped(path: Path) -> Iterator[memoryview]:
    with path.open("rb") as handle:
        mapped = mmap.mmap(handle.fileno(), os.fstat(handle.fileno()).st_size, access=mmap.ACCESS_READ)
        view = memoryview(mapped)
        try:
            yield view
        finally:
            view.release()
            mapped.close()


@contextlib.contextmanager
def legacy_mooncake_reading(tier, address: str) -> Iterator[bytes | None]:
    from hypic.cache.tiers.mooncake import PREFIX

    data = tier.client.get(PREFIX + address) if tier.client.is_exist(PREFIX + address) == 1 else b""
    yield data if data else None


# ----- the measurement ------------------------------------------------------------------------
Way = Callable[[], SegmentEntry]


def _dropped(path: Path) -> None:
    with path.open("rb") as handle:
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def disk_ways(folder: Path, entry: SegmentEntry, identity: EntryIdentity) -> dict[str, Way]:
    """Both codes' loads from the disk tier, with the file in the page cache and dropped from it."""
    disk = DiskTier(folder)
    disk.open()
    address = identity.address(entry.key, "")
    disk.write(address, encode_entry(entry, identity))
    legacy_path = folder / "legacy.safetensors"
    legacy_path.write_bytes(legacy_encode(entry, identity))

    def after(drop: bool) -> SegmentEntry:
        if drop:
            _dropped(disk.path(address))
        with disk.reading(address) as buffer:
            return decode_entry(buffer, identity, entry.key, entry.token_ids)

    def before(drop: bool) -> SegmentEntry:
        if drop:
            _dropped(legacy_path)
        with legacy_mapped(legacy_path) as buffer:
            return legacy_decode(buffer, identity, entry.key, entry.token_ids)

    return {"disk, page cache | before": lambda: before(False), "disk, page cache | after": lambda: after(False),
            "disk, dropped | before": lambda: before(True), "disk, dropped | after": lambda: after(True)}


def _connected_tier(master) -> Any:
    from hypic.cache.tiers.mooncake import MooncakeTier

    tier = MooncakeTier(master.address, master.metadata_server, 512 << 20, 512 << 20)
    with contextlib.suppress(ConnectionError):
        tier.open()
    deadline = time.monotonic() + 60
    while tier.client is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if tier.client is None:
        raise RuntimeError(f"no connection to the Mooncake master: {tier.error}")
    return tier


def mooncake_ways(tier, entry: SegmentEntry, identity: EntryIdentity) -> dict[str, Way]:
    """Both codes' loads from Mooncake (each its own object: the old file and the new one)."""
    address = identity.address(entry.key, "")
    tier.write(address, encode_entry(entry, identity))
    tier.write(address + "-legacy", legacy_encode(entry, identity))

    def after() -> SegmentEntry:
        with tier.reading(address) as buffer:
            return decode_entry(buffer, identity, entry.key, entry.token_ids)

    def before() -> SegmentEntry:
        with legacy_mooncake_reading(tier, address + "-legacy") as buffer:
            return legacy_decode(buffer, identity, entry.key, entry.token_ids)

    return {"mooncake | before": before, "mooncake | after": after}


# ----- into the pool: decode then place (before) against straight into the slots (after) --------
class DecodedThenPlaced(StorageTiers):
    """before, as the load path was until loads went straight into the pool: the tiers keep no hold
    on the pool's slots, so a hit is decoded into tensors of its own, and the pool then copies each
    linear layer's T_C and S_C|0 into a slot as it stores the entry (``SegmentStore._placed``)."""

    def place_loads_in(self, arenas) -> None:
        pass


def pool_way(tiers: StorageTiers, entry: SegmentEntry, dropped: Path | None = None) -> Way:
    """A hit of ``tiers`` through a pool of its own: ``fetch`` until the entry is resident in the pool's
    slots. The pool forgets it before the clock stops (the returned entry still holds its slots), so
    the next call loads it again; its slots go back once the caller drops it."""
    store = SegmentStore(lower=tiers)

    def load() -> SegmentEntry:
        if dropped is not None:
            _dropped(dropped)
        loaded, tier = store.fetch(entry.key, entry.token_ids)
        if loaded is None or store.entries.get(entry.key) is not loaded:
            raise AssertionError(f"{tier or 'no tier'}: the entry is not resident in the pool")
        store.clear()
        return loaded

    return load


def pool_ways(tier: BlobTier, label: str, entry: SegmentEntry, identity: EntryIdentity,
              dropped: Path | None = None) -> dict[str, Way]:
    """Loads into the public pool from ``tier``: decode, then place (before); straight into the slots (after)."""
    kinds = {"before": DecodedThenPlaced, "after": StorageTiers}
    return {f"{label} | {name}": pool_way(kind([tier], identity, WritePolicy.WRITE_BACK), entry, dropped)
            for name, kind in kinds.items()}


def all_pool_ways(folder: Path, entry: SegmentEntry, identity: EntryIdentity, mooncake_tier) -> dict[str, Way]:
    """Into the pool from the disk (page cache, dropped) and from Mooncake (if given)."""
    disk = DiskTier(folder)
    disk.open()
    address = identity.address(entry.key, "")
    disk.write(address, encode_entry(entry, identity))
    ways = pool_ways(disk, "pool <- disk, page cache", entry, identity)
    ways |= pool_ways(disk, "pool <- disk, dropped", entry, identity, dropped=disk.path(address))
    if mooncake_tier is not None:
        mooncake_tier.write(address, encode_entry(entry, identity))
        _readable(mooncake_tier, address)
        ways |= pool_ways(mooncake_tier, "pool <- mooncake", entry, identity)
    return ways


def _readable(tier, address: str, timeout_s: float = 30.0) -> None:
    """Wait until Mooncake serves a read of ``address`` just put (a loaded master answered one such
    read with an error code, which takes the tier out of use for seconds)."""
    from hypic.cache.tiers.mooncake import MooncakeUnavailable

    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(MooncakeUnavailable), tier.reading(address) as buffer:
            if buffer is not None:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"Mooncake does not serve {address} {timeout_s:.0f} s after its put")
        time.sleep(0.2)


def intact(loaded: SegmentEntry, entry: SegmentEntry) -> bool:
    pairs = list(zip(entry_tensors(loaded), entry_tensors(entry), strict=True))
    return all(a.dtype == b.dtype and torch.equal(a, b) for a, b in pairs)


def timed(way: Way) -> dict[str, float]:
    """Wall seconds to a loaded entry, this thread's CPU seconds in it, and the page faults it took (new
    memory: the kernel zeroes each page); the entry's memory is given back after the clock stops,
    as a server keeps it."""
    faults, cpu, start = _faults(), time.thread_time(), time.perf_counter()
    loaded = way()
    seconds, cpu, faults = time.perf_counter() - start, time.thread_time() - cpu, _faults() - faults
    del loaded
    return {"seconds": seconds, "cpu_seconds": cpu, "page_faults": faults}


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt + resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def measure(ways: dict[str, Way], entry: SegmentEntry, repeats: int) -> dict[str, list[dict[str, float]]]:
    """``repeats`` timings of every way, interleaved, after one untimed load each that is checked
    against ``entry``."""
    for name, way in ways.items():
        if not intact(way(), entry):
            raise AssertionError(f"{name}: the loaded entry differs from the stored one")
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, way in ways.items():
            runs[name].append(timed(way))
    return runs


@contextlib.contextmanager
def mooncake_master(enabled: bool, folder: Path) -> Iterator[Any]:
    if not enabled:
        yield None
        return
    from hypic.cache.tiers.mooncake import start_master

    master = start_master(folder / "mooncake_master.log", free_port(), free_port(), free_port(), lease_ms=200)
    try:
        yield master
    finally:
        master.stop()


# ----- the machine and the report ---------------------------------------------------------------
def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    versions = {}
    for package in ("torch", "numpy", "xxhash", "mooncake-transfer-engine-non-cuda"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return {"cpu": model, "cores": os.cpu_count(), "isa": [f for f in ("avx2", "avx512f", "avx512_bf16", "sha_ni") if f in flags],
            "python": platform.python_version(), "packages": versions, "torch_threads": torch.get_num_threads(),
            "cpu_affinity": sorted(os.sched_getaffinity(0))}


def summary(runs: dict[str, list[dict[str, float]]], file_bytes: int) -> dict[str, dict[str, float]]:
    rows = {}
    for name, timings in runs.items():
        median = statistics.median(t["seconds"] for t in timings)
        rows[name] = {"median_ms": 1000 * median, "min_ms": 1000 * min(t["seconds"] for t in timings),
                      "gb_per_s": file_bytes / median / 1e9,
                      "median_cpu_ms": 1000 * statistics.median(t["cpu_seconds"] for t in timings),
                      "median_page_faults": statistics.median(t["page_faults"] for t in timings)}
    for name in runs:
        if name.endswith("| after") and name.replace("after", "before") in runs:
            rows[name]["speedup"] = rows[name.replace("after", "before")]["median_ms"] / rows[name]["median_ms"]
    return rows


def report(rows: dict[str, dict[str, float]], file_bytes: int) -> str:
    lines = [f"entry file: {file_bytes / 1e6:.1f} MB; medians; CPU: this thread's; faults: page faults per load",
             f"{'way':<36} {'wall ms':>8} {'min ms':>8} {'GB/s':>6} {'CPU ms':>7} {'faults':>7} {'speedup':>8}"]
    for name, row in rows.items():
        speedup = f"{row['speedup']:.1f}x" if "speedup" in row else ""
        lines.append(f"{name:<36} {row['median_ms']:>8.1f} {row['min_ms']:>8.1f} {row['gb_per_s']:>6.2f} "
                     f"{row['median_cpu_ms']:>7.1f} {row['median_page_faults']:>7.0f} {speedup:>8}")
    return "\n".join(lines)


def pressure() -> dict[str, str]:
    """The kernel's CPU and memory pressure (PSI: the share of time some task waited), if it has it."""
    found = {}
    for kind in ("cpu", "memory"):
        with contextlib.suppress(OSError):
            found[kind] = Path(f"/proc/pressure/{kind}").read_text().splitlines()[0]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--mooncake", action="store_true", help="also Mooncake (a master started here on loopback)")
    parser.add_argument("--compare", choices=("pool", "format"), default="pool",
                        help="pool: a hit loaded into the public pool, decode then place against straight into its "
                             "slots; format: the file format /1 against now, to a decoded entry")
    parser.add_argument("--out", type=Path, default=Path("eval/runs/entry_load"))
    parser.add_argument("--name", default="entry_load", help="the raw data file's name (OUT/NAME.json)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    entry, identity = _qwen35_entry(args.doc_tokens)
    file_bytes = len(encode_entry(entry, identity))
    record: dict[str, Any] = {"machine": machine(), "load_average_before": os.getloadavg(),
                              "pressure_before": pressure(), "started": time.time(),
                              "entry_bytes": entry.nbytes, "file_bytes": file_bytes, "repeats": args.repeats,
                              "compare": args.compare}
    with tempfile.TemporaryDirectory(prefix="hypic-entry-load-", dir=".") as scratch, \
            mooncake_master(args.mooncake, Path(scratch)) as master:
        tier = _connected_tier(master) if master is not None else None
        if args.compare == "pool":
            ways = all_pool_ways(Path(scratch) / "disk", entry, identity, tier)
        else:
            ways = disk_ways(Path(scratch) / "disk", entry, identity)
            ways |= mooncake_ways(tier, entry, identity) if tier is not None else {}
        runs = measure(ways, entry, args.repeats)
    record |= {"load_average_after": os.getloadavg(), "pressure_after": pressure(), "timings": runs,
               "summary": summary(runs, file_bytes)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(record, indent=1))
    print(report(record["summary"], file_bytes))
    print(f"load average (1, 5, 15 min) before {record['load_average_before']}, after {record['load_average_after']}")
    print(f"CPU pressure before: {record['pressure_before'].get('cpu')}; after: {record['pressure_after'].get('cpu')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
