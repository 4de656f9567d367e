"""The UT transform's unit lower-triangular solve against LAPACK's substitution in float64."""
import pytest
import torch

from hypic.kernels.triangular import unit_lower_solve


def _system(rows: int, beta: float, spread: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A delta rule's strictly lower A (beta k_i . k_j times a decay in (0.5, 1]) over keys spread
    ``spread`` around one direction (small: a chunk of alike tokens, where the powers of A grow
    binomially) and a right-hand side of 24 columns, batched [3, 2, rows, ...]."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(16, generator=gen)
    keys = torch.nn.functional.normalize(base + spread * torch.randn(3, 2, rows, 16, generator=gen), dim=-1)
    betas = torch.rand(3, 2, rows, 1, generator=gen) * beta
    decay = 0.5 + 0.5 * torch.rand(3, 2, rows, rows, generator=gen)
    return ((keys * betas) @ keys.transpose(-1, -2) * decay).tril(-1), torch.randn(3, 2, rows, 24, generator=gen)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 16, 31, 32, 33, 64])
@pytest.mark.parametrize(("beta", "spread"), [(1.0, 1.0), (2.0, 1.0), (1.0, 0.05)])
def test_the_solve_equals_substitution_in_float64(rows: int, beta: float, spread: float) -> None:
    lower, rhs = _system(rows, beta, spread)
    eye = torch.eye(rows, dtype=torch.float64)
    expected = torch.linalg.solve_triangular(lower.double() + eye, rhs.double(), upper=False, unitriangular=True)
    found = unit_lower_solve(lower, rhs)
    assert found.dtype == torch.float32 and found.shape == rhs.shape
    assert ((found.double() - expected).abs().max() / expected.abs().max()).item() < 1e-5
