"""The delta rules' UT transform solves (I + A) X = B per chunk, A strictly lower triangular. For
short chunks the inverse of I + A comes from batched products instead of LAPACK's per-matrix
substitution, which on a CPU costs some 10 us a matrix whatever its size (160 systems of 16 rows:
1.6 ms substituted, 0.4 ms as products)."""
import torch

PRODUCT_ROWS = 32  # up to this many rows the products win; at 64 they take longer than substitution


def unit_lower_solve(strictly_lower: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """X with (I + A) X = B for A ``strictly_lower`` [..., C, C] (zero on and above its diagonal) and
    B ``rhs`` [..., C, R]."""
    size = strictly_lower.shape[-1]
    if size > PRODUCT_ROWS or size & (size - 1):
        eye = torch.eye(size, dtype=strictly_lower.dtype, device=strictly_lower.device)
        return torch.linalg.solve_triangular(strictly_lower + eye, rhs, upper=False, unitriangular=True)
    return unit_lower_inverse(strictly_lower) @ rhs


def unit_lower_inverse(strictly_lower: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for A [..., C, C] strictly lower, C a power of two, by doubling the blocks: the
    inverse of [[L11, 0], [A21, L22]] is [[L11^-1, 0], [-L22^-1 A21 L11^-1, L22^-1]], so each level
    turns the inverses of the diagonal blocks of size b into those of size 2b with two batched
    products. Every product is of a part of the inverse with a part of A, never of powers of A
    (those grow binomially when a chunk's keys are alike), so it is as stable as substitution."""
    size, lead = strictly_lower.shape[-1], strictly_lower.shape[:-2]
    inverse = strictly_lower.new_ones(*lead, size, 1, 1)  # the diagonal blocks of size 1
    block = 1
    while block < size:
        pairs = size // (2 * block)
        blocks = strictly_lower.reshape(*lead, pairs, 2 * block, pairs, 2 * block).diagonal(dim1=-4, dim2=-2)
        below = blocks.movedim(-1, -3)[..., block:, :block]  # A21 of each pair [..., pairs, b, b]
        upper, lower = inverse.reshape(*lead, pairs, 2, block, block).unbind(-3)
        merged = strictly_lower.new_zeros(*lead, pairs, 2 * block, 2 * block)
        merged[..., :block, :block] = upper
        merged[..., block:, block:] = lower
        merged[..., block:, :block] = -(lower @ below @ upper)
        inverse, block = merged, 2 * block
    return inverse.reshape(*lead, size, size)
