"""A plain-PyTorch Qwen3.5 / Qwen3-Next / MiniMax / Granite-4.0-H / Kimi-Linear / Nemotron-H / gpt-oss /
MiMo-V2-Flash / Ring-linear forward with a token-loop recurrence: clarity over speed.

``run`` feeds a run of new tokens through every layer, continuing a ``ReferenceState``: token-wise
maps (projections, norms, MLP/MoE) act on the run's rows at once, the gated delta rule is a
loop over tokens, attention is an explicit softmax over every key so far (a sliding-window layer
keeps every key too and masks those out of its window). ``absorb`` appends
tokens whose per-layer inputs were computed elsewhere (nothing of them is recomputed): that is
how the HYPIC reference splices cached segment interiors.
"""
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .checkpoint import RefConfig, read_config, read_tensors


@dataclass
class LinearInputs:
    """What n tokens feed a Gated DeltaNet layer: pre-conv channels and recurrence inputs."""

    pre_conv: torch.Tensor  # [n, C]
    k: torch.Tensor  # [n, Hv, K] l2-normalised, key heads repeated to the value heads (Lightning: silu(W x))
    v: torch.Tensor  # [n, Hv, V]
    g: torch.Tensor  # [n, Hv] log decay (GLA, KDA: [n, Hv, K], per key channel)
    beta: torch.Tensor | None  # [n, Hv] (Lightning: None, no delta rule)

    def rows(self, lo: int, hi: int) -> "LinearInputs":
        return LinearInputs(*(None if x is None else x[lo:hi] for x in (self.pre_conv, self.k, self.v, self.g, self.beta)))


@dataclass
class AttentionInputs:
    """What n tokens feed an attention layer (full or sliding-window): keys before RoPE and values."""

    key: torch.Tensor  # [n, Hkv, D] after k_norm, not rotated (nor scaled by YaRN's attention factor)
    value: torch.Tensor  # [n, Hkv, Dv] as cached (MiMo-V2-Flash: times attention_value_scale)

    def rows(self, lo: int, hi: int) -> "AttentionInputs":
        return AttentionInputs(self.key[lo:hi], self.value[lo:hi])


LayerInputs = list[LinearInputs | AttentionInputs]  # one entry per layer
ATTENTION_KINDS = ("full_attention", "sliding_attention")  # layer_types of attention layers


@dataclass
class LinearMemory:
    state: torch.Tensor  # [Hv, K, V]
    conv_tail: torch.Tensor  # [k-1, C] the last k-1 pre-conv inputs (zeros before the first token)


@dataclass
class AttentionMemory:
    keys: torch.Tensor  # [T, Hkv, D] rotated at each token's position; every token, even out of a sliding window
    values: torch.Tensor  # [T, Hkv, Dv]


@dataclass
class ReferenceState:
    """Everything the model remembers after ``length`` tokens."""

    layers: list[LinearMemory | AttentionMemory]
    length: int = 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm of the decoder: x / rms(x) * (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


def rotate_channels(x: torch.Tensor, angles: torch.Tensor, rd: int, factor: float = 1.0) -> torch.Tensor:
    """Row i of x [n, H, D] rotated by angles[i] [rd / 2] on its first rd channels (rotate-half pairs), those
    channels also multiplied by ``factor`` (YaRN's attention factor, folded into cos and sin)."""
    cos, sin = (factor * angles.cos()).repeat(1, 2)[:, None], (factor * angles.sin()).repeat(1, 2)[:, None]
    rot, rest = x[..., :rd], x[..., rd:]
    half = torch.cat([-rot[..., rd // 2 :], rot[..., : rd // 2]], dim=-1)
    return torch.cat([rot * cos + half * sin, rest], dim=-1)


def rotate_interleaved_tail(x: torch.Tensor, angles: torch.Tensor, rd: int) -> torch.Tensor:
    """DeepSeek's MLA RoPE on the last rd channels of x [n, H, D]: pair (2i, 2i + 1) turned by angles[:, i],
    written out as [turned evens | turned odds] (as transformers leaves them; queries and keys alike)."""
    even, odd = x[..., -rd::2], x[..., -rd + 1 :: 2]
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    return torch.cat([x[..., :-rd], even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def inverse_frequencies(theta: float, rd: int) -> torch.Tensor:
    """RoPE's 1 / theta^(2i / rd), i < rd / 2."""
    return 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd)


def yarn_frequencies(yarn: dict, theta: float, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss): inverse frequencies [dim / 2] ramping linearly, over the channels between the correction
    dims of beta_fast and beta_slow rotations in the original context, from RoPE's (fast channels, kept) to
    RoPE's / factor (slow channels, interpolated); and the attention factor that multiplies cos and sin."""
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:  # the channel pair turning that often in the original context
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(yarn.get("beta_fast") or 32), correction_dim(yarn.get("beta_slow") or 1)
    if yarn.get("truncate", True):  # transformers' default when the key is missing
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    base = inverse_frequencies(theta, dim)
    assert not yarn.get("mscale_all_dim"), "DeepSeek's variant of the attention factor is not modelled"
    attention = yarn.get("attention_factor") or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return base / factor * ramp + base * (1 - ramp), attention


def c_is_native(config: RefConfig) -> bool:
    """Our own model type: parameters named as in ``hypic.models`` (``layers.N.mixer.*``)."""
    return config.model_type == "hypic_hybrid"


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """MiniMax's RMSNorm: w * x / rms(x)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class ReferenceModel:
    """Weights of a checkpoint directory and the forward over them, in fp32."""

    def __init__(self, path: str | Path) -> None:
        self.config: RefConfig = read_config(Path(path))
        self.w = read_tensors(Path(path))
        c = self.config
        # per attention-layer kind: (inverse frequencies [rd / 2], rotary dim rd, factor on cos and sin)
        kinds = c.rope_by_kind or {kind: (c.rope_theta, c.rotary_dim) for kind in ATTENTION_KINDS}
        self.rope = {kind: (inverse_frequencies(theta, rd), rd, 1.0) for kind, (theta, rd) in kinds.items()}
        if c.yarn is not None:  # gpt-oss: one YaRN table for both kinds
            inv_freq, factor = yarn_frequencies(c.yarn, c.rope_theta, c.rotary_dim)
            self.rope = {kind: (inv_freq, c.rotary_dim, factor) for kind in self.rope}

    def empty_state(self) -> ReferenceState:
        c = self.config
        channels = 2 * c.key_heads * c.key_dim + c.value_heads * c.value_dim

        def attention(kind: str) -> AttentionMemory:  # MiMo's sliding layers have more KV heads
            heads, value_dim = c.kv_heads_of(kind), c.value_head_dim or c.head_dim
            return AttentionMemory(torch.zeros(0, heads, c.head_dim), torch.zeros(0, heads, value_dim))

        return ReferenceState([
            LinearMemory(torch.zeros(c.value_heads, c.key_dim, c.value_dim), torch.zeros(c.conv_kernel - 1, channels))
            if kind == "linear_attention" else attention(kind) for kind in c.layer_types])

    # ----- runs of tokens ------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, state: ReferenceState, tokens: list[int]) -> tuple[torch.Tensor, LayerInputs]:
        """Feed ``tokens`` (at positions state.length, ...) through every layer, updating ``state``.
        Returns logits [n, vocab] and the inputs the tokens fed each layer."""
        positions = torch.arange(state.length, state.length + len(tokens))
        if self.config.nemotron_blocks:
            return self._nemotron_run(state, tokens, positions)
        x, fed = self.w["embed_tokens.weight"][tokens] * self._granite("embedding"), []
        for index, memory in enumerate(state.layers):
            h = self._norm(x, f"layers.{index}.input_layernorm.weight")
            if isinstance(memory, LinearMemory) and self.config.ring is not None:
                mixed, inputs = self._ring_linear(index, h, positions, memory)
            elif isinstance(memory, LinearMemory) and self.config.kimi is not None:
                mixed, inputs = self._kda(index, h, memory)
            elif isinstance(memory, LinearMemory) and self.config.family == "gla":
                mixed, inputs = self._gla(index, h, memory)
            elif isinstance(memory, LinearMemory) and self.config.family == "scalar_rope":
                mixed, inputs = self._scalar_rope(index, h, positions, memory)
            elif isinstance(memory, LinearMemory) and self.config.granite is not None:
                mixed, inputs = self._mamba2(index, h, memory)
            elif isinstance(memory, LinearMemory):
                mixed, inputs = self._lightning(index, h, memory) if self.config.lightning else self._linear(index, h, memory)
            else:
                mixed, inputs = self._attention(index, h, positions, memory, kind=self.config.layer_types[index])
            fed.append(inputs)
            x = self._residual(x, h, mixed, "linear_attn" if isinstance(memory, LinearMemory) else "full_attn")
            post = self._norm(x, f"layers.{index}.post_attention_layernorm.weight")
            x = self._residual(x, post, self._feed_forward(index, post), "mlp")
        state.length += len(tokens)
        return self._norm(x, "norm.weight") @ self.w["lm_head.weight"].T / self._granite("logits"), fed

    def _nemotron_run(self, state: ReferenceState, tokens: list[int],
                      positions: torch.Tensor) -> tuple[torch.Tensor, LayerInputs]:
        """Nemotron-H: block b is x + f_b(norm_b(x)), f_b a Mamba2 mixer, attention (no RoPE), a
        squared-ReLU MLP or a MoE; the mixers own the memories, in order."""
        x, fed, memories = self.w["embeddings.weight"][tokens], [], iter(state.layers)
        for block, kind in enumerate(self.config.nemotron_blocks):
            h, prefix = self._norm(x, f"layers.{block}.norm.weight"), f"layers.{block}.mixer."
            if kind == "linear_attention":
                out, inputs = self._mamba2(block, h, next(memories), prefix)
            elif kind == "full_attention":
                out, inputs = self._attention(block, h, positions, next(memories), prefix)
            else:
                out, inputs = self._relu2_moe(prefix, h) if kind == "moe" else self._relu2(prefix, h), None
            fed += [] if inputs is None else [inputs]
            x = x + out
        state.length += len(tokens)
        return self._norm(x, "norm_f.weight") @ self.w["lm_head.weight"].T, fed

    def _granite(self, name: str) -> float:
        """Granite's multiplier ``name`` (1 for the other models)."""
        return 1.0 if self.config.granite is None else self.config.granite[name]

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        c = self.config
        plain = c.lightning or c.granite is not None or c.kimi is not None or bool(c.nemotron_blocks) or c.plain_norm
        norm = plain_rms_norm if plain else rms_norm
        return norm(x, self.w[name], self.config.eps)

    def _residual(self, x: torch.Tensor, normed: torch.Tensor, out: torch.Tensor, kind: str) -> torch.Tensor:
        """Pre-norm: x + m out (m = 1 but in Granite). MiniMax: alpha * normed + beta * out, the factors of
        the sublayer's kind."""
        if self.config.scales is None:
            return x + self._granite("residual") * out
        return self.config.scales[f"{kind}_alpha_factor"] * normed + self.config.scales[f"{kind}_beta_factor"] * out

    @torch.inference_mode()
    def absorb(self, state: ReferenceState, frozen: LayerInputs) -> None:
        """Append tokens whose per-layer inputs are given: each layer only takes them into its
        memory (the recurrence over their k, v, g, beta; keys rotated at their new positions)."""
        n = frozen[0].value.shape[0] if isinstance(frozen[0], AttentionInputs) else frozen[0].k.shape[0]
        positions = torch.arange(state.length, state.length + n)
        for memory, inputs, kind in zip(state.layers, frozen, self.config.layer_types):
            if isinstance(memory, LinearMemory):
                assert isinstance(inputs, LinearInputs)
                rotates = self.config.family == "scalar_rope" or self.config.ring is not None
                keys = self._rotate_linear(inputs.k, positions) if rotates else inputs.k
                for t in range(n):
                    if inputs.beta is None:
                        self._decay_update(memory, keys[t], inputs.v[t], inputs.g[t])
                    else:
                        self._delta_update(memory, inputs.k[t], inputs.v[t], inputs.g[t], inputs.beta[t])
                memory.conv_tail = torch.cat([memory.conv_tail, inputs.pre_conv])[n:]
            else:
                assert isinstance(inputs, AttentionInputs)  # sliding layers too: the mask hides a key out of the window
                memory.keys = torch.cat([memory.keys, self._rotate(inputs.key, positions, kind)])
                memory.values = torch.cat([memory.values, inputs.value])
        state.length += n

    # ----- Gated DeltaNet ------------------------------------------------------------------
    def _linear_projections(self, index: int, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(pre-conv [n, q | k | v], z [n, Hv, V], b [n, Hv], a [n, Hv]) in either checkpoint layout."""
        c, p, n = self.config, f"layers.{index}.linear_attn.", h.shape[0]
        if p + "in_proj_qkv.weight" in self.w:  # Qwen3.5: separate projections
            z = (h @ self.w[p + "in_proj_z.weight"].T).view(n, c.value_heads, c.value_dim)
            return h @ self.w[p + "in_proj_qkv.weight"].T, z, h @ self.w[p + "in_proj_b.weight"].T, h @ self.w[p + "in_proj_a.weight"].T
        ratio = c.value_heads // c.key_heads  # Qwen3-Next: q, k, v, z (and b, a) grouped per key head
        q, k, v, z = (h @ self.w[p + "in_proj_qkvz.weight"].T).view(n, c.key_heads, -1).split(
            [c.key_dim, c.key_dim, ratio * c.value_dim, ratio * c.value_dim], dim=-1)
        b, a = (h @ self.w[p + "in_proj_ba.weight"].T).view(n, c.key_heads, -1).split([ratio, ratio], dim=-1)
        pre_conv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=-1)
        return pre_conv, z.reshape(n, c.value_heads, c.value_dim), b.flatten(1), a.flatten(1)

    def _linear(self, index: int, h: torch.Tensor, memory: LinearMemory) -> tuple[torch.Tensor, LinearInputs]:
        c, p, n = self.config, f"layers.{index}.linear_attn.", h.shape[0]
        pre_conv, z, b, a = self._linear_projections(index, h)
        post = self._convolve(memory, pre_conv, self.w[p + "conv1d.weight"][:, 0])
        q, k, v = post.split([c.key_heads * c.key_dim, c.key_heads * c.key_dim, c.value_heads * c.value_dim], dim=-1)
        ratio = c.value_heads // c.key_heads
        q = l2_normalize(q.view(n, c.key_heads, c.key_dim)).repeat_interleave(ratio, 1)
        k = l2_normalize(k.view(n, c.key_heads, c.key_dim)).repeat_interleave(ratio, 1)
        g = -self.w[p + "A_log"].exp() * F.softplus(a + self.w[p + "dt_bias"])
        inputs = LinearInputs(pre_conv, k, v.view(n, c.value_heads, c.value_dim), g, torch.sigmoid(b))
        o = self._delta_scan(memory, q * c.key_dim**-0.5, inputs)
        normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c.eps) * self.w[p + "norm.weight"]
        return (normed * F.silu(z)).flatten(1) @ self.w[p + "out_proj.weight"].T, inputs

    @staticmethod
    def _convolve(memory: LinearMemory, pre_conv: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
        """Causal depthwise conv (weight [C, k]) + SiLU over the conv tail and ``pre_conv`` [n, C];
        the tail keeps the last k - 1 inputs."""
        n, kernel = pre_conv.shape[0], weight.shape[1]
        window = torch.cat([memory.conv_tail, pre_conv])  # row j: the input of token j - (k-1)
        out = sum(weight[:, j] * window[j : j + n] for j in range(kernel))
        memory.conv_tail = window[n:]
        return F.silu(out if bias is None else out + bias)

    def _decay_scan(self, memory: LinearMemory, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    g: torch.Tensor) -> torch.Tensor:
        """Token by token S <- diag(exp(g_t)) S + k_t v_t^T, then q_t^T S per head: outputs [n, H, V]."""
        outputs = []
        for t in range(q.shape[0]):
            self._decay_update(memory, k[t], v[t], g[t])
            outputs.append((q[t, :, None, :] @ memory.state)[:, 0])
        return torch.stack(outputs)

    def _delta_scan(self, memory: LinearMemory, q: torch.Tensor, inputs: LinearInputs) -> torch.Tensor:
        """Token by token the delta rule (``_delta_update``), then q_t^T S per head: outputs [n, H, V]."""
        outputs = []
        for t in range(q.shape[0]):
            self._delta_update(memory, inputs.k[t], inputs.v[t], inputs.g[t], inputs.beta[t])
            outputs.append((q[t, :, None, :] @ memory.state)[:, 0])
        return torch.stack(outputs)

    @staticmethod
    def _delta_update(memory: LinearMemory, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> None:
        """One token (k [Hv, K], v [Hv, V], beta [Hv], g [Hv] or per key channel [Hv, K]):
        S <- (I - beta k k^T) diag(exp(g)) S + beta k v^T (a scalar g commutes with the projector)."""
        s = memory.state * (g.exp()[:, None, None] if g.dim() == 1 else g.exp()[:, :, None])
        recalled = (k[:, None, :] @ s)[:, 0]  # k^T S per head
        memory.state = s + k[:, :, None] * (beta[:, None] * (v - recalled))[:, None, :]

    # ----- Kimi Delta Attention (Kimi-Linear) ------------------------------------------------
    def _kda(self, index: int, h: torch.Tensor, memory: LinearMemory) -> tuple[torch.Tensor, LinearInputs]:
        """conv + SiLU over [q | k | v] (three projections); the delta rule with a log decay per key channel
        g = -exp(A_log) softplus(f_b f_a x + dt_bias); o = K^-1/2 q^T S per head; RMS norm per head times
        sigmoid(g_b g_a x); the output projection."""
        c, p, n = self.config, f"layers.{index}.self_attn.", h.shape[0]
        pre = torch.cat([h @ self.w[p + f"{name}_proj.weight"].T for name in "qkv"], dim=-1)
        conv = torch.cat([self.w[p + f"{name}_conv1d.weight"][:, 0] for name in "qkv"])  # one conv per input
        q, k, v = self._convolve(memory, pre, conv).chunk(3, dim=-1)
        q, k, v = (x.reshape(n, c.value_heads, c.key_dim) for x in (q, k, v))
        g, z = self._kda_gates(p, h)
        inputs = LinearInputs(pre, l2_normalize(k), v, g, torch.sigmoid(h @ self.w[p + "b_proj.weight"].T))
        o = self._delta_scan(memory, l2_normalize(q) * c.key_dim**-0.5, inputs)
        normed = plain_rms_norm(o, self.w[p + "o_norm.weight"], c.eps) * torch.sigmoid(z)
        return normed.flatten(1) @ self.w[p + "o_proj.weight"].T, inputs

    def _kda_gates(self, p: str, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(log decay g [n, H, K], output gate logits [n, H, V]). Kimi-Linear: g = -exp(A_log) softplus(f + dt_bias)
        with f through the rank-K f_a, f_b and the gate through g_a, g_b. Bailing: full-rank f_proj and g_proj,
        and g = lower_bound sigmoid(exp(A_log) (f + dt_bias)) when the config bounds it."""
        c, n = self.config, h.shape[0]
        shape = (n, c.value_heads, c.key_dim)
        rate = self.w[p + "A_log"].exp().view(1, -1, 1)
        if c.bailing is None:
            f = (h @ self.w[p + "f_a_proj.weight"].T @ self.w[p + "f_b_proj.weight"].T + self.w[p + "dt_bias"]).view(shape)
            return -rate * F.softplus(f), (h @ self.w[p + "g_a_proj.weight"].T @ self.w[p + "g_b_proj.weight"].T).view(shape)
        f = (h @ self.w[p + "f_proj.weight"].T + self.w[p + "dt_bias"]).view(shape)
        bound = c.bailing["lower_bound"]
        g = -rate * F.softplus(f) if bound is None else bound * torch.sigmoid(rate * f)
        return g, (h @ self.w[p + "g_proj.weight"].T).view(shape)

    def _latent_attention(self, index: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Kimi-Linear's MLA without RoPE: query [n, H, nope + rope]; key [n, H, nope + rope] = [per-head part
        from the normalised latent | one part shared by the heads]; value [n, H, v] from the same latent."""
        c, p, n, m = self.config, f"layers.{index}.self_attn.", h.shape[0], self.config.kimi
        if p + "q_a_proj.weight" in self.w:  # low-rank query through a normalised latent
            q_latent = plain_rms_norm(h @ self.w[p + "q_a_proj.weight"].T, self.w[p + "q_a_layernorm.weight"], 1e-6)
            query = (q_latent @ self.w[p + "q_b_proj.weight"].T).view(n, c.heads, c.head_dim)
        else:
            query = (h @ self.w[p + "q_proj.weight"].T).view(n, c.heads, c.head_dim)
        latent, shared = (h @ self.w[p + "kv_a_proj_with_mqa.weight"].T).split([m["kv_lora_rank"], m["rope"]], dim=-1)
        expanded = plain_rms_norm(latent, self.w[p + "kv_a_layernorm.weight"], 1e-6) @ self.w[p + "kv_b_proj.weight"].T
        nope, value = expanded.view(n, c.heads, m["nope"] + m["value"]).split([m["nope"], m["value"]], dim=-1)
        return query, torch.cat([nope, shared[:, None].expand(-1, c.heads, -1)], dim=-1), value

    def _head_gate(self, p: str, h: torch.Tensor) -> torch.Tensor | None:
        """Bailing's MLA output gate: one logit per head [n, H], laid over the head's value channels [n, H * v]."""
        if self.config.bailing is None:
            return None
        per_head = h @ self.w[p + "g_proj.weight"].T
        return per_head.repeat_interleave(self.config.kimi["value"], dim=1)

    # ----- our own families (hypic_hybrid) ---------------------------------------------------
    def _gla(self, index: int, h: torch.Tensor, memory: LinearMemory) -> tuple[torch.Tensor, LinearInputs]:
        """conv + SiLU over [q | k | v]; S <- diag(exp(g)) S + k v^T with g = logsigmoid(W_g x) / 16 per
        key channel; o = K^-1/2 q^T S; Gated DeltaNet's output norm."""
        c, p, n = self.config, f"layers.{index}.mixer.", h.shape[0]
        pre = h @ self.w[p + "in_proj_qkv.weight"].T
        post = self._convolve(memory, pre, self.w[p + "conv_weight"])
        keys = c.value_heads * c.key_dim
        q, k, v = post.split([keys, keys, c.value_heads * c.value_dim], dim=-1)
        q, k = q.view(n, c.value_heads, c.key_dim) * c.key_dim**-0.5, k.view(n, c.value_heads, c.key_dim)
        g = F.logsigmoid(h @ self.w[p + "in_proj_g.weight"].T).view(n, c.value_heads, c.key_dim) / 16
        inputs = LinearInputs(pre, k, v.view(n, c.value_heads, c.value_dim), g, None)
        o = self._decay_scan(memory, q, inputs.k, inputs.v, g)
        z = (h @ self.w[p + "in_proj_z.weight"].T).view(n, c.value_heads, c.value_dim)
        normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c.eps) * self.w[p + "norm.weight"]
        return (normed * F.silu(z)).flatten(1) @ self.w[p + "out_proj.weight"].T, inputs

    def _rotate_linear(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE of the linear heads: row i of x [n, H, D] at positions[i] on the first linear_rotary_dim channels."""
        rd = self.config.linear_rotary_dim
        inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd)
        return rotate_channels(x, positions.float()[:, None] * inv_freq[None], rd)

    def _scalar_rope(self, index: int, h: torch.Tensor, positions: torch.Tensor,
                     memory: LinearMemory) -> tuple[torch.Tensor, LinearInputs]:
        """Lightning's layer with q and k rotated at their absolute positions inside the state:
        S <- exp(-s) S + R(t) k v^T, o = D^-1/2 (R(t) q)^T S. The inputs keep k unrotated (a spliced
        token's k is rotated where it lands, as an attention key is)."""
        c, p, n = self.config, f"layers.{index}.mixer.", h.shape[0]
        pre = h @ self.w[p + "qkv_proj.weight"].T
        q, k, v = F.silu(pre).view(n, c.value_heads, 3 * c.value_dim).split(c.value_dim, dim=-1)
        inputs = LinearInputs(pre, k, v, -self._slopes(index, c.value_heads).expand(n, -1), None)
        q, k = self._rotate_linear(q, positions) * c.value_dim**-0.5, self._rotate_linear(k, positions)
        o = self._decay_scan(memory, q, k, v, inputs.g).flatten(1)
        gate = torch.sigmoid(h @ self.w[p + "output_gate.weight"].T)
        return (gate * rms_norm(o, self.w[p + "norm.weight"], 1e-6)) @ self.w[p + "out_proj.weight"].T, inputs

    # ----- Ring-linear (bailing_moe_linear) ----------------------------------------------------
    def _ring_qkv(self, p: str, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A softmax layer's fused projection [Q (H D) | K (Hkv D) | V (Hkv D)]; q and k RMS-normed per head."""
        c, n = self.config, h.shape[0]
        q, k, v = (h @ self.w[p + "query_key_value.weight"].T).split(
            [c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], dim=-1)
        q = plain_rms_norm(q.view(n, c.heads, c.head_dim), self.w[p + "query_layernorm.weight"], c.eps)
        k = plain_rms_norm(k.view(n, c.kv_heads, c.head_dim), self.w[p + "key_layernorm.weight"], c.eps)
        return q, k, v.view(n, c.kv_heads, c.head_dim)

    def _ring_slopes(self, index: int) -> torch.Tensor:
        """Decay rate per head: ALiBi's slopes (start^1 .. start^H with start = 2^(-2^-(log2 H - 3)) for H a power
        of two; else the power of two below's, then every other slope of twice it), times 1 - l / (L - 1) + 1e-5
        for layer l of L (SGLang's Bailing backend; the vendor's transformers code has l - 1 there)."""
        def alibi(n: int) -> list[float]:
            if math.log2(n).is_integer():
                start = 2 ** (-(2 ** -(math.log2(n) - 3)))
                return [start * start**i for i in range(n)]
            below = 2 ** math.floor(math.log2(n))
            return alibi(below) + alibi(2 * below)[0::2][: n - below]

        layers = len(self.config.layer_types)
        depth = 1 - index / (layers - 1) + 1e-5 if layers > 1 else 1 + 1e-5
        return torch.tensor(alibi(self.config.heads), dtype=torch.float32) * depth

    def _ring_linear(self, index: int, h: torch.Tensor, positions: torch.Tensor,
                     memory: LinearMemory) -> tuple[torch.Tensor, LinearInputs]:
        """[Q | K | V] = W x, no activation; q and k RMS-normed per head, then rotated at their positions;
        S <- exp(-s) S + k v^T, o = D^-1/2 q^T S per head; o RMS-normed per group of heads (g_norm);
        sigmoid(g_proj x) * o; the dense projection. The inputs keep k normed but unrotated."""
        c, p, n = self.config, f"layers.{index}.attention.", h.shape[0]
        pre = h @ self.w[p + "query_key_value.weight"].T
        q, k, v = pre.view(n, 3, c.heads, c.head_dim).unbind(1)
        q = plain_rms_norm(q, self.w[p + "query_layernorm.weight"], c.eps)
        k = plain_rms_norm(k, self.w[p + "key_layernorm.weight"], c.eps)
        inputs = LinearInputs(pre, k, v, -self._ring_slopes(index).expand(n, -1), None)
        q, k = self._rotate_linear(q, positions) * c.head_dim**-0.5, self._rotate_linear(k, positions)
        o = self._decay_scan(memory, q, k, v, inputs.g).reshape(n, c.ring["groups"], -1)
        normed = (o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + c.eps)).flatten(1) * self.w[p + "g_norm.weight"]
        gate = torch.sigmoid(h @ self.w[p + "g_proj.weight"].T)
        return (gate * normed) @ self.w[p + "dense.weight"].T, inputs

    # ----- Mamba2 (Granite-4.0-H) -------------------------------------------------------------
    def _mamba2(self, index: int, h: torch.Tensor, memory: LinearMemory,
                prefix: str | None = None) -> tuple[torch.Tensor, LinearInputs]:
        """conv(+bias) and SiLU over [x | B | C]; per head S <- exp(dt A) S + B (dt x)^T, y = C^T S + D x;
        then y * silu(z), RMS-normalised per group of heads, and the output projection."""
        c, p, n = self.config, prefix or f"layers.{index}.mamba.", h.shape[0]
        inner, grouped = c.value_heads * c.value_dim, c.key_heads * c.key_dim
        z, pre_conv, dt = (h @ self.w[p + "in_proj.weight"].T).split([inner, inner + 2 * grouped, c.value_heads], -1)
        post = self._convolve(memory, pre_conv, self.w[p + "conv1d.weight"][:, 0], self.w[p + "conv1d.bias"])
        x, b, cc = post.split([inner, grouped, grouped], dim=-1)
        x = x.view(n, c.value_heads, c.value_dim)
        ratio = c.value_heads // c.key_heads
        b = b.view(n, c.key_heads, c.key_dim).repeat_interleave(ratio, 1)
        cc = cc.view(n, c.key_heads, c.key_dim).repeat_interleave(ratio, 1)
        dt = F.softplus(dt + self.w[p + "dt_bias"]).clamp(*c.dt_limit)
        inputs = LinearInputs(pre_conv, b, x * dt[..., None], -self.w[p + "A_log"].exp() * dt, None)
        y = self._decay_scan(memory, cc, inputs.k, inputs.v, inputs.g) + self.w[p + "D"][:, None] * x
        y = (y.flatten(1) * F.silu(z)).view(n, c.key_heads, -1)
        y = (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + c.eps)).flatten(1) * self.w[p + "norm.weight"]
        return y @ self.w[p + "out_proj.weight"].T, inputs

    # ----- Lightning attention (MiniMax) ------------------------------------------------------
    def _slopes(self, index: int, heads: int | None = None) -> torch.Tensor:
        """Decay rate per head: ALiBi's geometric slopes 2^(-8 (h + 1) / H), shrunk linearly with depth."""
        heads, layers = heads or self.config.heads, len(self.config.layer_types)
        depth = 1 - index / (layers - 1 + 1e-5) + 1e-5
        return torch.tensor([2.0 ** (-8 * (h + 1) / heads) * depth for h in range(heads)])

    def _lightning(self, index: int, h: torch.Tensor, memory: LinearMemory) -> tuple[torch.Tensor, LinearInputs]:
        """S <- exp(-s) S + k v^T, o = q^T S per head, with q, k, v = silu(W x) split per head."""
        c, p, n = self.config, f"layers.{index}.self_attn.", h.shape[0]
        pre = h @ self.w[p + "qkv_proj.weight"].T
        q, k, v = F.silu(pre).view(n, c.heads, 3 * c.head_dim).split(c.head_dim, dim=-1)
        inputs = LinearInputs(pre, k, v, -self._slopes(index).expand(n, -1), None)
        o = self._decay_scan(memory, q, k, v, inputs.g).flatten(1)
        gate = torch.sigmoid(h @ self.w[p + "output_gate.weight"].T)
        return (gate * plain_rms_norm(o, self.w[p + "norm.weight"], 1e-6)) @ self.w[p + "out_proj.weight"].T, inputs

    @staticmethod
    def _decay_update(memory: LinearMemory, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor) -> None:
        """One token (k [H, K], v [H, V], g [H] or per key channel [H, K]): S <- diag(exp(g)) S + k v^T."""
        decay = g.exp()[:, None, None] if g.dim() == 1 else g.exp()[:, :, None]
        memory.state = memory.state * decay + k[:, :, None] * v[:, None, :]

    # ----- attention: gated full, plain, sliding-window with sinks -----------------------------
    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, kind: str = "full_attention") -> torch.Tensor:
        """RoPE of a layer of ``kind``: row i of x [n, H, D] rotated for positions[i] on its first rotary channels
        (times YaRN's attention factor, gpt-oss)."""
        inv_freq, rd, factor = self.rope[kind]
        angles = (positions.float() / self.config.rope_scale)[:, None] * inv_freq[None]
        if self.config.bailing is not None:
            return rotate_interleaved_tail(x, angles, rd)
        return rotate_channels(x, angles, rd, factor)

    def _project(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """x W^T, plus the bias where the checkpoint has one (gpt-oss: q, k, v and o)."""
        out = x @ self.w[name + ".weight"].T
        return out + self.w[name + ".bias"] if name + ".bias" in self.w else out

    def _attention(self, index: int, h: torch.Tensor, positions: torch.Tensor, memory: AttentionMemory,
                   prefix: str | None = None, kind: str = "full_attention") -> tuple[torch.Tensor, AttentionInputs]:
        group = "mixer" if c_is_native(self.config) else "attention" if self.config.ring else "self_attn"
        c, p, eps, n = self.config, prefix or f"layers.{index}.{group}.", self.config.eps, h.shape[0]
        kv_heads = c.kv_heads_of(kind)
        if c.kimi is not None:
            (query, key, value), gate = self._latent_attention(index, h), self._head_gate(p, h)
        elif c.ring is not None:
            (query, key, value), gate = self._ring_qkv(p, h), None
        elif c.lightning or c.granite is not None or c.nemotron_blocks or c.window:  # no output gate, no q / k norms
            query, gate = self._project(p + "q_proj", h).view(n, c.heads, c.head_dim), None
            key = self._project(p + "k_proj", h).view(n, kv_heads, c.head_dim)
        else:
            query, gate = self._project(p + "q_proj", h).view(n, c.heads, 2 * c.head_dim).split(c.head_dim, dim=-1)
            query = rms_norm(query, self.w[p + "q_norm.weight"], eps)
            key = self._project(p + "k_proj", h).view(n, kv_heads, c.head_dim)
            key = rms_norm(key, self.w[p + "k_norm.weight"], eps)
        query = self._rotate(query, positions, kind)
        if c.kimi is None and c.ring is None:
            value = self._project(p + "v_proj", h).view(n, kv_heads, c.value_head_dim or c.head_dim) * c.value_scale
        memory.keys = torch.cat([memory.keys, self._rotate(key, positions, kind)])
        memory.values = torch.cat([memory.values, value])
        group = c.heads // kv_heads
        keys = memory.keys.repeat_interleave(group, 1).transpose(0, 1)  # [H, T, D]
        values = memory.values.repeat_interleave(group, 1).transpose(0, 1)  # [H, T, Dv]
        scale = c.granite["attention"] if c.granite is not None else c.head_dim**-0.5  # the q / k width (MiMo: not Dv)
        scores = query.transpose(0, 1) @ keys.transpose(1, 2) * scale  # [H, n, T]
        weights = self._attention_weights(scores, positions, kind, self._sinks(p))
        attended = (weights @ values).transpose(0, 1).flatten(1)
        attended = attended if gate is None else attended * torch.sigmoid(gate.flatten(1))
        return self._project(p + ("dense" if c.ring else "o_proj"), attended), AttentionInputs(key, value)

    def _sinks(self, prefix: str) -> torch.Tensor | None:
        """The layer's attention sinks [H] (gpt-oss: every layer; MiMo: sliding layers, saved in the hub's name)."""
        return self.w.get(prefix + "sinks", self.w.get(prefix + "attention_sink_bias"))

    def _attention_weights(self, scores: torch.Tensor, positions: torch.Tensor, kind: str,
                           sinks: torch.Tensor | None) -> torch.Tensor:
        """Softmax of scores [H, n, T] over the keys query i sees: j <= i, and i - window < j in a sliding layer
        (the memory holds every token from position 0, so key j sits at position j). A sink is one more logit
        per head, unscaled and never masked, whose value is zero: it only adds exp(sink_h) to the denominator."""
        key_positions, query_positions = torch.arange(scores.shape[-1])[None, :], positions[:, None]
        visible = key_positions <= query_positions
        if kind == "sliding_attention":
            visible = visible & (key_positions > query_positions - self.config.window)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            return torch.softmax(scores, dim=-1)
        with_sink = torch.cat([scores, sinks[:, None, None].expand(-1, scores.shape[1], 1)], dim=-1)
        return torch.softmax(with_sink, dim=-1)[..., :-1]  # the sink's share is dropped, not renormalised away

    # ----- feed-forward -------------------------------------------------------------------
    def _swiglu(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate x) * up x) for x [..., hidden]."""
        gate, up = x @ self.w[prefix + "gate_proj.weight"].T, x @ self.w[prefix + "up_proj.weight"].T
        return (F.silu(gate) * up) @ self.w[prefix + "down_proj.weight"].T

    def _feed_forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Dense SwiGLU, or top-k routed experts plus the sigmoid-gated shared expert; x [n, hidden].
        Every expert runs on every token and the routing weights (zero off the top k) mix them."""
        if self.config.granite is not None:
            return self._granite_feed_forward(index, x)
        mixtral_names = self.config.lightning or (self.config.kimi and self.config.bailing is None)
        prefix = f"layers.{index}.{'block_sparse_moe' if mixtral_names else 'mlp'}."
        if not self.config.is_moe(index):
            return self._swiglu(prefix, x)
        if self.config.swiglu is not None:
            return self._clamped_moe(prefix, x)
        if self.config.routing is not None:
            return self._sigmoid_moe(prefix, x)
        probs = torch.softmax(x @ self.w[prefix + "gate.weight"].T, dim=-1)
        top, chosen = probs.topk(self.config.top_k, dim=-1)
        if self.config.norm_topk:
            top = top / top.sum(-1, keepdim=True)
        mix = torch.zeros_like(probs).scatter(-1, chosen, top)  # [n, E]
        routed = sum(mix[:, e, None] * self._expert(prefix, e, x) for e in range(self.config.experts))
        if prefix + "shared_expert_gate.weight" not in self.w:  # MiniMax: routed experts only
            return routed
        shared = torch.sigmoid(x @ self.w[prefix + "shared_expert_gate.weight"].T) * self._swiglu(prefix + "shared_expert.", x)
        return routed + shared

    def _granite_feed_forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Routed experts (fused [gate | up] per expert, softmax over the top-k logits) plus the shared
        MLP, ungated; the shared MLP alone without experts."""
        def packed(gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
            gate, up = (x @ gate_up.T).chunk(2, dim=-1)
            return (F.silu(gate) * up) @ down.T

        shared = packed(self.w[f"layers.{index}.shared_mlp.input_linear.weight"],
                        self.w[f"layers.{index}.shared_mlp.output_linear.weight"])
        if not self.config.experts:
            return shared
        prefix = f"layers.{index}.block_sparse_moe."
        top, chosen = (x @ self.w[prefix + "router.layer.weight"].T).topk(self.config.top_k, dim=-1)
        mix = torch.zeros(x.shape[0], self.config.experts).scatter(-1, chosen, torch.softmax(top, dim=-1))
        routed = sum(mix[:, e, None] * packed(self.w[prefix + "input_linear.weight"][e],
                                              self.w[prefix + "output_linear.weight"][e])
                     for e in range(self.config.experts))
        return routed + shared

    def _sigmoid_moe(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        """Kimi-Linear's and MiMo-V2-Flash's MoE: SwiGLU experts mixed by the sigmoid router, plus the ungated
        shared experts where there are (Kimi; MiMo has none)."""
        mix = self._sigmoid_routing(prefix, x)
        routed = sum(mix[:, e, None] * self._expert(prefix, e, x) for e in range(self.config.experts))
        if prefix + "shared_experts.gate_proj.weight" not in self.w:
            return routed
        return routed + self._swiglu(prefix + "shared_experts.", x)

    def _clamped_moe(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        """gpt-oss's MoE, x [n, hidden]: a softmax over the top-k logits of the router (with bias) mixes the
        chosen experts, each one's down bias included."""
        top, chosen = self._project(prefix + "router", x).topk(self.config.top_k, dim=-1)
        mix = torch.zeros(x.shape[0], self.config.experts).scatter(-1, chosen, torch.softmax(top, dim=-1))
        return sum(mix[:, e, None] * self._clamped_expert(prefix + "experts.", e, x)
                   for e in range(self.config.experts))

    def _clamped_expert(self, prefix: str, e: int, x: torch.Tensor) -> torch.Tensor:
        """gpt-oss's expert e: x W + b with W [hidden, 2I] (x @ W, not nn.Linear's W^T) gives gate and up in
        interleaved columns (even, odd); gate clamped above at the limit, up both ways;
        (up + 1) * gate * sigmoid(alpha gate), then @ W_down [I, hidden] + b_down."""
        alpha, limit = self.config.swiglu
        both = x @ self.w[prefix + "gate_up_proj"][e] + self.w[prefix + "gate_up_proj_bias"][e]
        gate, up = both[:, 0::2].clamp(max=limit), both[:, 1::2].clamp(-limit, limit)
        hidden = (up + 1) * gate * torch.sigmoid(alpha * gate)  # the + 1: gpt-oss's own twist on SwiGLU
        return hidden @ self.w[prefix + "down_proj"][e] + self.w[prefix + "down_proj_bias"][e]

    def _relu2(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        """Nemotron-H's MLP: down(relu(up x)^2)."""
        return F.relu(x @ self.w[prefix + "up_proj.weight"].T).square() @ self.w[prefix + "down_proj.weight"].T

    def _relu2_moe(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        """Nemotron-H's MoE: squared-ReLU experts mixed by the sigmoid router, plus the squared-ReLU shared expert."""
        mix, latent = self._sigmoid_routing(prefix, x), prefix + "fc1_latent_proj.weight" in self.w
        inner = x @ self.w[prefix + "fc1_latent_proj.weight"].T if latent else x  # latent MoE: experts in a narrower space
        routed = sum(mix[:, e, None] * self._relu2(f"{prefix}experts.{e}.", inner) for e in range(self.config.experts))
        routed = routed @ self.w[prefix + "fc2_latent_proj.weight"].T if latent else routed
        return routed + self._relu2(prefix + "shared_experts.", x)

    def _sigmoid_routing(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        """Mixing weights [n, E] (zero off the chosen experts) of DeepSeek-V3's router: sigmoid scores; the
        choice ranks score + bias within the best groups (a group's merit: its two best biased scores);
        weights are the chosen plain scores, renormalised, times the scaling factor."""
        m = self.config.routing
        scores = torch.sigmoid(x @ self.w[prefix + "gate.weight"].T)  # [n, E]
        biased = scores + self.w[prefix + "gate.e_score_correction_bias"]
        per_group = self.config.experts // m["groups"]
        merit = biased.view(-1, m["groups"], per_group).topk(min(2, per_group), dim=-1)[0].sum(-1)
        keep = torch.zeros_like(merit).scatter(1, merit.topk(m["top_groups"], dim=-1)[1], 1.0)
        biased = biased.masked_fill(keep.repeat_interleave(per_group, 1) == 0, float("-inf"))
        chosen = biased.topk(self.config.top_k, dim=-1)[1]
        top = scores.gather(1, chosen)
        top = top / (top.sum(-1, keepdim=True) + 1e-20) if self.config.norm_topk else top
        return torch.zeros_like(scores).scatter(-1, chosen, top * m["scaling"])

    def _expert(self, prefix: str, expert: int, x: torch.Tensor) -> torch.Tensor:
        if prefix + "experts.gate_up_proj" in self.w:  # fused [E, 2I, H] / [E, H, I]
            gate, up = (x @ self.w[prefix + "experts.gate_up_proj"][expert].T).chunk(2, dim=-1)
            return (F.silu(gate) * up) @ self.w[prefix + "experts.down_proj"][expert].T
        names = f"{prefix}experts.{expert}."
        if names + "w1.weight" in self.w:  # Mixtral's names: w1 gate, w3 up, w2 down
            gate, up = x @ self.w[names + "w1.weight"].T, x @ self.w[names + "w3.weight"].T
            return (F.silu(gate) * up) @ self.w[names + "w2.weight"].T
        return self._swiglu(names, x)
