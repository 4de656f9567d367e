"""A prompt head (a shared system prompt) that another replica's private pool holds, sent as
``--dp-size`` replicas send it: shipped as Ray ships it, checked and kept in this pool, from which
the request then resumes exactly as it would from a head this engine had computed itself."""
from pathlib import Path

import pytest
import torch

from hypic import Engine
from hypic.assembler import drain
from hypic.cache.entry_check import EntryMismatch
from hypic.state import AttentionLayerState

from .test_fetch import _shipped

SYSTEM = ("You are the archivist of Welby. Answer from the parish records, name the record you used, and say "
          "so when the records do not know. ") * 4


def _engine(checkpoint: Path) -> Engine:
    return Engine.from_pretrained(checkpoint, snapshot_interval=32)


def _prefill(engine: Engine, prompt: str):  # noqa: ANN202 - the engine's Prefill
    return drain(engine.prefiller.prefill_steps(_plan(engine, prompt)))


def _plan(engine: Engine, prompt: str):  # noqa: ANN202 - the engine's RequestPlan
    return engine.plan(engine.parse(prompt))


def test_a_head_sent_from_another_pool_is_resumed_from_as_one_computed_here(tiny_checkpoint: Path) -> None:
    """The sender served one question under the system prompt; the head it sends for another is a
    whole number of snapshot intervals within their common tokens. Kept here, the second question
    resumes from it and gives the logits of an engine that served both questions itself, bit for
    bit, though the sender's pool was flushed and refilled before the state was shipped."""
    sender, here, oracle = _engine(tiny_checkpoint), _engine(tiny_checkpoint), _engine(tiny_checkpoint)
    first, second = SYSTEM + "Question: who kept the mill?", SYSTEM + "Question: when did the river flood?"
    _prefill(sender, first), _prefill(oracle, first)
    common = next(i for i, (a, b) in enumerate(zip(sender.tokenizer.encode(first), sender.tokenizer.encode(second)))
                  if a != b)
    sent = sender.cache.lend_prefix(_plan(sender, second))
    assert sent is not None and common - 32 < sent.length <= common
    sender.cache.flush()
    _prefill(sender, "Another head altogether, long enough to take the pages again. " * 12)
    received = _shipped([sent])[0]
    assert here.cache.install_prefix(_plan(here, second), received) == sent.length
    got, want = _prefill(here, second), _prefill(oracle, second)
    assert got.stats.prefix_hit_tokens == want.stats.prefix_hit_tokens == sent.length
    assert torch.equal(got.logits, want.logits)


def test_a_head_of_another_prompt_is_refused_before_anything_is_kept(tiny_checkpoint: Path) -> None:
    """A state whose tokens are not a head of the request's prompt (or of another model's shapes) is
    refused, and the pool keeps nothing of it."""
    sender, here = _engine(tiny_checkpoint), _engine(tiny_checkpoint)
    _prefill(sender, SYSTEM + "Question: who kept the mill?")
    sent = sender.cache.lend_prefix(_plan(sender, SYSTEM + "Question: when did the river flood?"))
    assert sent is not None
    with pytest.raises(EntryMismatch, match="not a head"):
        here.cache.install_prefix(_plan(here, "A different system prompt. " * 20 + "Question?"), sent)
    attention = next(i for i, layer in enumerate(sent.layers) if isinstance(layer, AttentionLayerState))
    sent.layers[0], sent.layers[attention] = sent.layers[attention], sent.layers[0]
    with pytest.raises(EntryMismatch, match="layer"):
        here.cache.install_prefix(_plan(here, SYSTEM + "Question: when did the river flood?"), sent)
    assert len(here.cache.private) == 0


def test_nothing_is_sent_for_a_prompt_whose_head_the_pool_does_not_hold(tiny_checkpoint: Path) -> None:
    sender = _engine(tiny_checkpoint)
    _prefill(sender, SYSTEM + "Question: who kept the mill?")
    assert sender.cache.lend_prefix(_plan(sender, "Nothing like it. " * 20)) is None
