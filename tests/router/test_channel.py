"""Entries cut into one flat buffer and back, and sent point-to-point over a gloo group between two
processes: the receiver gets the sender's tensors bit for bit; a refused header, another
generation or a missing sender fail cleanly (the last one breaks the channel)."""
import dataclasses
import multiprocessing
import pathlib
import time

import pytest
import torch

from hypic import Engine
from hypic.router.bulk import ALIGN, buffer_bytes, entry_tensors, header_of, pack, unpack
from hypic.router.channel import BulkChannel, ChannelError, GroupSpec, master_store
from hypic.router.transfer import TransferError, entry_check
from hypic.cache.store import Role, SegmentEntry, with_tensors

TIMEOUT_S = 3.0
REPOSITORY = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained("default")


def _entry(engine: Engine, mode: str = "hypic") -> SegmentEntry:
    ids = tuple(engine.tokenizer.encode("Record 4: the marten of Dunmere was born in 1928 and studied martens."))
    return engine.segment_entry(ids, engine.policy(mode))[0]


def _assert_same(received: SegmentEntry, sent: SegmentEntry) -> None:
    assert (received.key, received.token_ids, received.seams, received.local_start, received.length) == \
           (sent.key, sent.token_ids, sent.seams, sent.local_start, sent.length)
    pairs = list(zip(entry_tensors(received), entry_tensors(sent), strict=True))
    assert pairs and all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in pairs)


@pytest.mark.parametrize("mode", ["hypic", "naive"])
def test_pack_then_unpack_gives_the_entry_back(engine: Engine, mode: str) -> None:
    """Every layer kind (T_C or none for the naive baseline, S_C|0, conv tail, K, V), every dtype."""
    entry = _entry(engine, mode)
    layers = [dataclasses.replace(layer, zero_start_state=layer.zero_start_state.to(torch.bfloat16))
              if hasattr(layer, "zero_start_state") else layer for layer in entry.layers]
    for candidate in (entry, dataclasses.replace(entry, layers=layers)):  # fp32 and a bf16 store
        flat = pack(candidate)
        assert flat.numel() == buffer_bytes(header_of(candidate))
        back = unpack(header_of(candidate), flat.clone())
        _assert_same(back, candidate)
        assert all(t.storage_offset() * t.element_size() % ALIGN == 0 for t in entry_tensors(back))


def test_a_buffer_of_the_wrong_size_is_refused(engine: Engine) -> None:
    entry = _entry(engine)
    with pytest.raises(ValueError, match="bytes"):
        unpack(header_of(entry), pack(entry)[:-ALIGN])


def _sender(port: int, entry: SegmentEntry, parcels: multiprocessing.Queue, done: multiprocessing.Queue) -> None:
    channel = BulkChannel(GroupSpec("127.0.0.1", port, 2, 1, TIMEOUT_S), 1)
    for _ in range(3):
        parcels.put(channel.send(entry, 0))
    done.get(timeout=60)  # the receiver has taken what it will take
    deadline = time.monotonic() + TIMEOUT_S / 2  # sends complete within this, unless never received
    while channel.sends_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    parcels.put((channel.sends_in_flight, channel.broken))
    done.get(timeout=60)  # the receiver's timed-out receive has closed the pair
    channel.ship([entry], 0)  # nobody takes it: refused at once (the entry comes back), or its wait times out
    deadline = time.monotonic() + 2 * TIMEOUT_S
    while not channel.broken and time.monotonic() < deadline:
        time.sleep(0.05)
    parcels.put(channel.broken)


def test_entries_cross_processes_over_gloo(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    # a spawned child imports ``_sender`` by module name; under importlib mode only the parent's sys.path,
    # which the child inherits, can say where ``tests`` lives
    monkeypatch.syspath_prepend(str(REPOSITORY))
    # tensors of its own: an entry in the pool's slots pickles as copies made on the fly, which torch's
    # file-descriptor sharing for a spawned child cannot keep open until the child reads them
    entry = with_tensors(_entry(engine), [t.clone() for t in entry_tensors(_entry(engine))])
    check = entry_check(engine.fingerprint, Role.SEGMENT, engine.model.config)
    store = master_store("127.0.0.1", 30)
    context = multiprocessing.get_context("spawn")
    parcels, done = context.Queue(), context.Queue()
    sender = context.Process(target=_sender, args=(store.port, entry, parcels, done))
    sender.start()
    try:
        channel = BulkChannel(GroupSpec("127.0.0.1", store.port, 2, 1, TIMEOUT_S), 0)
        first, second, third = (parcels.get(timeout=60) for _ in range(3))
        assert first.source == 1 and len({first.tag, second.tag, third.tag}) == 3
        _assert_same(channel.receive(first, check), entry)
        with pytest.raises(TransferError, match="does not address"):  # a forged header: refused, its bytes drained
            channel.receive(dataclasses.replace(second, header=dataclasses.replace(second.header, token_ids=(1, 2))), check)
        _assert_same(channel.receive(third, check), entry)
        done.put(True)
        assert parcels.get(timeout=60) == (0, False)  # every send completed: the refused one's bytes were drained too
        with pytest.raises(ChannelError, match="generation"):
            channel.receive(dataclasses.replace(third, generation=2), check)
        assert not channel.broken
        with pytest.raises(ChannelError, match="failed"):  # nobody sends this tag: timeout
            channel.receive(dataclasses.replace(third, tag=10_000), check)
        assert channel.broken
        with pytest.raises(ChannelError, match="broken"):
            channel.receive(first, check)
        done.put(True)
        assert parcels.get(timeout=60) is True  # the sender's end knows too: it ships by the object store
    finally:
        done.put(True)
        sender.join(timeout=30)
        if sender.is_alive():
            sender.kill()

