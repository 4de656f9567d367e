"""Our RMS norms equal transformers' own, bit for bit in bfloat16 (where the order of the weight
multiply and the cast back matters), for each family that uses them."""
import pytest
import torch

from hypic.loading.checkpoints import reference_classes
from hypic.models.norm import RMSNorm, SigmoidGatedRMSNorm

reference_classes("kimi_linear")  # transformers on its PyTorch path
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNorm, KimiLinearRMSNormGated  # noqa: E402
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm  # noqa: E402

DIM = 64


def _random_weights(*modules: torch.nn.Module) -> None:
    weight = 1 + 0.3 * torch.randn(DIM, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for module in modules:
            module.weight.copy_(weight)


@pytest.mark.parametrize("theirs, weight_in_fp32", [(KimiLinearRMSNorm, False), (NemotronHRMSNorm, True)])
def test_plain_norms_equal_transformers_in_bfloat16(theirs: type, weight_in_fp32: bool) -> None:
    ours, reference = RMSNorm(DIM, 1e-5, unit_offset=False, weight_in_fp32=weight_in_fp32), theirs(DIM, eps=1e-5)
    _random_weights(ours, reference)
    ours, reference = ours.to(torch.bfloat16), reference.to(torch.bfloat16)
    x = (3 * torch.randn(200, DIM, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    assert torch.equal(ours(x), reference(x))


def test_the_other_weight_order_differs_in_bfloat16() -> None:
    """The two orders are not interchangeable: the test above can tell them apart."""
    fp32_weight, cast_first = RMSNorm(DIM, 1e-5, False, True), RMSNorm(DIM, 1e-5, False, False)
    _random_weights(fp32_weight, cast_first)
    x = (3 * torch.randn(200, DIM, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    assert not torch.equal(fp32_weight.to(torch.bfloat16)(x), cast_first.to(torch.bfloat16)(x))


def test_kimi_sigmoid_gated_norm_equals_transformers() -> None:
    ours, reference = SigmoidGatedRMSNorm(DIM, 1e-5), KimiLinearRMSNormGated(DIM, eps=1e-5)
    _random_weights(ours, reference)
    generator = torch.Generator().manual_seed(2)
    x, gate = (torch.randn(50, 4, DIM, generator=generator).to(torch.bfloat16) for _ in range(2))
    ours, reference = ours.to(torch.bfloat16), reference.to(torch.bfloat16)
    assert torch.equal(ours(x, gate), reference(x, gate))
