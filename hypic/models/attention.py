"""Full attention: Qwen3-Next / Qwen3.5's gated form (q/k RMSNorm, partial rotary, sigmoid output
gate), or without gate and q/k norms (``config.attention_output_gate`` False: MiniMax), or with q/k
norms and no gate (``config.attention_qk_norm``: Ring-linear)."""
import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel.sharding import FirstRank, Rule, Split
from .norm import RMSNorm
from .rope import RotaryEmbedding


@dataclass
class AttentionInputs:
    """Per-token projections of one full-attention layer for N tokens."""

    query: torch.Tensor  # [N, Hq, D], rotated
    key: torch.Tensor  # [N, Hkv, D], rotated
    value: torch.Tensor  # [N, Hkv, D]
    gate: torch.Tensor | None  # [N, Hq * D]; None without an output gate


@dataclass(frozen=True)
class AttentionGroup:
    """Query rows lo..hi-1 (runs of a pass, consecutive in it) that attend in one call over the keys
    at positions 0..end-1, masked by ``mask`` [hi - lo, end] (added to the scores: -inf where a key
    lies after its query's position)."""

    lo: int
    hi: int
    end: int
    mask: torch.Tensor


MASK_BUDGET = 1 << 23  # most elements of one group's mask (16 MiB in bfloat16): longer contexts take more groups
GROUPS = 4  # groups the runs of a pass attend in: each scores only the keys up to its last run's end


def attention_groups(runs: list[tuple[int, int]], dtype: torch.dtype, device: torch.device,
                     budget: int = MASK_BUDGET, groups: int = GROUPS) -> list[AttentionGroup]:
    """Runs (first position, length), in order, cut into about ``groups`` groups of as many runs (a
    group's queries score only the keys up to its end, so later keys are not scored for earlier
    seams: with 4 groups about 5/8 of one group's scores), more where a group's mask would pass
    ``budget`` elements; each group's additive mask (made once per pass: every full-attention layer
    reads it)."""
    size = max(1, -(-len(runs) // groups))
    found, start, rows = [], 0, 0
    for number, (_, length) in enumerate(runs):
        rows += length
        following = runs[number + 1] if number + 1 < len(runs) else None
        if following is None or number + 1 - start >= size or (rows + following[1]) * sum(following) > budget:
            found.append(_group(runs, start, number + 1, dtype, device))
            start, rows = number + 1, 0
    return found


def _group(runs: list[tuple[int, int]], first: int, last: int, dtype: torch.dtype, device: torch.device) -> AttentionGroup:
    lo = sum(n for _, n in runs[:first])
    positions = [p for start, n in runs[first:last] for p in range(start, start + n)]
    end = runs[last - 1][0] + runs[last - 1][1]
    later = torch.arange(end)[None, :] > torch.tensor(positions)[:, None]
    mask = torch.zeros(len(positions), end, dtype=dtype).masked_fill_(later, float("-inf")).to(device)
    return AttentionGroup(lo, lo + len(positions), end, mask)


def causal_attention(query: torch.Tensor, runs: list[tuple[int, int]], keys: torch.Tensor, values: torch.Tensor,
                     scale: float, groups: list[AttentionGroup] | None = None) -> torch.Tensor:
    """query [N, Hq, Dk] in runs of consecutive positions, each given as (first position, length)
    (host integers: no device sync); keys [Hkv, T, Dk], values [Hkv, T, Dv] at positions 0..T-1. Each
    query sees the keys at positions <= its own: one causal (lower-right aligned) attention per run
    over the keys up to its end, or with ``groups`` (``attention_groups`` of these runs) one masked
    attention per group. Returns [N, Hq * Dv]; GQA groups share their K/V without copies."""
    if groups is not None and len(runs) > 1:
        return _grouped_attention(query, groups, keys, values, scale)
    outputs, lo = [], 0
    for first, run in runs:
        end = first + run
        q = query[lo : lo + run].transpose(0, 1)[None]
        mask = lower_right_mask(run, end, query.device) if run > 1 else None
        out = F.scaled_dot_product_attention(q, keys[None, :, :end], values[None, :, :end], attn_mask=mask,
                                             scale=scale, enable_gqa=query.shape[1] != keys.shape[0])
        outputs.append(out[0].transpose(0, 1))
        lo += run
    return torch.cat(outputs).reshape(query.shape[0], -1)


def _grouped_attention(query: torch.Tensor, groups: list[AttentionGroup], keys: torch.Tensor, values: torch.Tensor,
                       scale: float) -> torch.Tensor:
    outputs = []
    for group in groups:
        q = query[group.lo : group.hi].transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(q, keys[None, :, : group.end], values[None, :, : group.end],
                                             attn_mask=group.mask.to(q.dtype), scale=scale,
                                             enable_gqa=query.shape[1] != keys.shape[0])
        outputs.append(out[0].transpose(0, 1))
    return (torch.cat(outputs) if len(outputs) > 1 else outputs[0]).reshape(query.shape[0], -1)


def lower_right_mask(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """The causal mask of ``queries`` positions ending at the last of ``keys``. On CUDA, torch's
    ``CausalBias`` (a tensor subclass), which its flash kernel applies without a mask in memory; elsewhere the boolean
    mask it would build. Imported here: the module registers itself with torch's compiler, whose
    import takes over a second of every process's start."""
    if device.type == "cuda":
        from torch.nn.attention.bias import causal_lower_right
        return causal_lower_right(queries, keys)
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)


QUERY_BLOCK = 512  # queries per block of the masked path when a window bounds the keys it scores
SCORE_BUDGET = 1 << 24  # most fp32 scores [Hq, block, T] one block of the masked path holds (64 MiB)


def masked_attention(query: torch.Tensor, query_positions: Sequence[int], keys: torch.Tensor, values: torch.Tensor,
                     key_positions: Sequence[int], scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """query [N, Hq, Dk] at positions [N]; keys [Hkv, T, Dk] and values [Hkv, T, Dv] at positions [T]
    (any order; both given as host integers, so nothing is read back from the device). A query at i
    sees the keys at j <= i, and j > i - window with a window; ``sinks`` [Hq]: a learned logit per
    head that joins every softmax with a zero value (gpt-oss). Scores in fp32. Returns
    [N, Hq * Dv]. With a window and ascending key positions, each block of queries only scores the
    keys its windows reach; blocks are sized so their scores stay within ``SCORE_BUDGET`` (full
    layers with sinks over a long context: few queries per block)."""
    group = query.shape[1] // keys.shape[0]
    k = keys.float().repeat_interleave(group, 0).transpose(1, 2)
    v = values.float().repeat_interleave(group, 0)
    queries_at = torch.tensor(list(query_positions), dtype=torch.long).to(query.device)
    keys_at = torch.tensor(list(key_positions), dtype=torch.long).to(query.device)
    ascending = window is not None and all(a < b for a, b in itertools.pairwise(key_positions))
    reach = min(keys.shape[1], window + QUERY_BLOCK) if ascending else keys.shape[1]  # keys one block scores
    block = max(1, min(QUERY_BLOCK, SCORE_BUDGET // max(1, query.shape[1] * reach)))
    outputs = []
    for lo, hi in _query_blocks(query_positions, block):
        at = queries_at[lo:hi, None]
        first, last = 0, k.shape[-1]
        if ascending:
            assert window is not None
            first = bisect.bisect_left(key_positions, min(query_positions[lo:hi]) - window + 1)
            last = bisect.bisect_right(key_positions, max(query_positions[lo:hi]))
        q, seen = query[lo:hi].transpose(0, 1).float(), keys_at[first:last]
        allowed = seen[None] <= at
        if window is not None:
            allowed &= seen[None] > at - window
        scores = (q @ k[..., first:last] * scale).masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            scores = torch.cat([scores, sinks.float()[:, None, None].expand(-1, q.shape[1], 1)], dim=-1)
        probs = torch.softmax(scores, dim=-1)
        outputs.append((probs[..., : last - first] @ v[:, first:last]).transpose(0, 1))
    return torch.cat(outputs).reshape(query.shape[0], -1).to(query.dtype)


def _query_blocks(positions: Sequence[int], size: int) -> list[tuple[int, int]]:
    """Row ranges of at most ``size`` queries, cut where positions stop being consecutive (a seam run
    ends): each block's windows then cover one stretch of keys."""
    breaks = [i + 1 for i, (a, b) in enumerate(itertools.pairwise(positions)) if b != a + 1]
    blocks = []
    for lo, hi in zip([0, *breaks], [*breaks, len(positions)]):
        blocks += [(start, min(start + size, hi)) for start in range(lo, hi, size)]
    return blocks


class GatedAttention(nn.Module):
    """The attention token mixer (full or sliding-window, ``window``); attention itself runs over
    caller-assembled KV."""

    def __init__(self, config: ModelConfig, index: int = 0) -> None:
        super().__init__()
        hidden, heads, dim = config.hidden_size, config.num_attention_heads, config.head_dim
        kv_heads, value_dim = config.kv_heads(index), config.attention_value_dim
        self.heads, self.kv_heads, self.head_dim, self.value_dim = heads, kv_heads, dim, value_dim
        self.gated = config.attention_output_gate
        self.scale = dim**-0.5 if config.attention_scale is None else config.attention_scale
        self.window, self.value_scale = config.window(index), config.value_scale
        self.q_proj = nn.Linear(hidden, heads * dim * (2 if self.gated else 1), bias=config.attention_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * value_dim, bias=config.attention_bias)
        output_bias = config.attention_bias if config.output_bias is None else config.output_bias
        self.o_proj = nn.Linear(heads * value_dim, hidden, bias=output_bias)
        self.qk_norm = self.gated if config.attention_qk_norm is None else config.attention_qk_norm
        if self.qk_norm:  # zero-centred like the decoder's norms (Qwen), or plain (Ring-linear)
            self.q_norm = RMSNorm(dim, config.rms_norm_eps, config.rms_norm_unit_offset)
            self.k_norm = RMSNorm(dim, config.rms_norm_eps, config.rms_norm_unit_offset)
        if config.layer_types[index] in config.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(heads))
        self.whole_heads = (config.whole.num_attention_heads, config.whole.kv_heads(index))

    def tp_rules(self) -> dict[str, Rule]:
        """Query heads (with their gates) and KV heads cut (KV heads fewer than the ranks: replicated),
        sinks per query head, the output projection's columns by query head; its bias added once."""
        (heads, kv_heads), dim = self.whole_heads, self.head_dim
        query, key, value = (Split(0, ((heads, dim * (2 if self.gated else 1)),)), Split(0, ((kv_heads, dim),)),
                             Split(0, ((kv_heads, self.value_dim),)))
        rules: dict[str, Rule] = {"q_proj.weight": query, "q_proj.bias": query, "k_proj.weight": key,
                                  "k_proj.bias": key, "v_proj.weight": value, "v_proj.bias": value,
                                  "o_proj.weight": Split(1, ((heads, self.value_dim),)), "o_proj.bias": FirstRank(),
                                  "sinks": Split(0, ((heads, 1),))}
        return rules

    @property
    def positional(self) -> bool:
        """Whether attention needs the masked path (a window or sinks) rather than causal SDPA."""
        return self.window is not None or hasattr(self, "sinks")

    def attend_at(self, query: torch.Tensor, query_positions: Sequence[int], keys: torch.Tensor, values: torch.Tensor,
                  key_positions: Sequence[int]) -> torch.Tensor:
        """``masked_attention`` with this layer's scale, window and sinks: [N, Hq, D] -> [N, Hq * Dv]."""
        return masked_attention(query, query_positions, keys, values, key_positions, self.scale, self.window,
                                getattr(self, "sinks", None))

    def project(self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> AttentionInputs:
        """x [N, hidden] at global positions [N] -> rotated q, k, v and the output gate."""
        n = x.shape[0]
        key, value = self.k_proj(x).view(n, self.kv_heads, self.head_dim), self.v_proj(x).view(n, self.kv_heads, self.value_dim)
        if self.value_scale != 1.0:
            value = value * self.value_scale
        gate = None
        if self.gated:
            query, gate = self.q_proj(x).view(n, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(n, -1)
        else:
            query = self.q_proj(x).view(n, self.heads, self.head_dim)
        if self.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        return AttentionInputs(rope.apply(query, positions), rope.apply(key, positions), value, gate)

    def attend(self, query: torch.Tensor, runs: list[tuple[int, int]], keys: torch.Tensor,
               values: torch.Tensor, groups: list[AttentionGroup] | None = None) -> torch.Tensor:
        """``causal_attention`` with this layer's scale over keys at positions 0..T-1: [N, Hq, D] -> [N, Hq * Dv]
        (the masked path when the layer has sinks)."""
        if self.positional:
            positions = [p for first, run in runs for p in range(first, first + run)]
            return self.attend_at(query, positions, keys, values, range(keys.shape[1]))
        return causal_attention(query, runs, keys, values, self.scale, groups)

    def output(self, attended: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        return self.o_proj(attended if gate is None else attended * torch.sigmoid(gate))
