"""A document fetched from the pool of the replica that holds it, as ``--dp-size`` replicas do, is the
entry that replica built, not built again: shipped as Ray ships it (tensors as numpy arrays), checked
and lent to the request here, it equals the entry this engine would build, tensor for tensor, and the
answer of a request that splices it equals one engine's that built every document itself."""
import copyreg
import io
import pickle
from pathlib import Path

import pytest
import torch

from hypic import DEFAULT_SEPARATOR, Engine
from hypic.assembler import drain
from hypic.cache.modes import Mode
from hypic.cache.store import entry_tensors
from hypic.router.plan import SegmentJob
from hypic.router.serialization import tensor_from_array, tensor_to_array
from hypic.router.transfer import keep_copies, lend_entries
from hypic.router.worker import document_build_steps

DOCUMENT = "Record 7: the heron of Welby was born in 1949 and studied herons near the river of Welby each spring."
PROMPT = DEFAULT_SEPARATOR.join(["Answer from the record.", DOCUMENT, "Question: where was the heron born?"])


def _shipped(entries: list) -> list:
    """``entries`` through pickle with tensors as numpy arrays (Ray's object store, as the replicas
    register it)."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer)
    pickler.dispatch_table = copyreg.dispatch_table.copy()
    pickler.dispatch_table[torch.Tensor] = lambda t: (tensor_from_array, (tensor_to_array(t),))
    pickler.dump(entries)
    return pickle.loads(buffer.getvalue())


def _engines(checkpoint: Path, room: bool) -> tuple[Engine, Engine, Engine, str, tuple[int, ...]]:
    """A holder whose pool holds ``DOCUMENT``, an engine here (whose pool has room for it or holds
    one byte), an oracle that builds everything itself, and the document's key and ids."""
    holder = Engine.from_pretrained(checkpoint, seam_width=4)
    here = Engine.from_pretrained(checkpoint, seam_width=4, public_pool_bytes=None if room else 1)
    oracle = Engine.from_pretrained(checkpoint, seam_width=4)
    holder.warmup([DOCUMENT])
    ids = tuple(holder.tokenizer.encode(DOCUMENT))
    return holder, here, oracle, holder.cache.document_key(ids, holder.policy("hypic")), ids


@pytest.mark.parametrize("room", [True, False], ids=["kept", "lent"])
def test_a_fetched_document_equals_the_one_built_here_and_answers_alike(tiny_checkpoint: Path, room: bool) -> None:
    """The holder's pool serves the entry (no build); here it is kept if the pool has room beside what
    it holds, else lent to the request only and gone from memory once returned."""
    holder, here, oracle, key, ids = _engines(tiny_checkpoint, room)
    built: list = []
    holder.prefiller.document_steps = lambda *a, **k: built.append(a)  # type: ignore[method-assign]
    fetched = _shipped(drain(document_build_steps(holder, [SegmentJob(key, ids, "")], Mode.HYPIC, keep=False)))
    assert built == []  # served from the holder's pool
    lent = lend_entries(here, fetched, Mode.HYPIC)
    assert lent == ([] if room else [key])
    entry, tier = here.cache.match_document(key, ids, "")
    assert tier == ("device" if room else "replica")
    rebuilt = drain(oracle.prefiller.document_steps(key, ids, oracle.policy("hypic"), keep=False))
    for got, want in zip(entry_tensors(entry), entry_tensors(rebuilt), strict=True):
        assert torch.equal(got, want)
    here.cache.unpin([key])
    answer = here.generate(PROMPT, max_new_tokens=6)
    assert answer.output_ids == oracle.generate(PROMPT, max_new_tokens=6).output_ids and answer.segments_missed == 0
    here.cache.return_documents(lent)
    assert here.cache.match_document(key, ids, "")[0] is (entry if room else None)


@pytest.mark.parametrize("room", [True, False], ids=["room", "full"])
def test_a_hot_documents_copy_made_ahead_of_need_is_kept_only_where_it_fits(tiny_checkpoint: Path, room: bool) -> None:
    """A copy of a document the holder's pool serves, shipped as Ray ships it: kept in a pool with room
    (a later request splices it, answering as an engine that built it) and, in a full pool, not
    kept at all (a copy ahead of need evicts nothing)."""
    holder, here, oracle, key, ids = _engines(tiny_checkpoint, room)
    sent = _shipped(drain(document_build_steps(holder, [SegmentJob(key, ids, "")], Mode.HYPIC, keep=False)))
    assert keep_copies(here, sent, Mode.HYPIC) == ([key] if room else [])
    assert (key in here.cache.document_keys()) == room
    answer = here.generate(PROMPT, max_new_tokens=6)
    assert answer.output_ids == oracle.generate(PROMPT, max_new_tokens=6).output_ids
    assert answer.segments_missed == (0 if room else 1)
