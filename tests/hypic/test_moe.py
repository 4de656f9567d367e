"""The sparse MoE block, both expert paths (grouped matmuls, per-expert loop), against its
closed form evaluated token by token: out_t = sum over t's top-k experts e of w_te * E_e(x_t)
+ sigmoid(g . x_t) * S(x_t), with E_e and S SwiGLU MLPs."""
import pytest
import torch
import torch.nn.functional as F

from hypic.models.mlp import SparseMoE, expert_outputs


def _moe(experts: int = 6, top_k: int = 2, seed: int = 0) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(hidden=16, experts=experts, top_k=top_k, expert_size=8, shared_size=12, norm_topk=True)
    with torch.no_grad():
        for param in moe.parameters():
            param.normal_(0, 0.5)
    return moe


def _token_by_token(moe: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    rows = []
    for token in x.double():
        probs = torch.softmax(token @ moe.router.weight.double().T, -1)
        weights, chosen = torch.topk(probs, moe.top_k)
        weights = weights / weights.sum()
        row = torch.sigmoid(token @ moe.shared_expert_gate.weight.double().T) * moe.shared_expert.double()(token)
        for weight, expert in zip(weights, chosen.tolist()):
            gate, up = (moe.gate_up_proj[expert].double() @ token).chunk(2)
            row = row + weight * (moe.down_proj[expert].double() @ (F.silu(gate) * up))
        rows.append(row)
    moe.float()
    return torch.stack(rows)


@pytest.mark.parametrize("grouped", [True, False])
def test_expert_paths_match_the_closed_form(grouped: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    moe = _moe()
    x = torch.randn(40, 16)
    monkeypatch.setattr("hypic.models.mlp.grouped_mm_runs", lambda _: grouped)
    out = moe(x)
    expected = _token_by_token(moe, x)
    assert torch.allclose(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_experts_without_tokens_and_a_single_token() -> None:
    """Experts that receive no token (zero-length groups) and one-token inputs give the loop's rows."""
    moe = _moe(experts=8, top_k=1)
    inputs = torch.randn(3, 16)
    counts = torch.tensor([0, 2, 0, 0, 0, 1, 0, 0])
    grouped = expert_outputs(inputs, counts, moe.gate_up_proj.data, moe.down_proj.data, grouped=True)
    looped = expert_outputs(inputs, counts, moe.gate_up_proj.data, moe.down_proj.data, grouped=False)
    assert torch.allclose(grouped, looped, atol=1e-5)
    single = expert_outputs(inputs[:1], torch.tensor([0, 0, 0, 1, 0, 0, 0, 0]), moe.gate_up_proj.data,
                            moe.down_proj.data, grouped=True)
    gate, up = (moe.gate_up_proj.data[3] @ inputs[0]).chunk(2)
    assert torch.allclose(single[0], moe.down_proj.data[3] @ (F.silu(gate) * up), atol=1e-5)
