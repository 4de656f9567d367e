"""The chain of affine maps a combine pass runs (``run_chain``) and each family's chunk maps against
token-by-token oracles: ``naive_chain`` (S = T S + B element by element, T formed in full) and each
family's naive recurrence."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from hypic.cache.composition import Family, Transition, stacked_values
from hypic.kernels.affine_chain import AffineMaps, ChainStep, MapViews, naive_chain, run_chain
from hypic.kernels.diagonal_gla import KERNELS as DIAGONAL
from hypic.kernels.gated_delta import KERNELS as GATED_DELTA
from hypic.kernels.kimi_delta import KERNELS as KIMI_DELTA
from hypic.kernels.scalar_gla import KERNELS as SCALAR

HEADS, KEY, VALUE, CHUNK = 3, 6, 5, 4


def _maps(kind: str, count: int, gen: torch.Generator) -> AffineMaps:
    """``count`` random maps of one kind, fp32, T's entries well inside (-1, 1)."""
    offsets = torch.randn(count, HEADS, KEY, VALUE, generator=gen)
    if kind == "scalar":
        return AffineMaps(offsets, scale=torch.rand(count, HEADS, generator=gen))
    if kind == "diagonal":
        return AffineMaps(offsets, scale=torch.rand(count, HEADS, KEY, generator=gen))
    if kind == "dense":
        return AffineMaps(offsets, dense=0.4 * torch.randn(count, HEADS, KEY, KEY, generator=gen))
    left, right = (0.4 * torch.randn(count, HEADS, *shape, generator=gen) for shape in ((KEY, CHUNK), (CHUNK, KEY)))
    return AffineMaps(scale=torch.rand(count, HEADS, generator=gen), left=left, right=right,
                      values=torch.randn(count, HEADS, CHUNK, VALUE, generator=gen))


def _in_order(kinds: list[str]) -> tuple[list[ChainStep], int]:
    """Two chains end to end: start, then units (u) and splices (s) alternating as ``kinds`` say,
    each state into a row of its own ("other"); returns the steps and the rows used."""
    steps, row, counters = [], 0, {"unit": 0, "splice": 0}
    for chain in range(2):
        steps.append(ChainStep("start", chain, None, ("other", row)))
        for kind in kinds:
            family = "unit" if kind == "u" else "splice" if kind == "s" else "add"
            index = counters["splice" if family == "add" else family]
            counters["splice" if family == "add" else family] += 1
            steps.append(ChainStep(family, index, ("other", row), ("other", row + 1)))
            row += 1
        row += 1
    return steps, row


def _oracle(steps: list[ChainStep], starts: torch.Tensor, units: AffineMaps, splices: AffineMaps) -> torch.Tensor:
    """The same chains by ``naive_chain``: a start is a zero map, an added splice the identity."""
    eye = {"dense": torch.eye(KEY).expand(HEADS, KEY, KEY)}
    maps, offsets = [], []
    for step in steps:
        if step.family == "start":
            maps.append(torch.zeros(HEADS, KEY, KEY))
            offsets.append(starts[step.index])
            continue
        source = units if step.family == "unit" else splices
        full = source.full()[step.index]
        full = torch.diag_embed(full[:, None].expand(HEADS, KEY) if full.dim() == 1 else full) if full.dim() < 3 else full
        maps.append(eye["dense"] if step.family == "add" else full)
        offsets.append(source.zero_states()[step.index])
    return naive_chain(torch.stack(maps), torch.stack(offsets))


@pytest.mark.parametrize("unit_kind, splice_kind", [("scalar", "scalar"), ("diagonal", "diagonal"),
                                                    ("low_rank", "dense"), ("dense", "dense")])
def test_the_chain_equals_the_element_by_element_oracle(unit_kind: str, splice_kind: str) -> None:
    """Units and splices of every structure, two requests' chains end to end, and splices composed
    by addition (naive): each state the chain writes is the oracle's to fp32 round-off."""
    gen = torch.Generator().manual_seed(3)
    kinds = ["u", "s", "u", "u", "a", "s", "u"]
    steps, rows = _in_order(kinds)
    units, splices = _maps(unit_kind, 8, gen), _maps(splice_kind, 6, gen)
    starts = torch.randn(2, HEADS, KEY, VALUE, generator=gen)
    buffers = {"other": torch.empty(rows, HEADS, KEY, VALUE)}
    run_chain(steps, starts, units, splices.views(), buffers)
    expected = _oracle(steps, starts, units, splices)
    written = torch.stack([buffers["other"][step.target[1]] for step in steps])
    torch.testing.assert_close(written, expected, atol=1e-5, rtol=1e-5)


def test_the_chain_is_per_head_as_tensor_parallel_shards_are() -> None:
    """A shard's heads chained alone give those heads of the whole chain (nothing mixes heads)."""
    gen = torch.Generator().manual_seed(4)
    steps, rows = _in_order(["u", "s", "u"])
    units, splices = _maps("low_rank", 4, gen), _maps("dense", 2, gen)
    starts = torch.randn(2, HEADS, KEY, VALUE, generator=gen)
    whole = {"other": torch.empty(rows, HEADS, KEY, VALUE)}
    run_chain(steps, starts, units, splices.views(), whole)
    heads = slice(1, 3)
    shard_units = AffineMaps(scale=units.scale[:, heads], left=units.left[:, heads], right=units.right[:, heads],
                             values=units.values[:, heads])
    shard = {"other": torch.empty(rows, 2, KEY, VALUE)}
    run_chain(steps, starts[:, heads].contiguous(), shard_units,
              AffineMaps(splices.offsets[:, heads], dense=splices.dense[:, heads]).views(), shard)
    torch.testing.assert_close(shard["other"], whole["other"][:, heads], atol=1e-6, rtol=1e-6)


def test_decayed_heads_stack_as_zero_matrices() -> None:
    """Transitions with flagged (decayed) heads stack into full values, those heads zero, as the
    chain reads them."""
    gen = torch.Generator().manual_seed(5)
    full = [torch.randn(HEADS, KEY, KEY, generator=gen) for _ in range(3)]
    full[1][0] = 0
    full[2][[0, 2]] = 0
    transitions = [Transition(Family.DENSE, t).without_decayed() for t in full]
    assert [t.decayed_heads for t in transitions] == [0, 1, 2]
    torch.testing.assert_close(stacked_values(transitions), torch.stack(full))
    views = MapViews([torch.zeros(HEADS, KEY, VALUE)] * 3, dense=stacked_values(transitions).unbind(0))
    state, out = torch.randn(HEADS, KEY, VALUE, generator=gen), torch.empty(HEADS, KEY, VALUE)
    views.apply_into(2, state, out)
    torch.testing.assert_close(out, full[2] @ state)
    gone = Transition(Family.DENSE, torch.zeros(HEADS, KEY, KEY)).without_decayed()  # every head decayed
    torch.testing.assert_close(stacked_values([gone, gone]), torch.zeros(2, HEADS, KEY, KEY))


# ----- each family's chunk maps ------------------------------------------------------------------------
def _inputs(family: str, steps: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    q = torch.randn(steps, HEADS, KEY, generator=gen)
    k = F.normalize(torch.randn(steps, HEADS, KEY, generator=gen), dim=-1)
    v = torch.randn(steps, HEADS, VALUE, generator=gen)
    per_key = family in ("diagonal", "kimi_delta")
    g = -torch.rand(steps, HEADS, *((KEY,) if per_key else ()), generator=gen)
    rest = (torch.rand(steps, HEADS, generator=gen),) if family in ("gated_delta", "kimi_delta") else ()
    return (q, k, v, g, *rest)


def _chunks(x: torch.Tensor, runs: list[int], size: int) -> torch.Tensor:
    """Runs laid end to end in x [T, H, ...] as chunks [N, H, size, ...], each run's last zero-padded."""
    pieces, first = [], 0
    for length in runs:
        for lo in range(first, first + length, size):
            part = x[lo : min(lo + size, first + length)]
            pieces.append(F.pad(part, (0, 0) * (x.dim() - 1) + (0, size - part.shape[0])))
        first += length
    return torch.stack(pieces).transpose(1, 2)


@pytest.mark.parametrize("family, kernels", [("gated_delta", GATED_DELTA), ("kimi_delta", KIMI_DELTA),
                                             ("scalar", SCALAR), ("diagonal", DIAGONAL)])
def test_chunk_maps_chained_equal_the_token_loop(family: str, kernels: object) -> None:
    """Three runs (of 9, 4 and 1 tokens) cut into padded chunks of 4: each run's chunks chained from
    its own initial state give the token loop's outputs and final state."""
    gen = torch.Generator().manual_seed(6)
    runs = [9, 4, 1]
    inputs, initial = _inputs(family, sum(runs), gen), torch.randn(len(runs), HEADS, KEY, VALUE, generator=gen)
    scale = kernels.scale(KEY)
    maps = kernels.chunk_maps(*(_chunks(x, runs, CHUNK) for x in inputs), scale=scale)
    counts = [-(-n // CHUNK) for n in runs]
    steps, entering, row, chunk = [], [], 0, 0
    for run, count in enumerate(counts):
        steps.append(ChainStep("start", run, None, ("other", row)))
        for _ in range(count):
            entering.append(row)
            steps.append(ChainStep("unit", chunk, ("other", row), ("other", row + 1)))
            row, chunk = row + 1, chunk + 1
        row += 1
    buffers = {"other": torch.empty(row, HEADS, KEY, VALUE)}
    run_chain(steps, initial, maps.maps, None, buffers)
    outputs = maps.zero_outputs + maps.entry_queries @ buffers["other"][entering]
    outputs = outputs.transpose(1, 2)
    ends = list(itertools.accumulate([0, *runs]))
    for run, (lo, hi) in enumerate(itertools.pairwise(ends)):
        expected, final = kernels.naive(*(x[lo:hi] for x in inputs), initial[run], scale)
        first = sum(counts[:run])
        got = outputs[first : first + counts[run]].flatten(0, 1)[: hi - lo]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(buffers["other"][entering[first + counts[run] - 1] + 1], final, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family, kernels", [("gated_delta", GATED_DELTA), ("kimi_delta", KIMI_DELTA),
                                             ("scalar", SCALAR), ("diagonal", DIAGONAL)])
def test_prefix_maps_give_the_state_inside_a_chunk(family: str, kernels: object) -> None:
    """The maps of a chunk's first n tokens (``prefixes``), applied to the state entering the chunk,
    give the token loop's state after those n tokens, for every n short of the chunk's length."""
    gen = torch.Generator().manual_seed(7)
    inputs, initial = _inputs(family, 2 * CHUNK, gen), torch.randn(2, HEADS, KEY, VALUE, generator=gen)
    lengths = list(range(1, CHUNK))
    chunks = torch.tensor([n % 2 for n in lengths])  # prefixes of both chunks, each from its own state
    maps = kernels.chunk_maps(*(_chunks(x, [CHUNK, CHUNK], CHUNK) for x in inputs), scale=kernels.scale(KEY),
                              prefixes=(chunks, torch.tensor(lengths)))
    states = maps.prefix_maps.apply(initial[chunks].clone())
    for state, chunk, length in zip(states, chunks.tolist(), lengths):
        lo = chunk * CHUNK
        _, expected = kernels.naive(*(x[lo : lo + length] for x in inputs), initial[chunk], kernels.scale(KEY))
        torch.testing.assert_close(state, expected, atol=1e-5, rtol=1e-5)
