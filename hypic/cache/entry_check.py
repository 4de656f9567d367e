"""Checks on a segment entry that did not come from this process's own prefill (a peer's shipment,
a disk file, a shared store) before anything splices it."""
from ..config import ModelConfig
from ..errors import HypicError
from ..state import AttentionLayerState, LinearLayerState, LinearShapes, RequestState, WindowLayerState
from .prefix_cache import cache_key
from .store import AttentionInterior, LinearInterior, Role, SegmentEntry, entry_key


class EntryMismatch(HypicError):
    """An entry that came from outside this process (a peer, a file, a shared store) does not match
    what was asked for or what the model can splice."""


def check_entry(entry: SegmentEntry, fingerprint: str, role: Role, config: ModelConfig, linear: LinearShapes) -> None:
    """Raise ``EntryMismatch`` unless ``entry`` is the interior of its own token ids for this model
    (its key is their content address) with every layer's tensors of the model's shapes (``linear``:
    its linear layers', which their family decides)."""
    if entry_key(fingerprint, entry.seams, role, entry.token_ids, entry.namespace) != entry.key:
        raise EntryMismatch(f"entry {entry.key[:12]} does not address its token ids for this model")
    interior = entry.seams.interior(len(entry.token_ids))
    if interior is None or interior != (entry.local_start, entry.local_start + entry.length):
        raise EntryMismatch(f"entry {entry.key[:12]} has interior {entry.local_start}+{entry.length}, "
                            f"its seams give {interior}")
    if len(entry.layers) != config.num_hidden_layers:
        raise EntryMismatch(f"entry {entry.key[:12]} has {len(entry.layers)} layers, the model {config.num_hidden_layers}")
    for index, layer in enumerate(entry.layers):
        expected = _shapes(config, linear, index, entry.length, role)
        if _layer_shapes(layer) != expected:
            raise EntryMismatch(f"entry {entry.key[:12]} layer {index}: shapes {_layer_shapes(layer)}, expected {expected}")


def _shapes(config: ModelConfig, linear: LinearShapes, index: int, length: int, role: Role) -> tuple:
    if config.layer_types[index] != "linear_attention":  # a sliding-window layer keeps its last window tokens
        heads, window = config.kv_heads(index), config.window(index)
        kept = length if window is None else min(length, window)
        return ("attention", (heads, kept, config.head_dim), (heads, kept, config.attention_value_dim))
    transition = None if role is Role.NAIVE_SEGMENT else linear.transition
    conv_tail = (config.linear_conv_kernel_dim - 1, config.linear_conv_channels)
    return ("linear", transition, linear.state, conv_tail)


def _layer_shapes(layer: object) -> tuple:
    if isinstance(layer, AttentionInterior):
        return ("attention", tuple(layer.keys.shape), tuple(layer.values.shape))
    if isinstance(layer, LinearInterior):
        transition = None if layer.transition is None else layer.transition.shape  # decayed heads counted
        return ("linear", transition, tuple(layer.zero_start_state.shape), tuple(layer.conv_tail.shape))
    return (type(layer).__name__,)


def check_prefix_state(state: RequestState, key: list[int], template: RequestState) -> None:
    """Raise ``EntryMismatch`` unless ``state`` (a resume point another process sent) is a state of
    this model after the first ``state.length`` tokens of ``key`` (a private-pool tree key), short of
    its last token: its tokens and marks give that key, every layer its kind and shapes (``template``:
    this model's empty state)."""
    if not 0 < state.length < len(key) or cache_key(state.token_ids, state.marks) != key[: state.length]:
        raise EntryMismatch(f"a resume point of {state.length} tokens is not a head of the {len(key)}-token prompt")
    if len(state.layers) != len(template.layers):
        raise EntryMismatch(f"a resume point has {len(state.layers)} layers, the model {len(template.layers)}")
    for index, (layer, empty) in enumerate(zip(state.layers, template.layers)):
        if _state_shapes(layer) != _state_shapes(empty, state.length):
            raise EntryMismatch(f"a resume point's layer {index}: {_state_shapes(layer)}, "
                                f"expected {_state_shapes(empty, state.length)}")


def _state_shapes(layer: object, length: int | None = None) -> tuple:
    """A layer state's kind and shapes (an attention layer's as after ``length`` tokens, if given)."""
    if isinstance(layer, AttentionLayerState):
        keys, values = layer.keys, layer.values
        held = layer.length if length is None else length
        return ("attention", keys.shape[0], held, keys.shape[2], values.shape[0], values.shape[2])
    if isinstance(layer, WindowLayerState):
        return ("window", *(tuple(ring.shape) for ring in layer.rings()))
    if isinstance(layer, LinearLayerState):
        return ("linear", tuple(layer.recurrent.shape), tuple(layer.conv.shape))
    return (type(layer).__name__,)
