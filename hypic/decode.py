"""Batched decode: one new token for each of B requests in one pass through the model.

Token-wise work (projections, norms, MLP/MoE, LM head) runs on the B tokens together; the
recurrent step is batched over the requests' stacked states; only full attention, whose KV
lengths differ, loops over requests, each over a view of its own KV buffer (the new key and value
are written in place: nothing the request already holds is copied), gathered behind the blocks it
shares (private-pool pages, its prompt's KV shared with sibling samples) when it has any.
"""
import torch

from .kernels.dispatch import denormals_flushed
from .models import HybridModel
from .models.attention import GatedAttention
from .models.linear import LinearMixer
from .models.rope import RotaryEmbedding
from .state import AttentionLayerState, LinearLayerState, RequestState, WindowLayerState


def _linear_step(mixer: LinearMixer, h: torch.Tensor, positions: torch.Tensor,
                 layers: list[LinearLayerState]) -> tuple[torch.Tensor, list[LinearLayerState]]:
    proj = mixer.project(h, positions)
    window = torch.cat([torch.stack([s.conv for s in layers]).to(proj.pre_conv.dtype), proj.pre_conv[:, None]], dim=1)
    inputs = mixer.recurrence_inputs(mixer.convolve_step(window), proj)
    o, states = mixer.step(torch.stack([s.recurrent for s in layers]), inputs)
    out = mixer.output(o, proj, h.dtype)
    return out, [LinearLayerState(states[b], window[b, 1:]) for b in range(h.shape[0])]


def _attention_step(mixer: GatedAttention, rope: RotaryEmbedding, h: torch.Tensor, positions: torch.Tensor,
                    layers: list[AttentionLayerState | WindowLayerState]) -> torch.Tensor:
    """Each request's new key and value appended in place (a sliding-window layer's into its ring),
    its query attending over its buffer."""
    proj = mixer.project(h, positions, rope)
    attended = []
    for b, layer in enumerate(layers):
        key, value = proj.key[b : b + 1].transpose(0, 1), proj.value[b : b + 1].transpose(0, 1)
        if isinstance(layer, WindowLayerState):
            at = layer.length
            layer.write(key, value, at)
            keys, values, key_positions = layer.slots()
            attended.append(mixer.attend_at(proj.query[b : b + 1], [at], keys, values, key_positions))
            continue
        layer.append(key, value)
        attended.append(mixer.attend(proj.query[b : b + 1], [(layer.length - 1, 1)], layer.keys, layer.values))
    return mixer.output(torch.cat(attended), proj.gate)


@torch.inference_mode()
def decode_batch(model: HybridModel, states: list[RequestState], tokens: list[int]) -> tuple[torch.Tensor, list[RequestState]]:
    """Append ``tokens[b]`` to ``states[b]`` for every b, in place (each state must be its request's
    own: see ``RequestState.fork``); returns logits [B, vocab] fp32 and the states (subnormal floats
    flushed to zero, as in a combine pass)."""
    with denormals_flushed():
        return _decode_batch(model, states, tokens)


def _decode_batch(model: HybridModel, states: list[RequestState], tokens: list[int]) -> tuple[torch.Tensor, list[RequestState]]:
    positions = torch.tensor([s.length for s in states], device=model.device)
    x = model.embed(torch.tensor(tokens, device=model.device))
    for index, layer in enumerate(model.layers):
        h = layer.input_layernorm(x)
        old = [s.layers[index] for s in states]
        if layer.is_linear:
            mixed, new = _linear_step(layer.mixer, h, positions, old)
            for state, layer_state in zip(states, new):
                state.layers[index] = layer_state
        else:
            mixed = _attention_step(layer.mixer, model.rope_of(index), h, positions, old)
        x = layer.feed_forward(layer.residual(x, h, mixed))
    for state, token in zip(states, tokens):
        state.length += 1
        state.token_ids.append(token)
    return model.logits(x), states
