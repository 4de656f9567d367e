"""The public pool's lower tiers on one engine: the disk tier's files, write policies, faults as
misses, namespaces, capacity beyond memory. Oracles: an engine without tiers building the same
documents cold (its greedy tokens), the files' own bytes, closed-form byte budgets."""
import errno
import hashlib
import json
import shutil
import struct
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors import safe_open

from hypic import DEFAULT_SEPARATOR as SEP, Engine
from hypic.cache.store import LinearInterior, SegmentEntry, entry_tensors
from hypic.cache.tiers.disk import DiskTier
from hypic.cache.tiers.entry_file import BadEntryFile, EntryIdentity, decode_entry, encode_entry
from hypic.cache.tiers.hierarchy import WritePolicy
from hypic.cache.tiers.host import HostTier
from hypic.cache.tiers.options import TierOptions
from hypic_testing.entry_files import entry_identity, join_entry_file, split_entry_file

DOCUMENTS = [f"document {i}: " + " ".join(f"fact{i}-{j}" for j in range(25)) for i in range(6)]
MakeEngine = Callable[..., Engine]


@pytest.fixture
def make(tiny_checkpoint: Path, tmp_path: Path) -> MakeEngine:
    """``make(public_pool_bytes=None, cache_dir=tmp/cache, **tier options)`` -> a fresh engine."""
    engines: list[Engine] = []

    def factory(public_pool_bytes: int | None = None, cache_dir: Path | None = tmp_path / "cache", **options) -> Engine:
        tiers = TierOptions(str(cache_dir) if cache_dir is not None else None, **options)
        engines.append(Engine.from_pretrained(tiny_checkpoint, public_pool_bytes=public_pool_bytes, tiers=tiers))
        return engines[-1]

    yield factory
    for engine in engines:
        engine.close()


def prompt(order: list[int], query: str = "which fact comes first?", leading: str = "system prompt") -> str:
    return SEP.join([leading, *(DOCUMENTS[i] for i in order), query])


def files(root: Path) -> list[Path]:
    """The documents' entry files (resume points of the private pool, heads named r<hash> and KV
    chunks k<hash>, are not these)."""
    return sorted(p for p in root.rglob("*.safetensors") if p.name[0] not in "rk")


def tiers_of(engine: Engine):
    assert engine.cache.public.lower is not None
    return engine.cache.public.lower


def disk_counters(engine: Engine) -> dict:
    tiers = tiers_of(engine)
    tiers.drain()
    return tiers.describe()["tiers"]["disk"]


def cold_tokens(make: MakeEngine, text: str) -> list[int]:
    return make(cache_dir=None).generate(text, max_new_tokens=8).output_ids


# ----- the file format ----------------------------------------------------------------------------
def built_entry(engine: Engine, document: str) -> SegmentEntry:
    ids = tuple(engine.tokenizer.encode(document))
    return engine.segment_entry(ids, engine.policy("hypic"))[0]


def identity(engine: Engine) -> EntryIdentity:
    lower = tiers_of(engine)
    return (lower.below if isinstance(lower, HostTier) else lower).identity


def test_a_file_is_safetensors_with_its_identity(make: MakeEngine, tmp_path: Path) -> None:
    engine = make()
    entry = built_entry(engine, DOCUMENTS[0])
    tiers_of(engine).drain()
    (path,) = files(tmp_path / "cache")
    with safe_open(str(path), "pt") as opened:
        meta = opened.metadata()
        for index, layer in enumerate(entry.layers):
            names = ("keys", "values") if hasattr(layer, "keys") else ("state", "conv_tail", "transition")
            stored = [getattr(layer, "keys", None), getattr(layer, "values", None)] if hasattr(layer, "keys") else \
                [layer.zero_start_state, layer.conv_tail, layer.transition.value]
            for name, tensor in zip(names, stored):
                assert torch.equal(opened.get_tensor(f"{index}.{name}"), tensor)
    assert meta["key"] == entry.key and meta["fingerprint"] == engine.fingerprint
    assert meta["model_dtype"] == str(engine.model.dtype) and meta["state_dtype"] == str(engine.state_cache_dtype)
    assert json.loads(meta["token_ids"]) == list(entry.token_ids) and meta["seams"] == "8,8"


def sha256_of_tensors(header: dict, body: bytes) -> str:
    """The checksum of the previous format (``hypic-segment-entry/1``), from its definition: SHA-256
    over each tensor's name and bytes, by name."""
    digest = hashlib.sha256()
    for name in sorted(n for n in header if n != "__metadata__"):
        begin, end = header[name]["data_offsets"]
        digest.update(name.encode() + body[begin:end])
    return digest.hexdigest()


def spoil(data: bytes, how: str, engine: Engine) -> bytes:
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + size])
    if how == "truncated":
        return data[:len(data) // 2]
    if how == "header cut":
        return data[:8 + size // 2]
    if how == "flipped byte":
        return data[:-5] + bytes([data[-5] ^ 0xFF]) + data[-4:]
    if how == "zeroes":
        return bytes(len(data))
    meta = header["__metadata__"]
    if how == "foreign model":
        meta["fingerprint"] = "0" * 16
    elif how == "foreign dtype":
        meta["state_dtype"] = "torch.bfloat16"
    elif how == "another document":
        meta["token_ids"] = json.dumps(list(engine.tokenizer.encode(DOCUMENTS[5])))
    elif how == "previous format":  # as the writer of format /1 made it: whole, and sound by its own checksum
        meta["format"], meta["checksum"] = "hypic-segment-entry/1", sha256_of_tensors(header, data[8 + size:])
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded + data[8 + size:]


SPOILS = ["truncated", "header cut", "flipped byte", "zeroes", "foreign model", "foreign dtype", "another document",
          "previous format"]


@pytest.mark.parametrize("how", SPOILS)
def test_a_spoiled_file_is_refused_by_the_decoder(make: MakeEngine, how: str) -> None:
    engine = make(cache_dir=None)
    entry = built_entry(engine, DOCUMENTS[0])
    ident = entry_identity(engine)
    data = encode_entry(entry, ident)
    decoded = decode_entry(data, ident, entry.key, entry.token_ids)
    assert all(torch.equal(a, b) for a, b in zip(_tensors(decoded), _tensors(entry)))
    with pytest.raises(BadEntryFile):
        decode_entry(spoil(data, how, engine), ident, entry.key, entry.token_ids)


def test_the_checksum_is_xxh3_128_of_the_header_and_the_tensors(make: MakeEngine) -> None:
    """From its definition: XXH3-128 of the header as written (compact JSON) less the checksum, then
    the data section's bytes; a byte flipped anywhere in the data section is refused for it."""
    engine = make(cache_dir=None)
    entry = built_entry(engine, DOCUMENTS[0])
    ident = entry_identity(engine)
    data = encode_entry(entry, ident)
    header, body = split_entry_file(data)
    stated = header["__metadata__"].pop("checksum")
    expected = xxhash.xxh3_128(json.dumps(header, separators=(",", ":")).encode() + body).hexdigest()
    assert stated == f"xxh3-128:{expected}"
    start = len(data) - len(body)
    for offset in (start, start + len(body) // 3, len(data) - 1):
        flipped = data[:offset] + bytes([data[offset] ^ 0x01]) + data[offset + 1:]
        with pytest.raises(BadEntryFile, match="checksum"):
            decode_entry(flipped, ident, entry.key, entry.token_ids)


def test_tensors_larger_than_the_copy_chunk_come_back_whole(make: MakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder copies and hashes a chunk at a time: with chunks much smaller than the tensors (and
    not a multiple of their element size) every tensor still equals the stored one, and a byte
    flipped inside a later chunk is refused."""
    from hypic.cache.tiers import entry_file

    engine = make(cache_dir=None)
    entry = built_entry(engine, DOCUMENTS[0])
    ident = entry_identity(engine)
    data = encode_entry(entry, ident)
    monkeypatch.setattr(entry_file, "COPY_CHUNK", 1001)
    assert max(t.numel() * t.element_size() for t in _tensors(entry)) > 10 * 1001
    decoded = decode_entry(data, ident, entry.key, entry.token_ids)
    assert all(torch.equal(a, b) for a, b in zip(_tensors(decoded), _tensors(entry), strict=True))
    middle = len(data) - 5 * 1001
    with pytest.raises(BadEntryFile, match="checksum"):
        decode_entry(data[:middle] + bytes([data[middle] ^ 0x10]) + data[middle + 1:], ident, entry.key, entry.token_ids)


def test_a_header_damaged_where_only_the_checksum_can_tell_is_refused(make: MakeEngine) -> None:
    """Keys and values of one attention layer swap their bytes in the header (same shapes, same
    dtype, the data section untouched): every other check passes, the checksum does not."""
    engine = make(cache_dir=None)
    entry = built_entry(engine, DOCUMENTS[0])
    ident = entry_identity(engine)
    header, body = split_entry_file(encode_entry(entry, ident))
    index = next(i for i, layer in enumerate(entry.layers) if hasattr(layer, "keys"))
    keys, values = header[f"{index}.keys"], header[f"{index}.values"]
    assert keys["shape"] == values["shape"] and not torch.equal(entry.layers[index].keys, entry.layers[index].values)
    keys["data_offsets"], values["data_offsets"] = values["data_offsets"], keys["data_offsets"]
    with pytest.raises(BadEntryFile, match="checksum"):
        decode_entry(join_entry_file(header, body), ident, entry.key, entry.token_ids)


def _tensors(entry: SegmentEntry) -> list[torch.Tensor]:
    out = []
    for layer in entry.layers:
        out += [layer.keys, layer.values] if hasattr(layer, "keys") else [layer.zero_start_state, layer.conv_tail,
                                                                          layer.transition.value]
    return out


@pytest.mark.parametrize("how", SPOILS)
def test_a_spoiled_file_is_a_miss_deleted_and_the_answer_unchanged(make: MakeEngine, tmp_path: Path, how: str) -> None:
    first = make()
    first.warmup(DOCUMENTS[:2])
    first.close()
    for path in files(tmp_path / "cache"):
        path.write_bytes(spoil(path.read_bytes(), how, first))
    restarted = make()
    result = restarted.generate(prompt([1, 0]), max_new_tokens=8)
    counters = disk_counters(restarted)
    assert result.segments_hit == 0 and result.segments_missed == 2
    assert counters["bad_files"] == 2 and counters["healthy"]
    assert result.output_ids == cold_tokens(make, prompt([1, 0]))
    rewritten = files(tmp_path / "cache")  # deleted, and the rebuilt entries written again
    assert len(rewritten) == 2 and all(decode_entry(p.read_bytes(), identity(restarted), *_key(restarted, i))
                                       for p, i in zip(rewritten, _order(restarted, rewritten)))


def _key(engine: Engine, index: int) -> tuple[str, tuple[int, ...]]:
    ids = tuple(engine.tokenizer.encode(DOCUMENTS[index]))
    return engine.cache.document_key(ids, engine.policy("hypic")), ids


def _order(engine: Engine, paths: list[Path]) -> list[int]:
    """Which document each file holds (by its address)."""
    addresses = {identity(engine).address(_key(engine, i)[0], "").split("/")[1]: i for i in range(len(DOCUMENTS))}
    return [addresses[p.name.removesuffix(".safetensors")] for p in paths]


# ----- loads straight into the pool's slots --------------------------------------------------------
def _engine(tiny_checkpoint: Path, tiers: TierOptions, state_dtype: str = "float32", **options) -> Engine:
    return Engine.from_pretrained(tiny_checkpoint, state_cache_dtype=state_dtype, tiers=tiers, **options)


def _linear(entry: SegmentEntry) -> list[LinearInterior]:
    return [layer for layer in entry.layers if isinstance(layer, LinearInterior)]


def _pool_tensors(layer: LinearInterior) -> list[torch.Tensor]:
    """What a slot of the pool holds: S_C|0 and T_C."""
    return [layer.zero_start_state, layer.transition.value]


def _in_a_slab(tensor: torch.Tensor, store) -> bool:
    """Whether ``tensor``'s bytes lie inside one slab of the pool's arenas."""
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    slabs = [t for arena in store.arenas.arenas.values() for slab in arena._slabs.values() for t in slab]
    return any(s.data_ptr() <= begin and end <= s.data_ptr() + s.numel() * s.element_size() for s in slabs)


def _decoded_by_tiers(monkeypatch: pytest.MonkeyPatch) -> list[SegmentEntry]:
    """Every entry the storage tiers decode from here on, as the decoder hands it over."""
    from hypic.cache.tiers import hierarchy

    decoded: list[SegmentEntry] = []

    def recorded(*args, **kwargs) -> SegmentEntry:
        decoded.append(decode_entry(*args, **kwargs))
        return decoded[-1]

    monkeypatch.setattr(hierarchy, "decode_entry", recorded)
    return decoded


def _fake_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    from hypic.cache.tiers.mooncake import MooncakeTier

    shared = FakeMooncakeStore()
    monkeypatch.setattr(MooncakeTier, "open", lambda tier: setattr(tier, "client", shared))


@pytest.mark.parametrize("state_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("source", ["disk", "disk, prefetched", "mooncake"])
def test_a_lower_tier_hit_is_decoded_straight_into_the_pools_slots(tiny_checkpoint: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch, source: str,
                                                                   state_dtype: str) -> None:
    """A document another engine built by prefilling, loaded from disk (on the caller's thread or a
    prefetch thread) or Mooncake, equals the built entry tensor by tensor; its S_C|0 and T_C are the
    very tensors the decoder wrote (no second copy), inside the pool's slabs, one slot a layer, of
    the slot shapes the builder's pool gave them."""
    if source == "mooncake":
        _fake_mooncake(monkeypatch)
    tiers = TierOptions(None, mooncake_master="127.0.0.1:50051") if source == "mooncake" else \
        TierOptions(str(tmp_path / "cache"))
    first = _engine(tiny_checkpoint, tiers, state_dtype)
    built = built_entry(first, DOCUMENTS[0])
    first.close()
    second = _engine(tiny_checkpoint, tiers, state_dtype)
    decoded = _decoded_by_tiers(monkeypatch)
    if source == "disk, prefetched":
        load, _ = tiers_of(second).prefetch(built.key, built.token_ids, "", built.nbytes)
        assert load.result(timeout=30) is not None
    loaded, tier = second.cache.public.fetch(built.key, built.token_ids)
    assert tier == source.partition(",")[0] and loaded is second.cache.public.entries[built.key]
    pairs = list(zip(entry_tensors(loaded), entry_tensors(built), strict=True))
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in pairs)
    (from_file,) = decoded
    assert second.cache.public.arenas.used_slots == len(_linear(built)) > 0
    for ours, written, theirs in zip(_linear(loaded), _linear(from_file), _linear(built), strict=True):
        assert ours.transition.kept == theirs.transition.kept
        assert ours.owner.arena.fields == theirs.owner.arena.fields
        for tensor, decoded_tensor in zip(_pool_tensors(ours), _pool_tensors(written), strict=True):
            assert tensor.data_ptr() == decoded_tensor.data_ptr() and _in_a_slab(tensor, second.cache.public)
    second.close()


def test_a_damaged_file_is_a_miss_that_gives_its_slots_back(make: MakeEngine, tmp_path: Path) -> None:
    """A byte flipped in the last tensor is found after every slot was taken and written: the load
    is a miss, and every slot is free again at once (poisoned), however long the error is kept."""
    first = make()
    first.warmup(DOCUMENTS[:1])
    first.close()
    (path,) = files(tmp_path / "cache")
    path.write_bytes(spoil(path.read_bytes(), "flipped byte", first))
    restarted = make()
    pool = restarted.cache.public.arenas
    assert pool.used_slots == 0 and not pool.arenas
    assert restarted.cache.public.fetch(*_key(restarted, 0)) == (None, "")
    assert disk_counters(restarted)["bad_files"] == 1 and pool.arenas  # slots were taken for the load ...
    assert pool.used_slots == 0  # ... and given back
    freed = next(iter(pool.arenas.values()))._slabs
    assert all(torch.isnan(slab[0][0, 0, :, 0]).all() for slab in freed.values())


def test_a_loaded_entry_the_pool_cannot_keep_holds_its_slots_only_while_in_use(make: MakeEngine) -> None:
    """An entry loaded while the pool has no room is served (in its slots) and not stored; its slots
    go back when the request drops it."""
    first = make()
    first.warmup(DOCUMENTS[:1])
    first.close()
    restarted = make(public_pool_bytes=1)
    loaded, tier = restarted.cache.public.fetch(*_key(restarted, 0))
    assert tier == "disk" and loaded is not None and not restarted.cache.public.entries and restarted.cache.public.rejected == 1
    assert restarted.cache.public.arenas.used_slots == len(_linear(loaded)) > 0
    del loaded
    assert restarted.cache.public.arenas.used_slots == 0


# ----- persistence, policies, namespaces ----------------------------------------------------------
def test_a_restarted_engine_serves_stored_documents_from_disk(make: MakeEngine) -> None:
    first = make()
    first.warmup(DOCUMENTS[:4])
    expected = first.generate(prompt([3, 1, 0, 2]), max_new_tokens=8)
    first.close()
    restarted = make()
    result = restarted.generate(prompt([3, 1, 0, 2]), max_new_tokens=8)
    assert result.segments_hit == 4 and result.stats.cached_tokens_by_tier["disk"] == result.cached_tokens > 0
    assert result.stats.cached_tokens_by_tier["device"] == 0
    assert result.output_ids == expected.output_ids == cold_tokens(make, prompt([3, 1, 0, 2]))
    again = restarted.generate(prompt([2, 3, 1, 0], "again?"), max_new_tokens=8)
    assert again.stats.cached_tokens_by_tier["disk"] == 0 and again.segments_hit == 4  # now in memory


def test_the_scheduler_counts_documents_on_disk_as_cached(make: MakeEngine) -> None:
    """A restarted engine's estimate of a request's work (what the loop ranks it by) leaves out the
    interiors its disk holds, as it leaves out those in memory (closed form: the prompt less the
    four interiors); without the disk they count as work."""
    first = make()
    first.warmup(DOCUMENTS[:4])
    first.close()
    restarted = make()
    parts = restarted.parse(prompt([3, 1, 0, 2]))
    seams = restarted.seams
    interiors = sum(hi - lo for lo, hi in (seams.interior(len(s)) for s in parts.segments))
    assert restarted.cache.uncached_tokens(restarted.plan(parts)) == len(parts.token_ids) - interiors
    memory_only = make(cache_dir=None)
    assert memory_only.cache.uncached_tokens(memory_only.plan(parts)) == len(parts.token_ids)


@pytest.mark.parametrize("policy, after_build, after_reuse, after_close", [
    ("write_through", 3, 3, 3), ("write_through_selective", 0, 1, 1), ("write_back", 0, 0, 3)])
def test_write_policies_write_when_they_say(make: MakeEngine, tmp_path: Path, policy: str, after_build: int,
                                            after_reuse: int, after_close: int) -> None:
    engine = make(write_policy=WritePolicy(policy))
    engine.warmup(DOCUMENTS[:3])
    tiers_of(engine).drain()
    assert len(files(tmp_path / "cache")) == after_build
    engine.generate(prompt([1]), max_new_tokens=1)  # reuses document 1 once
    tiers_of(engine).drain()
    assert len(files(tmp_path / "cache")) == after_reuse
    engine.close()
    assert len(files(tmp_path / "cache")) == after_close


def test_write_back_writes_what_memory_evicts(make: MakeEngine, tmp_path: Path) -> None:
    probe = make(cache_dir=None)
    size = probe.entry_bytes(len(probe.tokenizer.encode(DOCUMENTS[0])))
    engine = make(public_pool_bytes=2 * size + size // 2, write_policy=WritePolicy.WRITE_BACK)
    engine.warmup(DOCUMENTS[:4])  # memory holds two: the first two are evicted, so written
    tiers_of(engine).drain()
    assert sorted(_order(engine, files(tmp_path / "cache"))) == [0, 1]
    engine.close()  # and the two still in memory when it stops
    assert sorted(_order(engine, files(tmp_path / "cache"))) == [0, 1, 2, 3]


def test_namespaces_are_kept_apart_on_disk(make: MakeEngine, tmp_path: Path) -> None:
    first = make()
    first.warmup(DOCUMENTS[:2], namespace="team-a")
    first.warmup(DOCUMENTS[2:4], namespace="team-b")
    first.close()
    restarted = make()
    other = restarted.generate(prompt([0, 1]), max_new_tokens=4, namespace="team-b")
    assert other.segments_hit == 0 and other.segments_missed == 2  # team-a's documents are not team-b's
    own = restarted.generate(prompt([0, 1]), max_new_tokens=4, namespace="team-a")
    assert own.segments_hit == 2 and own.stats.disk_cached_tokens > 0
    _, _, dropped = restarted.flush("team-a", frozenset({"disk"}))
    assert dropped == {"disk": 2}  # its two documents (its request's resume points go too, uncounted)
    left = {p.parent.parent.name for p in files(tmp_path / "cache")}
    assert left == {"ns-team-b"}  # team-b's two, and the two team-b built above
    assert len(files(tmp_path / "cache")) == 4


def test_a_flush_leaves_the_disk_unless_asked(make: MakeEngine, tmp_path: Path) -> None:
    engine = make()
    engine.warmup(DOCUMENTS[:3])
    tiers_of(engine).drain()
    public, _, dropped = engine.flush()
    assert public == 3 and dropped == {} and len(files(tmp_path / "cache")) == 3
    result = engine.generate(prompt([2, 0]), max_new_tokens=2)
    assert result.segments_hit == 2 and result.stats.disk_cached_tokens == result.cached_tokens
    _, _, dropped = engine.flush(tiers=frozenset({"memory", "disk"}))
    assert dropped == {"disk": 3} and files(tmp_path / "cache") == _resume_files(tmp_path / "cache") == []


# ----- capacity and budgets ---------------------------------------------------------------------
def test_a_working_set_larger_than_memory_is_served_from_disk(make: MakeEngine) -> None:
    probe = make(cache_dir=None)
    size = probe.entry_bytes(len(probe.tokenizer.encode(DOCUMENTS[0])))
    engine = make(public_pool_bytes=2 * size)  # memory holds 2 of the 6 documents
    for index in range(6):
        engine.generate(prompt([index]), max_new_tokens=1)
    second = [engine.generate(prompt([index], "again?", "another system prompt"), max_new_tokens=1) for index in range(6)]
    assert all(r.segments_hit == 1 for r in second)
    assert sum(r.stats.disk_cached_tokens > 0 for r in second) >= 4 and engine.cache.public.nbytes <= 2 * size


def test_the_disk_budget_keeps_the_most_recently_used_files(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, budget_bytes=250)
    disk.open()
    for name in "abc":
        disk.write(f"shared/{name * 64}", bytes(100))
    assert disk.describe()["entries"] == 2 and not disk.contains("shared/" + "a" * 64)
    with disk.reading("shared/" + "b" * 64) as data:  # b becomes the most recent
        assert data is not None and len(data) == 100
    disk.write("shared/" + "d" * 64, bytes(100))
    assert {disk.contains("shared/" + n * 64) for n in "bd"} == {True} and not disk.contains("shared/" + "c" * 64)
    reopened = DiskTier(tmp_path, budget_bytes=250)  # recency survives a restart (file times)
    reopened.open()
    reopened.write("shared/" + "e" * 64, bytes(100))
    assert reopened.contains("shared/" + "d" * 64) and not reopened.contains("shared/" + "b" * 64)
    assert reopened.touch("shared/" + "d" * 64) and not reopened.touch("shared/" + "b" * 64)  # d: most recent, no read
    reopened.write("shared/" + "f" * 64, bytes(100))
    assert reopened.contains("shared/" + "d" * 64) and not reopened.contains("shared/" + "e" * 64)


def test_two_writers_of_one_address_leave_one_whole_file(tmp_path: Path) -> None:
    """Four writers (four servers' tiers on one directory) rewrite one address while a reader reads
    it: the reader only ever sees a whole payload or nothing, and one whole file is left."""
    writers = [DiskTier(tmp_path) for _ in range(4)]
    for writer in writers:
        writer.open()
    payloads = [bytes([i]) * 2_000_000 for i in range(4)]
    address, seen, done = "shared/" + "f" * 64, [], threading.Event()
    threads = [threading.Thread(target=lambda w=w, p=p: [w.write(address, p) for _ in range(20)])
               for w, p in zip(writers, payloads)]

    def read() -> None:
        while not done.is_set():
            with writers[0].reading(address) as data:
                seen.append(None if data is None else (len(data), data[0], data[len(data) - 1]))

    reader = threading.Thread(target=read)
    reader.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    reader.join()
    assert all(s is None or (s[0] == 2_000_000 and s[1] == s[2]) for s in seen), {s for s in seen if s}
    assert sum(s is not None for s in seen) > 10
    (path,) = [p for p in tmp_path.rglob("*") if p.is_file()]  # no temporary file left behind
    assert path.read_bytes() in payloads


def test_servers_of_another_dtype_leave_each_others_files_alone(make: MakeEngine, tiny_checkpoint: Path,
                                                               tmp_path: Path) -> None:
    first = make()
    first.warmup(DOCUMENTS[:2])
    first.close()
    other = Engine.from_pretrained(tiny_checkpoint, state_cache_dtype="bfloat16", tiers=TierOptions(str(tmp_path / "cache")))
    result = other.generate(prompt([1, 0]), max_new_tokens=2)
    other.close()
    assert result.segments_missed == 2 and disk_counters(other)["bad_files"] == 0
    assert len(files(tmp_path / "cache")) == 4  # its own two beside the first server's two
    assert make().generate(prompt([0, 1]), max_new_tokens=2).stats.disk_cached_tokens > 0


# ----- a directory that fails ---------------------------------------------------------------------
def test_an_unusable_directory_is_reported_and_serving_goes_on(make: MakeEngine, tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the cache directory should be")
    engine = make(cache_dir=blocker / "cache")
    status = disk_counters(engine)
    assert not status["healthy"] and "NotADirectoryError" in status["error"]
    result = engine.generate(prompt([0, 1]), max_new_tokens=8)
    assert result.output_ids == cold_tokens(make, prompt([0, 1]))


def test_a_failing_disk_marks_the_tier_unhealthy_until_it_works_again(make: MakeEngine, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make()
    real_write = DiskTier.write

    def full(self: DiskTier, address: str, data: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "write", full)
    result = engine.generate(prompt([0, 1]), max_new_tokens=8)
    status = disk_counters(engine)
    assert not status["healthy"] and "No space left" in status["error"] and status["write_errors"] == 1
    assert result.output_ids == cold_tokens(make, prompt([0, 1]))
    monkeypatch.setattr(DiskTier, "write", real_write)
    monkeypatch.setattr("hypic.cache.tiers.hierarchy.RETRY_S", 0.0)
    engine.warmup(DOCUMENTS[2:3])
    status = disk_counters(engine)
    assert status["healthy"] and status["writes"] == 1


def test_a_directory_removed_under_a_running_engine_is_recreated(make: MakeEngine, tmp_path: Path) -> None:
    engine = make()
    engine.warmup(DOCUMENTS[:1])
    tiers_of(engine).drain()
    shutil.rmtree(tmp_path / "cache")
    engine.flush()
    result = engine.generate(prompt([0, 1]), max_new_tokens=2)
    assert result.segments_missed == 2  # its file is gone: rebuilt
    tiers_of(engine).drain()
    assert len(files(tmp_path / "cache")) == 2


def test_entries_are_checked_against_the_model_before_use(make: MakeEngine, tmp_path: Path) -> None:
    """A file renamed to another document's address (its header names the wrong key) is refused."""
    engine = make()
    engine.warmup(DOCUMENTS[:2])
    tiers_of(engine).drain()
    a, b = files(tmp_path / "cache")
    data = a.read_bytes()
    b.write_bytes(data)
    engine.flush()
    result = engine.generate(prompt([0, 1]), max_new_tokens=2)
    assert result.segments_hit == 1 and disk_counters(engine)["bad_files"] == 1


# ----- prefetch policies --------------------------------------------------------------------------
@pytest.mark.parametrize("policy, hits", [("wait_complete", 2), ("best_effort", 0), ("timeout", 0)])
def test_prefetch_policies_wait_as_they_say(make: MakeEngine, monkeypatch: pytest.MonkeyPatch,
                                            policy: str, hits: int) -> None:
    """Loads held back until the prefill is over (a slow tier; for wait_complete, 0.6 s): wait_complete
    waits and hits; best_effort rebuilds at once; timeout (0.2 s plus the bytes at 200 MB/s here)
    gives up and rebuilds. Held by an event, not a sleep, so a loaded machine cannot let a load
    finish first. The answer is the same either way."""
    import threading

    from hypic.cache.tiers import hierarchy

    first = make()
    first.warmup(DOCUMENTS[:2])
    first.close()
    engine = make(prefetch_policy=hierarchy.PrefetchPolicy(policy))
    slow_read, release = DiskTier.reading, threading.Event()

    def slow(self: DiskTier, address: str):
        release.wait(10)  # a policy that waits for the load gets it after 10 s: a hit, and the test fails
        return slow_read(self, address)

    monkeypatch.setattr(DiskTier, "reading", slow)
    if policy == "wait_complete":
        threading.Timer(0.6, release.set).start()
    try:
        parts = engine.parse(prompt([1, 0]))
        assert len(engine.cache.prefetch(engine.plan(parts))) == 2
        prefill = engine.prefill(parts)
    finally:
        release.set()
    assert prefill.stats.segments_hit == hits and prefill.stats.segments_missed == 2 - hits
    assert tiers_of(engine).describe()["prefetches"]["started"] == 2
    tokens = [int(prefill.logits.argmax())]
    assert tokens[0] == cold_tokens(make, prompt([1, 0]))[0]


def test_loads_nobody_takes_are_forgotten_beyond_the_byte_bound(make: MakeEngine,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefetches of requests that never ran (cancelled, say) hold decoded entries: past the bound
    the oldest are dropped, so they cannot pile up."""
    from hypic.cache.tiers import hierarchy

    monkeypatch.setattr(hierarchy, "QUEUE_BYTES", 1000)
    tiers = tiers_of(make())
    for index in range(3):
        tiers.prefetch(f"key-{index}", (index,), "", 400)
    assert list(tiers.prefetches) == ["key-1", "key-2"] and tiers.prefetched_bytes == 800
    assert tiers.take("key-2", (2,), "") is None and tiers.prefetched_bytes == 400  # nothing stored: a miss


@pytest.mark.parametrize("first", ["documents", "resume points"])
def test_the_cache_drains_the_writes_of_documents_and_resume_points(make: MakeEngine, tmp_path: Path, first: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``HybridCache.drain`` returns once every write under way below memory is done, documents' and
    resume points' alike: with both kinds held back, it waits for the ``first`` released and then
    for the other; their files are all on disk when it returns."""
    held = {"documents": threading.Event(), "resume points": threading.Event()}
    write = DiskTier.write

    def held_back(tier: DiskTier, address: str, data: bytes) -> None:
        held["resume points" if Path(address).name[0] in "rk" else "documents"].wait(30)
        write(tier, address, data)

    monkeypatch.setattr(DiskTier, "write", held_back)
    engine = make()
    engine.generate(prompt([0, 1]), max_new_tokens=2)
    drained = threading.Thread(target=engine.cache.drain, daemon=True)
    drained.start()
    try:
        for kind in (first, *(k for k in held if k != first)):
            drained.join(0.5)
            assert drained.is_alive(), f"drained with the {kind} still held back"
            held[kind].set()
    finally:  # the engine's close finishes its writes
        for event in held.values():
            event.set()
    drained.join(30)
    assert not drained.is_alive() and len(files(tmp_path / "cache")) == 2 and _resume_files(tmp_path / "cache")


def test_a_document_waiting_in_the_write_queue_is_still_a_hit(make: MakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under write_back, memory evicts a document and its write waits in the queue (the disk held up
    here): a request for it meanwhile takes it from the queue, as a disk hit, instead of rebuilding it."""
    sizes = _sizes(make)
    release, write = threading.Event(), DiskTier.write
    monkeypatch.setattr(DiskTier, "write", lambda self, address, data: (release.wait(30), write(self, address, data)))
    engine = make(public_pool_bytes=max(sizes[:2]), write_policy=WritePolicy.WRITE_BACK)
    try:
        engine.warmup(DOCUMENTS[:2])  # the first is evicted by the second: queued, not written
        assert files(engine.cache.public.lower.tiers[0].root) == []
        result = engine.generate(prompt([0]), max_new_tokens=8)
        assert result.segments_hit == 1 and result.stats.disk_cached_tokens == result.cached_tokens > 0
    finally:
        release.set()
    assert result.output_ids == cold_tokens(make, prompt([0]))


# ----- L2: host memory below a device's pool ---------------------------------------------------------
# On this CPU-only machine the "device" is host memory too: the tier's moves are copies between two
# places in RAM, but what it keeps, hands back, sends below and reports is what a GPU server's does.
def _sizes(make: MakeEngine) -> list[int]:
    probe = make(cache_dir=None)
    return [probe.entry_bytes(len(probe.tokenizer.encode(d))) for d in DOCUMENTS]


def test_host_memory_keeps_what_the_device_pool_evicts(make: MakeEngine) -> None:
    """A device pool for one document and host memory for all: three warmed documents leave two in
    host memory (closed form); a request over the three, in another order, reuses all three from
    there (the one the pool held is evicted by the first loaded back; the pool cannot take the
    others while the first is in use), two of them through copies started when it was planned, and
    answers what a server without tiers answers."""
    sizes = _sizes(make)
    engine = make(public_pool_bytes=max(sizes[:3]), cache_dir=None, host_bytes=sum(sizes))
    engine.warmup(DOCUMENTS[:3])
    host = tiers_of(engine)
    assert len(engine.cache.public) == 1 and len(host.entries) == 2 and host.nbytes == sizes[0] + sizes[1]
    text = prompt([1, 0, 2])
    assert engine.cache.prefetch(engine.plan(engine.parse(text))) == [] and len(host.staged) == 2  # copies: nothing to wait for
    result = engine.generate(text, max_new_tokens=8)
    parts = engine.parse(text)
    interiors = [hi - lo for lo, hi in (engine.seams.interior(len(s)) for s in parts.segments)]
    assert result.stats.cached_tokens_by_tier == {"device": 0, "host": sum(interiors), "disk": 0, "mooncake": 0,
                                                  "replica": 0}
    assert host.staged == {} and host.counters.hits == 3
    assert result.output_ids == cold_tokens(make, text)
    from hypic.server.stats import _tier_lines

    report = host.describe()
    assert report["tiers"]["host"]["entries"] == 3 and report["tiers"]["host"]["bytes"] == sum(sizes[:3])
    assert 'hypic_tier_hits_total{tier="host"} 3.0' in _tier_lines(report)
    assert engine.flush()[2] == {"host": 3} and host.nbytes == 0  # host memory keeps its copies; a flush empties it


def test_host_memory_sends_its_least_recently_used_below(make: MakeEngine, tmp_path: Path) -> None:
    """Host memory for one document above a write_back disk: the device pool's evictions go to host
    memory, host memory's to the disk (one file, nothing written before); a request over the three
    reuses each from the tier holding it: the pool's, host memory's, the disk's."""
    sizes = _sizes(make)
    engine = make(public_pool_bytes=max(sizes[:3]), host_bytes=max(sizes[:3]), write_policy=WritePolicy.WRITE_BACK)
    engine.warmup(DOCUMENTS[:3])
    tiers_of(engine).below.drain()
    assert _order(engine, files(tmp_path / "cache")) == [0] and list(tiers_of(engine).entries) == [_key(engine, 1)[0]]
    result = engine.generate(prompt([2, 1, 0]), max_new_tokens=8)
    parts = engine.parse(prompt([2, 1, 0]))
    interiors = [hi - lo for lo, hi in (engine.seams.interior(len(s)) for s in parts.segments)]
    assert result.stats.cached_tokens_by_tier == {"device": interiors[0], "host": interiors[1], "disk": interiors[2],
                                                  "mooncake": 0, "replica": 0}
    assert result.output_ids == cold_tokens(make, prompt([2, 1, 0]))


def test_host_memory_is_refused_on_a_cpu_server() -> None:
    from hypic.cli import _parser, _tiers
    from hypic.errors import HypicError

    with pytest.raises(HypicError, match="public pool already is host memory"):
        _tiers(_parser().parse_args(["serve", "--host-cache-size", "1G"]))
    assert _tiers(_parser().parse_args(["serve", "--host-cache-size", "1G", "--device", "cuda"])).host_bytes == 1 << 30


# ----- the private pool's resume points on disk ------------------------------------------------------
def _resume_files(root: Path, kind: str = "r") -> list[Path]:
    """The resume points' heads (``kind`` r) or KV chunks (k)."""
    return sorted(p for p in root.rglob("*.safetensors") if p.name.startswith(kind))


def _full_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    from hypic.assembler import combine
    from hypic.cache.segments import Run
    from hypic.models.families import empty_state

    empty = empty_state(engine.model.config, "cpu", torch.float32)
    return combine(engine.model, ids, [Run(0, len(ids))], empty).logits


def test_prefix_hashes_follow_their_recurrence() -> None:
    import random

    from hypic.cache.tiers.resume import MULTIPLIER, prefix_hashes

    rng = random.Random(5)
    for count in (0, 1, 7, 500):
        keys, seed = [rng.randrange(1 << 40) for _ in range(count)], rng.randrange(1 << 64)
        expected = [seed]
        for key in keys:
            expected.append((expected[-1] * MULTIPLIER + key + 1) % (1 << 64))
        assert [int(h) for h in prefix_hashes(seed, keys)] == expected


def test_a_restarted_engine_resumes_a_conversation_from_disk(make: MakeEngine, tmp_path: Path) -> None:
    """Turn 1 ends on an engine with --cache-dir; after a restart on the directory, turn 2 resumes
    where turn 1 ended (its prompt and all but its last token), as the first engine would have, with
    full recompute's logits; an engine without the directory resumes nowhere."""
    first = make()
    turn1 = first.parse("you are a helpful assistant. " + DOCUMENTS[0])
    reply = first.generate(list(turn1.token_ids), max_new_tokens=6, ignore_eos=True)
    turn2 = list(turn1.token_ids) + reply.output_ids + first.parse(" and then?").token_ids
    first.close()
    assert len(_resume_files(tmp_path / "cache")) == 1
    restarted = make()
    resumed = restarted.prefill(restarted.parse(turn2))
    assert resumed.stats.prefix_hit_tokens == resumed.stats.disk_cached_tokens == len(turn1.token_ids) + 5
    assert (resumed.logits - _full_logits(restarted, turn2)).abs().max().item() < 1e-4
    assert make(cache_dir=None).prefill(restarted.parse(turn2)).stats.prefix_hit_tokens == 0


def test_a_restarted_engine_resumes_a_system_prompt_from_disk(make: MakeEngine, tmp_path: Path) -> None:
    """A PIC request keeps its leading part's end on disk; after a restart, another request with the
    same leading part and other documents resumes there, with the logits of an engine that never
    resumed."""
    system = "You answer from the documents only. " * 6
    first = make()
    first.generate(SEP.join([system, DOCUMENTS[0], DOCUMENTS[1], "which fact?"]), max_new_tokens=1)
    first.close()
    restarted = make()
    text = SEP.join([system, DOCUMENTS[2], DOCUMENTS[3], "which other fact?"])
    resumed = restarted.prefill(restarted.parse(text))
    assert resumed.stats.prefix_hit_tokens == len(restarted.parse(text).leading)
    fresh = make(cache_dir=None).prefill(restarted.parse(text))
    assert fresh.stats.prefix_hit_tokens == 0 and (resumed.logits - fresh.logits).abs().max().item() < 1e-4


def test_a_spoiled_or_foreign_resume_file_is_a_miss_and_deleted(make: MakeEngine, tmp_path: Path) -> None:
    """A damaged resume file, or one another namespace would need, is never resumed from: the
    damaged one is deleted and the answer is the one without it."""
    first = make()
    prompt = first.parse(DOCUMENTS[1]).token_ids
    reply = first.generate(list(prompt), max_new_tokens=4, ignore_eos=True)
    first.close()
    turn2 = list(prompt) + reply.output_ids + [65, 66]
    other = make().prefill(make(cache_dir=None).parse(turn2, namespace="team-b"))
    assert other.stats.prefix_hit_tokens == 0  # the file is the shared namespace's
    (path,) = _resume_files(tmp_path / "cache")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    restarted = make()
    resumed = restarted.prefill(restarted.parse(turn2))
    assert resumed.stats.prefix_hit_tokens == 0 and not path.exists() and restarted.cache.resume_points.store.counters.bad_files == 1
    assert (resumed.logits - _full_logits(restarted, turn2)).abs().max().item() < 1e-4


def test_resume_points_of_a_previous_format_are_misses_then_written_anew(make: MakeEngine, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """After a change of the objects' format, a resume point the previous version left on disk is a
    miss (its head deleted, never misread); the request's own resume point is then written whole in
    the new format (none of its KV chunks taken for the old ones the disk still holds), and the next
    engine resumes from it with full recompute's logits."""
    from hypic.cache.tiers import resume, resume_objects

    for module in (resume, resume_objects):  # the previous version's writer
        monkeypatch.setattr(module, "HEAD_FORMAT", "hypic-resume-state/older")
        monkeypatch.setattr(module, "CHUNK_FORMAT", "hypic-resume-kv/older")
    first = make()
    turn1 = list(first.parse("you are a helpful assistant. " + DOCUMENTS[0] * 12).token_ids)  # KV of several chunks
    turn2 = turn1 + first.generate(turn1, max_new_tokens=4, ignore_eos=True).output_ids + [65, 66]
    first.close()
    old_chunks = _resume_files(tmp_path / "cache", "k")
    assert len(old_chunks) > 1
    monkeypatch.undo()
    second = make()
    reply = second.generate(turn2, max_new_tokens=3, ignore_eos=True)
    assert reply.stats.prefix_hit_tokens == 0 and second.cache.resume_points.store.counters.bad_files == 1
    second.close()
    turn3 = turn2 + reply.output_ids + [67]
    third = make()
    resumed = third.prefill(third.parse(turn3))
    assert resumed.stats.prefix_hit_tokens == resumed.stats.disk_cached_tokens == len(turn2) + 2
    assert (resumed.logits - _full_logits(third, turn3)).abs().max().item() < 1e-4


def test_a_conversation_writes_each_kv_chunk_once_and_resumes_from_chunks_of_every_turn(make: MakeEngine,
                                                                                      tmp_path: Path) -> None:
    """Three turns end at p1 < p2 < p3 (each a resume point): the disk holds the full chunks of p3
    once and one tail per resume point not on a chunk edge (closed form), each written once; after a
    restart, turn 4 resumes at p3 from chunks written by all three turns, with full recompute's logits."""
    from hypic.cache.tiers.resume_objects import CHUNK_TOKENS

    first = make()
    history, ends = [], []
    for turn in range(3):
        history += first.parse(f" turn {turn}: " + DOCUMENTS[turn] + DOCUMENTS[turn + 3]).token_ids
        reply = first.generate(list(history), max_new_tokens=5, ignore_eos=True)
        ends.append(len(history) + 4)
        history += reply.output_ids
    first.close()
    assert ends[0] > CHUNK_TOKENS and ends[-1] > 2 * CHUNK_TOKENS
    chunks = ends[-1] // CHUNK_TOKENS + sum(end % CHUNK_TOKENS != 0 for end in ends)
    assert len(_resume_files(tmp_path / "cache", "k")) == first.cache.resume_points.store.disk_writes.chunks_written == chunks
    from hypic.server.stats import _resume_lines

    metrics = _resume_lines(first.cache.resume_points.store.describe())
    assert f'hypic_resume_chunks_written_total{{tier="disk"}} {float(chunks)}' in metrics
    assert 'hypic_resume_points_written_total{tier="disk"} 3.0' in metrics and "hypic_resume_write_queue 0.0" in metrics
    assert len(_resume_files(tmp_path / "cache")) == 3
    restarted = make()
    turn4 = history + first.parse(" and then?").token_ids
    resumed = restarted.prefill(restarted.parse(turn4))
    assert resumed.stats.prefix_hit_tokens == resumed.stats.disk_cached_tokens == ends[-1]
    assert (resumed.logits - _full_logits(restarted, turn4)).abs().max().item() < 1e-4


def test_a_resume_point_whose_chunk_is_gone_is_a_miss_and_deleted(make: MakeEngine, tmp_path: Path) -> None:
    """The disk evicted one KV chunk of a resume point: the point is never resumed from (its head is
    deleted) and the answer is the one without it."""
    first = make()
    prompt = first.parse(DOCUMENTS[1] + DOCUMENTS[2] + DOCUMENTS[3]).token_ids
    reply = first.generate(list(prompt), max_new_tokens=4, ignore_eos=True)
    first.close()
    (head,), chunks = _resume_files(tmp_path / "cache"), _resume_files(tmp_path / "cache", "k")
    assert len(chunks) >= 2
    chunks[0].unlink()
    restarted = make()
    turn2 = list(prompt) + reply.output_ids + [65, 66]
    resumed = restarted.prefill(restarted.parse(turn2))
    assert resumed.stats.prefix_hit_tokens == 0 and not head.exists() and restarted.cache.resume_points.store.counters.bad_files == 1
    assert (resumed.logits - _full_logits(restarted, turn2)).abs().max().item() < 1e-4


def _thue_morse(length: int, zero: int, one: int) -> list[int]:
    return [one if bin(i).count("1") % 2 else zero for i in range(length)]


def test_chunk_names_differ_where_the_64_bit_prefix_hashes_collide() -> None:
    """A Thue-Morse prompt of 1,024 tokens and its complement have equal 64-bit rolling hashes under
    any seed (closed form: their difference is (y - x) times prod_j (1 - M^(2^j)), j < 10, of 2-adic
    valuation 64 for this M), so they and anything after them would share chunk names by that hash;
    the digests that name chunks share none."""
    from hypic.cache.tiers.resume import prefix_hashes
    from hypic.cache.tiers.resume_objects import chunk_names

    a, b, after = _thue_morse(1024, 5, 9), _thue_morse(1024, 9, 5), list(range(20, 320))
    for seed in (0, 12345, 2**63 + 7):
        assert prefix_hashes(seed, a + after)[-1] == prefix_hashes(seed, b + after)[-1]
    assert not set(chunk_names("s", a + after, "d")) & set(chunk_names("s", b + after, "d"))
    assert chunk_names("s", a + after, "d")[:4] == chunk_names("s", a + after[:10], "d")[:4]  # shared prefix, shared chunks


def test_a_prefix_with_a_colliding_hash_never_lends_its_kv(make: MakeEngine, tmp_path: Path) -> None:
    """A Thue-Morse prefix A and its complement B collide under the 64-bit hash. A conversation on A
    leaves its chunks up to 1,024; a prompt B + C leaves KV computed after B for C's first chunk; A's
    next turn A + C (to a different end) stores its resume point; a restarted engine continuing it
    resumes from the disk with full recompute's logits: no chunk of B's stood in for A's (with chunks
    named by the 64-bit hash, B's chunk [1024, 1280) passes every check and its KV is used). A
    longer A + C meets B + C's head under its own hash: a miss, and the head is left alone."""
    a, b, c = _thue_morse(1024, 5, 9), _thue_morse(1024, 9, 5), [20 + (i * 7) % 200 for i in range(300)]
    for engine_ids in (a + c[:10], b + c, a + c[:280]):
        engine = make()
        engine.generate(engine_ids, max_new_tokens=1)
        engine.close()
    last = make()
    turn = a + c[:280] + [30, 31, 32]
    resumed = last.prefill(last.parse(turn))
    assert resumed.stats.disk_cached_tokens == len(a) + 280
    assert (resumed.logits - _full_logits(last, turn)).abs().max().item() < 1e-4
    heads = _resume_files(tmp_path / "cache")
    longer = a + c + [40]  # at 1,324 its hash is B + C's: that head is another prompt's, a miss left in place
    probe = make()
    resumed = probe.prefill(probe.parse(longer))
    assert resumed.stats.disk_cached_tokens == len(a) + 280 and probe.cache.resume_points.store.counters.bad_files == 0
    assert all(head.exists() for head in heads) and len(heads) == 3


def _conversation(engine: Engine, text: str, tokens: int = 5) -> tuple[list[int], list[int]]:
    """A first turn on ``engine`` (its prompt ids, and the next turn's ids: prompt, output, a question)."""
    prompt = list(engine.parse(text).token_ids)
    reply = engine.generate(list(prompt), max_new_tokens=tokens, ignore_eos=True)
    return prompt, prompt + reply.output_ids + list(engine.parse(" and then?").token_ids)


def test_a_resume_point_is_looked_up_as_its_request_arrives(make: MakeEngine, tmp_path: Path) -> None:
    """``prefetch`` (the loop calls it as a request arrives) reads the resume point in the background;
    the prefill takes what it read: with the files gone meanwhile the request still resumes there,
    with full recompute's logits, and the read ran on a prefetch thread."""
    import threading

    first = make()
    prompt, turn2 = _conversation(first, DOCUMENTS[0] + DOCUMENTS[1])
    first.close()
    restarted = make()
    readers: list[str] = []
    reading = restarted.cache.resume_points.store.disk.reading

    def recorded(address: str):
        readers.append(threading.current_thread().name)
        return reading(address)

    restarted.cache.resume_points.store.disk.reading = recorded
    parts = restarted.parse(turn2)
    restarted.cache.prefetch(restarted.plan(parts))
    (lookup,) = restarted.cache.resume_points.store.prefetches.values()
    lookup.result(timeout=30)
    for path in (tmp_path / "cache").rglob("*.safetensors"):
        path.unlink()
    resumed = restarted.prefill(parts)
    assert resumed.stats.disk_cached_tokens == len(prompt) + 4 and restarted.cache.resume_points.store.prefetches == {}
    assert readers and all(name.startswith("hypic-resume-prefetch") for name in readers)
    assert (resumed.logits - _full_logits(restarted, turn2)).abs().max().item() < 1e-4


def test_a_lookup_prefetched_for_one_key_never_serves_another(make: MakeEngine) -> None:
    """Two keys of one length whose Python hashes are equal (one token raised by 2^61 - 1, which
    ``hash`` of an int reduces away): the lookup prefetched for the conversation's key finds its
    resume point; taking for the other key (whose prefix differs early) finds nothing, and the
    first key still gets its own."""
    first = make()
    prompt, turn2 = _conversation(first, DOCUMENTS[0] + DOCUMENTS[1])
    first.close()
    engine = make()
    plan = engine.plan(engine.parse(turn2))
    tree, namespace, key = plan.policy.tree, plan.policy.namespace, plan.tree_key
    other = [k + (2**61 - 1) if i == 10 else k for i, k in enumerate(key)]
    assert hash(tuple(other)) == hash(tuple(key)) and other != key
    empty = engine.cache.resume_points.empty_state()
    lookup, _ = engine.cache.resume_points.store.prefetch(tree, namespace, key, 0, len(key) - 1, empty)
    assert lookup.result(timeout=30).state.length == len(prompt) + 4
    assert engine.cache.resume_points.store.take(tree, namespace, other, 0, len(other) - 1, empty) is None
    assert engine.cache.resume_points.store.take(tree, namespace, key, 0, len(key) - 1, empty).state.length == len(prompt) + 4


def test_a_prefetched_resume_point_gives_way_to_a_longer_one_memory_made_meanwhile(make: MakeEngine) -> None:
    """Turn 3 arrives while only turn 1's end is on disk (its lookup finds that); turn 2 then ends in
    this engine's memory: turn 3 resumes from memory at turn 2's end, not from the shorter one read."""
    first = make()
    prompt, turn2 = _conversation(first, DOCUMENTS[0] + DOCUMENTS[1])
    first.close()
    reply = make(cache_dir=None).generate(list(turn2), max_new_tokens=5, ignore_eos=True)
    turn3 = turn2 + reply.output_ids + [65, 66]
    engine = make()
    parts = engine.parse(turn3)
    engine.cache.prefetch(engine.plan(parts))
    (lookup,) = engine.cache.resume_points.store.prefetches.values()
    assert lookup.result(timeout=30).state.length == len(prompt) + 4
    engine.generate(list(turn2), max_new_tokens=5, ignore_eos=True)
    resumed = engine.prefill(parts)
    assert resumed.stats.prefix_hit_tokens == resumed.stats.cached_tokens_by_tier["device"] == len(turn2) + 4


def test_write_through_selective_keeps_a_resume_point_once_memory_resumes_from_it(make: MakeEngine,
                                                                                  tmp_path: Path) -> None:
    """Under write_through_selective a request's end is not written when it is made, but when the next
    turn resumes from it in memory; a restarted engine resumes there from the disk."""
    first = make(write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE)
    prompt, turn2 = _conversation(first, DOCUMENTS[0] + DOCUMENTS[1])
    first.cache.resume_points.store.drain()
    assert _resume_files(tmp_path / "cache") == []
    assert first.prefill(first.parse(turn2)).stats.prefix_hit_tokens == len(prompt) + 4
    first.close()
    assert len(_resume_files(tmp_path / "cache")) == 1
    restarted = make()
    resumed = restarted.prefill(restarted.parse(turn2))
    assert resumed.stats.disk_cached_tokens == len(prompt) + 4
    assert (resumed.logits - _full_logits(restarted, turn2)).abs().max().item() < 1e-4


def test_write_back_keeps_a_resume_point_when_memory_evicts_it_and_at_a_stop(tiny_checkpoint: Path,
                                                                             tmp_path: Path) -> None:
    """Under write_back nothing is written while the private pool holds a conversation; when a later
    request makes it evict the conversation's end, that end is written, and another engine on the
    directory resumes there with full recompute's logits; what is still in memory is written at a
    graceful stop."""
    texts = [DOCUMENTS[0] + DOCUMENTS[1], DOCUMENTS[2] + DOCUMENTS[3] + DOCUMENTS[4]]
    sizing = Engine.from_pretrained(tiny_checkpoint)  # the private pool's bytes of the second, then of both
    _conversation(sizing, texts[1])
    alone = sizing.cache.private.nbytes
    _conversation(sizing, texts[0])
    both = sizing.cache.private.nbytes
    tiers = TierOptions(str(tmp_path / "cache"), write_policy=WritePolicy.WRITE_BACK)
    engine = Engine.from_pretrained(tiny_checkpoint, private_pool_bytes=alone + (both - alone) // 2, tiers=tiers)
    prompt, turn2 = _conversation(engine, texts[0])
    engine.cache.resume_points.store.drain()
    assert _resume_files(tmp_path / "cache") == []
    _conversation(engine, texts[1])  # its insertion evicts the first conversation's deepest nodes
    engine.cache.resume_points.store.drain()
    assert engine.cache.private.evictions > 0 and _resume_files(tmp_path / "cache")
    other = Engine.from_pretrained(tiny_checkpoint, tiers=TierOptions(str(tmp_path / "cache")))
    resumed = other.prefill(other.parse(turn2))
    assert resumed.stats.disk_cached_tokens == len(prompt) + 4
    assert (resumed.logits - _full_logits(other, turn2)).abs().max().item() < 1e-4
    other.close()
    before = len(_resume_files(tmp_path / "cache"))
    engine.close()
    assert len(_resume_files(tmp_path / "cache")) > before  # the second conversation's, at the stop


class FakeMooncakeStore:
    """The calls of Mooncake's client that the tier makes, over a dict (what another server puts lands
    in ``objects`` without this tier seeing it)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.batches: list[int] = []  # names asked for in each batched existence check
        self.registered: dict[int, int] = {}  # registered buffers: address -> bytes

    def is_exist(self, key: str) -> int:
        return int(key in self.objects)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.batches.append(len(keys))
        return [int(key in self.objects) for key in keys]

    def get_size(self, key: str) -> int:
        return len(self.objects[key]) if key in self.objects else -704  # Mooncake's OBJECT_NOT_FOUND

    def register_buffer(self, address: int, size: int) -> int:
        self.registered[address] = size
        return 0

    def unregister_buffer(self, address: int) -> int:
        return 0 if self.registered.pop(address, None) is not None else -600

    def batch_get_into(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        """Each object's bytes written at its address, as the transfer engine does: only into a registered
        buffer that holds it (else a negative code, as Mooncake's), the bytes read per key."""
        import ctypes

        answers = []
        for key, address, size in zip(keys, addresses, sizes):
            data = self.objects.get(key)
            inside = any(start <= address and address + size <= start + length
                         for start, length in self.registered.items())
            if data is None or not inside or size < len(data):
                answers.append(-704 if data is None else -600)
                continue
            ctypes.memmove(address, data, len(data))
            answers.append(len(data))
        return answers

    def put(self, key: str, data: bytes) -> int:
        self.objects.setdefault(key, data)  # as the master: a name that exists keeps its first value
        return 0

    def remove(self, key: str) -> int:
        self.objects.pop(key, None)
        return 0

    def remove_by_regex(self, pattern: str) -> int:
        import re

        gone = [key for key in self.objects if re.match(pattern, key)]
        for key in gone:
            del self.objects[key]
        return len(gone)


def test_mooncake_knows_what_this_server_put_or_found_until_it_sees_it_gone() -> None:
    """The scheduler's hint (``indexed``, no I/O): true after a put or a read that found the object,
    false before, after a remove, a namespace's flush, or a read that found it gone (evicted by the
    master); what another server put is unknown until asked."""
    from hypic.cache.tiers.mooncake import PREFIX, MooncakeTier

    tier, store = MooncakeTier("127.0.0.1:50051"), FakeMooncakeStore()
    tier.client = store
    tier.write("shared/a", b"A")
    tier.write("team/b", b"B")
    store.objects[PREFIX + "shared/c"] = b"C"  # another server's
    assert [tier.indexed(a) for a in ("shared/a", "team/b", "shared/c")] == [True, True, False]
    with tier.reading("shared/c") as data:
        assert data == b"C"
    assert tier.indexed("shared/c")
    del store.objects[PREFIX + "shared/a"]  # evicted by the master
    with tier.reading("shared/a") as data:
        assert data is None
    assert not tier.indexed("shared/a")
    tier.flush("team")
    assert not tier.indexed("team/b") and tier.indexed("shared/c")
    tier.remove("shared/c")
    assert not tier.indexed("shared/c") and tier.describe()["known_entries"] == 0


class FlakyTransfers(FakeMooncakeStore):
    """A store whose transfers fail (a timeout, say) while ``failing``; its names answer throughout."""

    failing = False

    def batch_get_into(self, keys: list[str], addresses: list[int], sizes: list[int]) -> list[int]:
        return [-800] * len(keys) if self.failing else super().batch_get_into(keys, addresses, sizes)  # TRANSFER_FAIL


def test_mooncake_reads_into_registered_buffers_kept_between_reads() -> None:
    """Objects come back whole through the zero-copy transfer, which writes only into registered
    memory (the fake refuses any other, as the transfer engine does): one buffer, registered once,
    serves reads one after another and is grown for a larger object; a failed transfer is the tier's
    failure, and its buffer is never handed to another read."""
    from hypic.cache.tiers.mooncake import MooncakeTier, MooncakeUnavailable

    tier, store = MooncakeTier("127.0.0.1:50051"), FlakyTransfers()
    tier.client = store
    small, large = bytes(range(256)) * 1000, bytes(range(255, -1, -1)) * 90_000  # 256 kB, 23 MB
    tier.write("shared/small", small)
    tier.write("shared/large", large)
    for name, expected in (("small", small), ("small", small), ("large", large), ("small", small)):
        with tier.reading(f"shared/{name}") as data:
            assert bytes(data) == expected
    assert len(store.registered) == 2 and tier.describe()["staging_buffers"] == 2  # the first, then a larger one
    with tier.reading("shared/absent") as data:
        assert data is None
    store.failing = True
    with pytest.raises(MooncakeUnavailable, match="-800"):
        with tier.reading("shared/large"):
            pass
    store.failing = False
    for _ in range(2):
        with tier.reading("shared/large") as data:
            assert bytes(data) == large
    status = tier.describe()
    assert status["retired_staging_buffers"] == 1 and len(store.registered) == 3  # a new one for the failed one's work


def _held_connect(monkeypatch: pytest.MonkeyPatch, ends: threading.Event, client: object | None) -> None:
    """Mooncake's connection attempts wait for ``ends``, then connect to ``client`` (None: fail)."""
    from hypic.cache.tiers.mooncake import MooncakeTier

    def setup(tier: MooncakeTier):
        assert ends.wait(30)
        if client is None:
            raise ConnectionError("setup returned -1")
        return client

    monkeypatch.setattr(MooncakeTier, "_setup", setup)


def _mooncake_status(engine: Engine) -> dict:
    return tiers_of(engine).describe()["tiers"]["mooncake"]


@pytest.mark.parametrize("reachable", [False, True])
def test_mooncake_is_connecting_not_unhealthy_until_its_first_attempt_ends(
        make: MakeEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, reachable: bool) -> None:
    """While the first connection is under way the tier is "connecting" (not used, no warning logged);
    once the attempt has failed it is "unhealthy" with the attempt's error, once it has succeeded "healthy"."""
    ends = threading.Event()
    _held_connect(monkeypatch, ends, FakeMooncakeStore() if reachable else None)
    engine = make(cache_dir=None, mooncake_master="127.0.0.1:50051")
    tiers, tier = tiers_of(engine), tiers_of(engine).tiers[0]
    with caplog.at_level("WARNING", logger="hypic.cache.tiers"):
        assert not tiers.usable(tier) and not tiers.ready()
        status = _mooncake_status(engine)
        assert (status["state"], status["healthy"], status["connecting"], status["error"]) == ("connecting", False,
                                                                                              True, "")
        assert caplog.records == []
        ends.set()
        tier.connecting.join(30)
        assert tiers.usable(tier) == reachable
    status = _mooncake_status(engine)
    if reachable:
        assert (status["state"], status["healthy"], status["error"]) == ("healthy", True, "") and caplog.records == []
    else:
        assert (status["state"], status["healthy"], status["connecting"]) == ("unhealthy", False, False)
        assert "setup returned -1" in status["error"] and "setup returned -1" in caplog.text


# ----- the private pool's resume points in Mooncake -------------------------------------------------
@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> FakeMooncakeStore:
    """One store that every engine made with ``mooncake_master`` connects to at once."""
    from hypic.cache.tiers.mooncake import MooncakeTier

    shared = FakeMooncakeStore()
    monkeypatch.setattr(MooncakeTier, "open", lambda tier: setattr(tier, "client", shared))
    return shared


def _server(make: MakeEngine) -> Engine:
    """An engine on the fake master and no disk."""
    return make(cache_dir=None, mooncake_master="127.0.0.1:50051")


def test_resume_points_in_mooncake_are_found_by_markers_in_two_batched_probes(make: MakeEngine,
                                                                             store: FakeMooncakeStore) -> None:
    """Positions come back longest first from the two longest marked blocks past ``after``, each
    found with one probe of the block markers and one of those blocks' positions (closed form)."""
    import numpy as np

    from hypic.cache.tiers.shared_resume import BLOCK

    shared = _server(make).cache.resume_points.store.shared
    hashes = np.arange(1000, 1261, dtype=np.uint64)  # h_0 .. h_260
    for position in (5, 64, 130, 200):
        shared.write("ns", hashes[: position + 1], b"state", [])
    assert shared.positions("ns", hashes, 0) == [200, 130]
    assert store.batches == [len(range(0, 261, BLOCK)), 2 * BLOCK]
    assert shared.positions("ns", hashes, 150) == [200]
    assert shared.positions("ns", hashes[:100], 0) == [64, 5] and shared.positions("ns", hashes, 200) == []
    assert shared.positions("other", hashes, 0) == []


def test_a_conversation_continues_on_another_server_through_mooncake(make: MakeEngine, store: FakeMooncakeStore) -> None:
    """Turn 1 ends on one server; turn 2, sent to another server on the same master, resumes where
    turn 1 ended, with full recompute's logits, counted as Mooncake's tokens; a server without the
    master resumes nowhere."""
    first = _server(make)
    turn1 = first.parse("you are a helpful assistant. " + DOCUMENTS[0] + DOCUMENTS[1])
    reply = first.generate(list(turn1.token_ids), max_new_tokens=6, ignore_eos=True)
    first.cache.resume_points.store.drain()
    turn2 = list(turn1.token_ids) + reply.output_ids + first.parse(" and then?").token_ids
    assert len(turn1.token_ids) > 64
    other = _server(make)
    resumed = other.prefill(other.parse(turn2))
    assert resumed.stats.prefix_hit_tokens == len(turn1.token_ids) + 5
    assert resumed.stats.cached_tokens_by_tier["mooncake"] == len(turn1.token_ids) + 5
    assert (resumed.logits - _full_logits(other, turn2)).abs().max().item() < 1e-4
    assert other.cache.resume_points.store.describe()["hits"] == 1 and first.cache.resume_points.store.describe()["tiers"]["mooncake"]["written"] == 1
    from hypic.server.stats import _resume_lines

    assert "hypic_resume_hits_total 1.0" in _resume_lines(other.cache.resume_points.store.describe())
    assert make(cache_dir=None).prefill(other.parse(turn2)).stats.prefix_hit_tokens == 0


def test_a_system_prompt_resumes_on_another_server_through_mooncake(make: MakeEngine, store: FakeMooncakeStore) -> None:
    """A PIC request's leading part ends in Mooncake; another server's request with the same leading
    part and other documents resumes there, with the logits of a server that never resumed."""
    system = "You answer from the documents only. " * 6
    first = _server(make)
    first.generate(SEP.join([system, DOCUMENTS[0], DOCUMENTS[1], "which fact?"]), max_new_tokens=1)
    first.cache.resume_points.store.drain()
    other = _server(make)
    text = SEP.join([system, DOCUMENTS[2], DOCUMENTS[3], "which other fact?"])
    resumed = other.prefill(other.parse(text))
    assert resumed.stats.prefix_hit_tokens == resumed.stats.cached_tokens_by_tier["mooncake"] == len(other.parse(text).leading)
    fresh = make(cache_dir=None).prefill(other.parse(text))
    assert (resumed.logits - fresh.logits).abs().max().item() < 1e-4


def test_a_damaged_resume_object_or_a_lost_master_is_a_miss(make: MakeEngine, store: FakeMooncakeStore) -> None:
    """A resume object whose bytes were damaged is never resumed from (deleted); a master that stops
    answering makes the next request a miss with the right answer and the tier unhealthy."""
    from hypic.cache.tiers.mooncake import PREFIX

    first = _server(make)
    prompt = first.parse(DOCUMENTS[1]).token_ids
    reply = first.generate(list(prompt), max_new_tokens=4, ignore_eos=True)
    first.cache.resume_points.store.drain()
    turn2 = list(prompt) + reply.output_ids + [65, 66]
    (name,) = [key for key in store.objects if key.startswith(PREFIX) and "/r" in key]
    store.objects[name] = store.objects[name][:-3] + bytes(b ^ 0xFF for b in store.objects[name][-3:])
    other = _server(make)
    resumed = other.prefill(other.parse(turn2))
    assert resumed.stats.prefix_hit_tokens == 0 and name not in store.objects and other.cache.resume_points.store.counters.bad_files == 1
    assert (resumed.logits - _full_logits(other, turn2)).abs().max().item() < 1e-4

    def down(keys: list[str]) -> list[int]:
        raise ConnectionError("master gone")

    third = _server(make)
    store.batch_is_exist = down
    lost = third.prefill(third.parse(turn2))
    assert lost.stats.prefix_hit_tokens == 0 and (lost.logits - resumed.logits).abs().max().item() < 1e-4
    assert not tiers_of(third).describe()["tiers"]["mooncake"]["healthy"]
