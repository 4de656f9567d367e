"""Why FLA's Gated DeltaNet kernel misses the 1e-5 fp32 bar on an H100: a CPU emulation.

FLA 0.6's fused chunk-64 kernel (fla/ops/gated_delta_rule/chunk_fwd.py) inverts each chunk's
(I + A) by forward substitution in 16 x 16 diagonal blocks (fp32), then merges the off-diagonal
blocks with ``tl.dot(..., input_precision=SOLVE_TRIL_DOT_PRECISION)``, a constant fixed to 'tf32' on
Ampere and later, which TRITON_F32_DEFAULT=ieee does not override. This script replays that solve in
hypic's PyTorch chunked form on the CPU, with the merge dots' inputs cut to TF32's 10 mantissa bits,
and prints the errors of tests/hypic/test_cuda.py's layer-0 exactness test (relative Frobenius norm
of the first linear layer's fp32 state) on the same tiny checkpoint and prompt. The H100 gave
1.72e-4 for both; "trunc" reproduces that here, "ieee" (the same blockwise solve in fp32) ~1.6e-7.

    PYTHONPATH=$PWD:$PWD/datasets python eval/fla_tf32_solve_emulation.py [trunc|round|ieee ...]
"""
import inspect
import sys
import tempfile
from pathlib import Path

import torch

import hypic.kernels.gated_delta as gated_delta
import hypic.kernels.gated_delta.chunk as chunk_module
from hypic import Engine
from hypic.loading.checkpoints import write_random_checkpoint

BLOCK = 16  # FLA's BC: the diagonal blocks inverted in registers


def tf32(x: torch.Tensor, mode: str) -> torch.Tensor:
    """x with its mantissa cut to 10 bits: truncated (the tensor cores' reading of fp32 inputs) or
    rounded to nearest; unchanged for 'ieee'."""
    if mode == "ieee":
        return x
    bits = x.contiguous().view(torch.int32)
    if mode == "round":
        bits = bits + 0x1000
    return (bits & ~0x1FFF).view(torch.float32)


def fla_like_solve(system: torch.Tensor, rhs: torch.Tensor, mode: str) -> torch.Tensor:
    """(I + A)^-1 rhs as FLA computes it for a chunk of 64: diagonal blocks in fp32, the block merge
    (chunk_fwd.py, step 4) with TF32 dots, the product with rhs in IEEE (recompute_w_u)."""
    size = system.shape[-1]
    assert size == 4 * BLOCK
    a = lambda i, j: (system - torch.eye(size))[..., BLOCK * i:BLOCK * (i + 1), BLOCK * j:BLOCK * (j + 1)]  # noqa: E731
    dot = lambda x, y: tf32(x, mode) @ tf32(y, mode)  # noqa: E731
    inv = {}
    for i in range(4):
        diagonal = a(i, i) + torch.eye(BLOCK)
        inv[i, i] = torch.linalg.solve_triangular(diagonal, torch.eye(BLOCK).expand_as(diagonal).contiguous(),
                                                  upper=False, unitriangular=True)
    inv[1, 0] = -dot(dot(inv[1, 1], a(1, 0)), inv[0, 0])
    inv[2, 1] = -dot(dot(inv[2, 2], a(2, 1)), inv[1, 1])
    inv[3, 2] = -dot(dot(inv[3, 3], a(3, 2)), inv[2, 2])
    inv[2, 0] = -dot(inv[2, 2], dot(a(2, 0), inv[0, 0]) + dot(a(2, 1), inv[1, 0]))
    inv[3, 1] = -dot(inv[3, 3], dot(a(3, 1), inv[1, 1]) + dot(a(3, 2), inv[2, 1]))
    inv[3, 0] = -dot(inv[3, 3], dot(a(3, 0), inv[0, 0]) + dot(a(3, 1), inv[1, 0]) + dot(a(3, 2), inv[2, 0]))
    full = torch.zeros_like(system)
    for (i, j), block in inv.items():
        full[..., BLOCK * i:BLOCK * (i + 1), BLOCK * j:BLOCK * (j + 1)] = block
    return full @ rhs


ORIGINAL = inspect.getsource(chunk_module.chunk_gated_delta_rule_heads_first)


def emulate(mode: str) -> None:
    """Swap the chunked form's triangular solve for ``fla_like_solve`` and use FLA's chunk of 64."""
    exact = "torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)"
    assert exact in ORIGINAL, "hypic's chunked form changed: update the emulation"
    chunk_module.__dict__["_fla_like_solve"] = lambda system, rhs: fla_like_solve(system, rhs, mode)
    exec(ORIGINAL.replace(exact, "_fla_like_solve(system, rhs)"), chunk_module.__dict__)  # noqa: S102
    gated_delta.chunk_size_for = lambda steps, device: 64


def main(modes: list[str]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.hypic.test_cuda import _layer0_states, _prompt, _rel
    path = Path(tempfile.mkdtemp())
    write_random_checkpoint(path, "qwen3_5_text", 0)  # the tests' qwen3_5_text-ratio2
    prompt, docs = _prompt(10)
    states = lambda: _layer0_states(Engine.from_pretrained(path, device="cpu", dtype="float32", seam_width=8),  # noqa: E731
                                    prompt, docs)
    reference = states()
    for mode in modes:
        emulate(mode)
        emulated = states()
        print(mode, {"hypic vs full, emulated": f"{_rel(emulated['hypic'], emulated['full']):.2e}",
                     "full emulated vs full exact": f"{_rel(emulated['full'], reference['full']):.2e}"}, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["trunc", "ieee"])
