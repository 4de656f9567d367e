"""Linear families as records: every registered family's dispatched kernels against its own token
loop, its record against what its mixer does, and a family that lives in this module alone (its
record, mixer and naive kernel) served by the engine against a plain sequential forward."""
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hypic import DEFAULT_SEPARATOR as SEP, Engine
from hypic import runs_together
from hypic.cache.composition import Family, scalar_transition
from hypic.loading.checkpoints import TINY_CONFIG
from hypic_testing.tiny_models import NATIVE_VARIANTS, write_native_checkpoint
from hypic.config import ModelConfig
from hypic.errors import UnsupportedModel
from hypic.kernels import dispatch
from hypic.kernels.dispatch import RecurrenceKernels, run_recurrence, run_varlen, run_with_transition, unit_scale
from hypic.models import HybridModel
from hypic.models.arch import ARCHITECTURES, parse_config
from hypic.models.families import FAMILIES, linear_family
from hypic.models.lightning import LightningAttention, LightningInputs
from hypic.models.linear import LinearFamily, RunRecurrence, any_native_fields, direct_sources, qkvg, recur_in_parts
from hypic.runs_together import family_varlen

TOLERANCE = 1e-4


def tiny_configs() -> dict[str, ModelConfig]:
    """One tiny config per linear family: our own model types' first (scalar_rope in its plain form;
    Ring-linear's form of it: tests/hypic/test_ring_linear.py), then the architectures'."""
    fields = [{**TINY_CONFIG, **overrides, "model_type": "hypic_hybrid", "linear_family": family}
              for family, overrides in NATIVE_VARIANTS.values()]
    fields += [{**arch.tiny, "model_type": arch.model_types[0]} for arch in ARCHITECTURES if arch.tiny]
    configs: dict[str, ModelConfig] = {}
    for raw in fields:
        config = parse_config(raw)
        configs.setdefault(config.linear_family, config)
    return configs


CONFIGS = tiny_configs()


def recurrence_inputs(config: ModelConfig, steps: int, seed: int = 0) -> tuple[Any, Any]:
    """A random layer of ``config``'s family and its recurrence inputs for ``steps`` random tokens
    (every parameter random: a zero conv would make q, k and v zero)."""
    torch.manual_seed(seed)
    mixer = linear_family(config.linear_family).build(config, 0).requires_grad_(False)
    for param in mixer.parameters():
        param.normal_(0.0, 0.3)
    x = torch.randn(steps, config.hidden_size)
    proj = mixer.project(x, torch.arange(steps))
    window = torch.cat([torch.zeros(mixer.kernel - 1, proj.pre_conv.shape[1]), proj.pre_conv])
    return mixer, mixer.recurrence_inputs(mixer.convolve(window), proj)


def test_every_registered_family_has_a_tiny_config() -> None:
    assert set(FAMILIES) <= set(CONFIGS)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_random_inputs_are_not_degenerate(name: str) -> None:
    """q, k and v far from zero and a carried state that shows in the outputs: else the tests
    below would pass whatever the kernels did with them."""
    family, config = FAMILIES[name], CONFIGS[name]
    _, inputs = recurrence_inputs(config, 37)
    args = family.kernel_args(inputs)
    assert all(x.abs().mean() > 0.01 for x in args[:3])
    state = 0.1 * torch.randn(family.state_shape(config))
    scale = family.kernels.scale(args[1].shape[-1])
    carried, from_zero = (family.kernels.naive(*args, s, scale)[0] for s in (state, torch.zeros_like(state)))
    assert (carried - from_zero).abs().max() > 100 * TOLERANCE


@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("steps", [2, 37])
def test_dispatched_recurrence_matches_the_familys_token_loop(name: str, steps: int) -> None:
    """Short runs take the token loop, longer ones the chunked form (no FLA on CPU): both must give
    the naive kernel's outputs and final state, from a carried state."""
    family, config = FAMILIES[name], CONFIGS[name]
    _, inputs = recurrence_inputs(config, steps)
    args, state = family.kernel_args(inputs), 0.1 * torch.randn(family.state_shape(config))
    expected = family.kernels.naive(*args, state, family.kernels.scale(args[1].shape[-1]))
    for got in (run_recurrence(family.kernels, args, state),
                family.kernels.chunked(*args, state, family.kernels.scale(args[1].shape[-1]),
                                       family.kernels.chunk_size(steps, torch.device("cpu")))):
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_record_matches_its_mixer(name: str) -> None:
    """The record's structure and shapes are what its mixer makes: T_C of ``transition_shape`` and
    the structure named; the final state of ``state_shape``, equal to T_C S + S_C|0."""
    family, config = FAMILIES[name], CONFIGS[name]
    mixer, inputs = recurrence_inputs(config, 21)
    assert mixer.family is family
    state = 0.1 * torch.randn(family.state_shape(config))
    _, final, transition = mixer.recur_with_transition(inputs, state)
    _, from_zero, _ = mixer.recur_with_transition(inputs, torch.zeros_like(state))
    assert transition.family is family.structure
    assert tuple(transition.value.shape) == family.transition_shape(config)
    assert tuple(final.shape) == family.state_shape(config) and final.dtype == family.state_dtype
    torch.testing.assert_close(final, transition.apply(state) + from_zero, atol=TOLERANCE, rtol=TOLERANCE)


@pytest.mark.parametrize("name", [n for n in sorted(FAMILIES) if FAMILIES[n].structure is Family.DENSE])
def test_dense_transition_matches_the_token_loop(name: str) -> None:
    family, config = FAMILIES[name], CONFIGS[name]
    _, inputs = recurrence_inputs(config, 19)
    args = family.kernel_args(inputs)
    state = 0.1 * torch.randn(family.state_shape(config))
    assert family.kernels.naive_transition is not None
    torch.testing.assert_close(run_with_transition(family.kernels, args, state)[2],
                               family.kernels.naive_transition(*args), atol=TOLERANCE, rtol=TOLERANCE)


def fla_stand_in(naive: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., Any]:
    """A kernel of FLA's signature (a batch axis of 1, runs bounded by cu_seqlens, states [N, H, K, V])
    doing ``naive``'s work: the FLA path's plumbing can be checked without a GPU."""

    def chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, *rest: torch.Tensor, scale: float,
              initial_state: torch.Tensor | None, output_final_state: bool,
              cu_seqlens: torch.Tensor | None = None, cu_seqlens_cpu: torch.Tensor | None = None) -> tuple[Any, ...]:
        assert q.shape[0] == 1 and g.dtype == torch.float32 and output_final_state
        ends = [0, q.shape[1]] if cu_seqlens_cpu is None else cu_seqlens_cpu.tolist()
        outputs, finals = [], []
        for run, (lo, hi) in enumerate(itertools.pairwise(ends)):
            start = None if initial_state is None else initial_state[run]
            o, final = naive(*(x[0, lo:hi] for x in (q, k, v, g, *rest)), start, scale)
            outputs.append(o)
            finals.append(final)
        return torch.cat(outputs)[None], torch.stack(finals)

    return chunk


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_fla_path_passes_what_the_token_loop_takes(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through a stand-in of FLA's kernel: one run from a carried state, its dense transition from I
    under zero values, and varlen runs where the record says the kernel takes them."""
    family, config = FAMILIES[name], CONFIGS[name]
    monkeypatch.setattr(dispatch, "_fla", lambda kernels, q: fla_stand_in(kernels.naive) if kernels.fla else None)
    _, inputs = recurrence_inputs(config, 23)
    args, states = family.kernel_args(inputs), 0.1 * torch.randn(2, *family.state_shape(config))
    scale = family.kernels.scale(args[1].shape[-1])
    expected = family.kernels.naive(*args, states[0], scale)
    for a, b in zip(run_recurrence(family.kernels, args, states[0]), expected):
        torch.testing.assert_close(a, b, atol=TOLERANCE, rtol=TOLERANCE)
    if family.kernels.naive_transition is not None:
        torch.testing.assert_close(run_with_transition(family.kernels, args, states[0])[2],
                                   family.kernels.naive_transition(*args), atol=TOLERANCE, rtol=TOLERANCE)
    _, finals = run_varlen(family.kernels, args, [9, 14], states)
    torch.testing.assert_close(finals[1], family.kernels.naive(*(x[9:] for x in args), states[1], scale)[1],
                               atol=TOLERANCE, rtol=TOLERANCE)


def test_families_without_a_varlen_kernel_say_so_and_are_refused_together() -> None:
    together = [name for name, family in FAMILIES.items() if family.apart_because is None]
    assert together == ["gated_delta"]
    kda, config = FAMILIES["kda"], CONFIGS["kda"]
    assert kda.apart_because == "kda has no varlen kernel"
    _, inputs = recurrence_inputs(config, 8)
    with pytest.raises(ValueError, match="kda has no varlen kernel"):
        family_varlen(kda, inputs, [3, 5], torch.zeros(2, *kda.state_shape(config)))


def test_varlen_runs_match_one_call_per_run() -> None:
    family, config = FAMILIES["gated_delta"], CONFIGS["gated_delta"]
    _, inputs = recurrence_inputs(config, 30)
    args, states = family.kernel_args(inputs), 0.1 * torch.randn(3, *family.state_shape(config))
    outputs, finals = run_varlen(family.kernels, args, [7, 3, 20], states)
    for run, (lo, hi) in enumerate([(0, 7), (7, 10), (10, 30)]):
        o, final = family.kernels.naive(*(x[lo:hi] for x in args), states[run], None)
        torch.testing.assert_close(outputs[lo:hi], o, atol=TOLERANCE, rtol=TOLERANCE)
        torch.testing.assert_close(finals[run], final, atol=TOLERANCE, rtol=TOLERANCE)


def test_a_family_without_a_varlen_kernel_runs_apart_even_where_runs_are_batched(
        monkeypatch: pytest.MonkeyPatch, checkpoint_factory: Callable[..., Path]) -> None:
    calls: list[int] = []
    monkeypatch.setattr(runs_together, "runs_batched", lambda device: True)
    monkeypatch.setattr(runs_together, "varlen_recurrence", lambda *a: calls.append(1))
    engine = Engine.from_pretrained(checkpoint_factory("kimi_linear"), seam_width=4)
    engine.prefill(engine.parse(SEP.join(["a leading part", "a document of some length, " * 4, "and a query"])))
    assert calls == []


# ----- a family of this module alone ------------------------------------------------------------
DECAY = 0.75  # every head keeps three quarters of its state per token


def naive_constant_decay(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         initial_state: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """S_t = DECAY S_{t-1} + k_t v_t^T, o_t = scale S_t^T q_t (g unused: the decay is constant)."""
    state = torch.zeros(k.shape[1], k.shape[2], v.shape[2]) if initial_state is None else initial_state.float()
    out = torch.empty(k.shape[0], k.shape[1], v.shape[2])  # runs may be empty
    for t in range(k.shape[0]):
        state = DECAY * state + k[t].float()[:, :, None] * v[t].float()[:, None, :]
        out[t] = scale * torch.einsum("hk,hkv->hv", q[t].float(), state)
    return out, state


def chunked_by_the_loop(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """No chunked form: the token loop at every length (the chunk size is ignored)."""
    return naive_constant_decay(*args[:-1])


class ConstantDecayAttention(LightningAttention):
    """Lightning's projections and output around the constant-decay recurrence above."""

    def _run(self, inputs: LightningInputs, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return run_recurrence(self.family.kernels, qkvg(inputs), state)

    def recur(self, inputs: LightningInputs, state: torch.Tensor, cuts: tuple[int, ...] = ()) -> RunRecurrence:
        return recur_in_parts(self._run, inputs, state, cuts)

    def recur_with_transition(self, inputs: LightningInputs, state: torch.Tensor) -> tuple[Any, ...]:
        o, state = self._run(inputs, state)
        return o, state, scalar_transition(torch.full_like(inputs.g, torch.log(torch.tensor(DECAY)).item()))

    def step(self, states: torch.Tensor, inputs: LightningInputs) -> tuple[torch.Tensor, torch.Tensor]:
        outputs, finals = zip(*(self._run(inputs.slice(b, b + 1), states[b]) for b in range(states.shape[0])))
        return torch.cat(outputs), torch.stack(finals)


CONSTANT_DECAY = LinearFamily(
    "test_constant_decay", ConstantDecayAttention,
    RecurrenceKernels(naive=naive_constant_decay, chunked=chunked_by_the_loop, chunk_size=lambda steps, device: 1,
                      scale=unit_scale),
    Family.SCALAR, qkvg, "self_attn", direct_sources, native=any_native_fields)


def sequential_logits(model: HybridModel, ids: list[int]) -> torch.Tensor:
    """A one-layer model's last logits by a plain token loop over the whole prompt (no engine, no
    cache, no composition)."""
    layer, x = model.layers[0], model.embed(torch.tensor(ids))
    h = layer.input_layernorm(x)
    proj = layer.mixer.project(h, torch.arange(len(ids)))
    inputs = layer.mixer.recurrence_inputs(layer.mixer.convolve(proj.pre_conv), proj)
    o, _ = naive_constant_decay(inputs.q, inputs.k, inputs.v, inputs.g, None, 1.0)
    x = layer.feed_forward(layer.residual(x, h, layer.mixer.output(o, proj, h.dtype)))
    return model.logits(x)[-1]


def test_a_family_registered_here_alone_runs_through_the_engine(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """Registered in this module only, the family is served: documents warmed, then spliced behind
    another leading part with their cached T_C (exact in a one-layer linear model) give the logits
    of the plain sequential forward over the whole prompt."""
    monkeypatch.setitem(FAMILIES, CONSTANT_DECAY.name, CONSTANT_DECAY)
    path = write_native_checkpoint(tmp_path, CONSTANT_DECAY.name, linear_num_key_heads=4, linear_conv_kernel_dim=1,
                                   num_hidden_layers=1, layer_types=["linear_attention"])
    engine = Engine.from_pretrained(path, seam_width=4)
    documents = ["the first document, long enough to cache", "and a second one, also long enough"]
    engine.warmup(documents)
    parts = engine.parse(SEP.join(["a leading part", *documents, "a query?"]))
    prefill = engine.prefill(parts)
    assert prefill.stats.segments_hit == 2
    expected = sequential_logits(engine.model, parts.token_ids)
    torch.testing.assert_close(prefill.logits, expected, atol=TOLERANCE, rtol=TOLERANCE)


def test_a_native_config_may_name_only_registered_native_families() -> None:
    with pytest.raises(UnsupportedModel, match="one of gated_delta, gla, scalar_rope"):
        parse_config({**TINY_CONFIG, "model_type": "hypic_hybrid", "linear_family": "kda"})
