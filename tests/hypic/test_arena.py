"""The pools' arenas (their preallocated memory): slots taken and given back by reference count, poisoned when
free, reused; slabs grown and released. Oracles: the tensors copied in, closed-form slot counts, NaN
poisoning. (The private pool's readers against slot reuse: test_zero_copy.py.)"""
import threading

import pytest
import torch

from hypic.cache.arena import Arena, Field, PageArenas, size_classes


def _arena(slab_slots: int = 4) -> Arena:
    fields = (Field((2, 3), torch.float32), Field((5,), torch.float16))
    return Arena(fields, torch.device("cpu"), slab_bytes=slab_slots * (2 * 3 * 4 + 5 * 2))


def test_a_slot_given_back_is_poisoned_and_reused() -> None:
    arena = _arena()
    slot = arena.take()
    number, (a, b) = slot.number, slot.views()
    a.fill_(1.0), b.fill_(2.0)
    assert arena.used == 1
    del slot
    assert arena.used == 0 and torch.isnan(a[:, 0]).all() and torch.isnan(b[0])  # every row of a stale view has a NaN
    assert (a @ torch.ones(3)).isnan().all()  # and so has anything computed from a row
    again = arena.take()
    assert again.number == number  # the freed slot, not a new one


def test_slabs_grow_when_full_and_go_back_when_wholly_free() -> None:
    arena = _arena(slab_slots=4)
    slots = [arena.take() for _ in range(9)]
    assert arena.slab_slots == 4 and arena.reserved_bytes == 3 * 4 * arena.slot_bytes
    assert len({s.number for s in slots}) == 9
    freed = slots.pop(1).number  # a slot of the full first slab
    again = arena.take()
    assert again.number == freed and arena.reserved_bytes == 3 * 4 * arena.slot_bytes  # the lowest slab with room
    slots.insert(1, again)
    del again
    del slots[4:8]  # the second slab's four slots
    assert arena.used == 5 and arena.reserved_bytes == 2 * 4 * arena.slot_bytes
    del slots[:]
    assert arena.used == 0 and arena.reserved_bytes == 4 * arena.slot_bytes  # the last slab stays


def test_slots_given_back_on_other_threads_are_counted_once() -> None:
    arena = _arena(slab_slots=8)
    batches = [[arena.take() for _ in range(50)] for _ in range(4)]
    threads = [threading.Thread(target=batch.clear) for batch in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert arena.used == 0 and arena.reserved_bytes == 8 * arena.slot_bytes


def test_a_short_page_takes_the_smallest_class_it_fits() -> None:
    assert size_classes(128) == (16, 32, 64, 128) and size_classes(2) == (1, 2)
    arenas = PageArenas(page_tokens=128)
    keys, values = torch.randn(2, 17, 8), torch.randn(2, 17, 4)
    page = arenas.page(keys, values)
    assert torch.equal(page[0], keys) and torch.equal(page[1], values)
    assert page.nbytes == 32 * 2 * (8 + 4) * 4  # a 32-row slot: K and V of 2 heads
    with pytest.raises(ValueError):
        arenas.page(torch.randn(2, 129, 8), torch.randn(2, 129, 4))
