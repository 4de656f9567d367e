"""The masked attention path (sliding windows, sinks) against a per-query loop of the formula
out_i = sum_j e^(s_ij) v_j / (e^(sink_h) + sum_j e^(s_ij)) over the keys i - W < p_j <= p_i."""
import pytest
import torch

from hypic.models import attention
from hypic.models.attention import masked_attention


def _naive(query: torch.Tensor, query_positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           key_positions: torch.Tensor, scale: float, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    heads, group = query.shape[1], query.shape[1] // keys.shape[0]
    rows = []
    for i, at in enumerate(query_positions.tolist()):
        out = []
        for h in range(heads):
            seen = [j for j, p in enumerate(key_positions.tolist()) if p <= at and (window is None or p > at - window)]
            scores = torch.stack([(query[i, h] @ keys[h // group, j]) * scale for j in seen])
            weights = scores.exp()
            total = weights.sum() + (sinks[h].exp() if sinks is not None else 0.0)
            out.append(sum(w * values[h // group, j] for w, j in zip(weights, seen)) / total)
        rows.append(torch.cat(out))
    return torch.stack(rows)


@pytest.mark.parametrize("window, with_sinks", [(None, True), (5, False), (5, True), (1, True)])
@pytest.mark.parametrize("budget", [None, 40])  # 40 scores: a block of one query, many blocks
def test_masked_attention_matches_the_formula(monkeypatch: pytest.MonkeyPatch, window: int | None, with_sinks: bool,
                                              budget: int | None) -> None:
    if budget is not None:
        monkeypatch.setattr(attention, "SCORE_BUDGET", budget)
        monkeypatch.setattr(attention, "QUERY_BLOCK", 3)
    torch.manual_seed(0)
    heads, kv_heads, dk, dv = 4, 2, 8, 6
    key_positions = torch.tensor([0, 1, 2, 3, 4, 5, 9, 10, 11, 12, 13, 20, 21, 22])  # gaps: splices cut to their window
    query_positions = torch.tensor([3, 4, 5, 12, 13, 21, 22])  # runs of recompute tokens
    keys, values = torch.randn(kv_heads, len(key_positions), dk), torch.randn(kv_heads, len(key_positions), dv)
    query = torch.randn(len(query_positions), heads, dk)
    sinks = torch.randn(heads) if with_sinks else None
    ours = masked_attention(query, query_positions.tolist(), keys, values, key_positions.tolist(), 0.3, window, sinks)
    expected = _naive(query, query_positions, keys, values, key_positions, 0.3, window, sinks)
    assert torch.allclose(ours, expected, atol=1e-5)
    shuffled = torch.randperm(len(key_positions))  # key order does not matter (decode reads a ring in slot order)
    again = masked_attention(query, query_positions.tolist(), keys[:, shuffled], values[:, shuffled],
                             key_positions[shuffled].tolist(), 0.3, window, sinks)
    assert torch.allclose(again, expected, atol=1e-5)


def test_causal_attention_in_runs_matches_the_formula() -> None:
    """Runs of queries that start past the first key (a seam after cached documents, a single decode
    token, a run from position 0): each query sees the keys up to its own position."""
    torch.manual_seed(0)
    runs = [(0, 3), (5, 4), (9, 1), (4, 2)]
    positions = torch.tensor([first + i for first, run in runs for i in range(run)])
    query, keys, values = torch.randn(len(positions), 4, 8), torch.randn(2, 10, 8), torch.randn(2, 10, 8)
    got = attention.causal_attention(query, runs, keys, values, 0.3)
    expected = _naive(query, positions, keys, values, torch.arange(10), 0.3, None, None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups, budget, made", [(1, 1 << 20, 1), (2, 1 << 20, 2), (4, 1 << 20, 3), (4, 60, 4)])
def test_runs_attending_in_groups_match_the_formula(groups: int, budget: int, made: int) -> None:
    """Many runs attending together in masked groups (``attention_groups``: by run count, and more
    groups where a mask would pass its budget) see exactly the keys up to their own positions."""
    torch.manual_seed(1)
    runs = [(0, 3), (5, 4), (12, 2), (15, 1), (20, 5)]
    positions = torch.tensor([first + i for first, run in runs for i in range(run)])
    query, keys, values = torch.randn(len(positions), 4, 8), torch.randn(2, 25, 8), torch.randn(2, 25, 8)
    found = attention.attention_groups(runs, torch.float32, torch.device("cpu"), budget=budget, groups=groups)
    assert len(found) == made  # runs of 5: 3 a group for 2 groups, 2 for 4; the budget splits (0-8) and (5-9) off
    assert [g.lo for g in found] == [0, *(g.hi for g in found[:-1])] and found[-1].hi == len(positions)
    got = attention.causal_attention(query, runs, keys, values, 0.3, found)
    expected = _naive(query, positions, keys, values, torch.arange(25), 0.3, None, None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
