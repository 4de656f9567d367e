"""eval/tp_fit_table.py against oracles outside its code path: a tiny float32 checkpoint's own tensor
bytes (read from the safetensors header) for one rank's weights at TP 1 and 2; transformers' models of
the published configs for the full-size parameter counts; the closed form of Qwen3.5-35B-A3B's entry and
request state, written from the layer shapes; and a run of the whole table."""
import json
import re
import struct
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from .conftest import load_script

# Replicated on every rank (docs/parallel.md): norms over the hidden size or one head, the router, the
# shared expert's gate. Everything else of this checkpoint is cut in two (its head counts all divide 2).
REPLICATED = re.compile(r"norm\.weight$|mlp\.gate\.weight$|shared_expert_gate\.weight$")


@pytest.fixture(scope="module")
def fit() -> ModuleType:
    return load_script("tp_fit_table")


def stored_bytes(path: Path) -> dict[str, int]:
    """Each tensor's stored bytes in the checkpoint's safetensors files, from their headers."""
    sizes: dict[str, int] = {}
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as handle:
            header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
        header.pop("__metadata__", None)
        sizes.update({name: entry["data_offsets"][1] - entry["data_offsets"][0] for name, entry in header.items()})
    return sizes


def test_rank_weights_are_the_checkpoint_split_in_two(fit: ModuleType, checkpoint_factory: Callable[..., Path]) -> None:
    """A float32 checkpoint written by transformers: TP 1 holds all of it, each of 2 ranks half of it
    plus the replicated parts (the table's bytes are bfloat16: half the float32 bytes)."""
    path = checkpoint_factory("qwen3_5_moe_text")
    tensors = stored_bytes(path)
    assert {name for name, size in tensors.items() if size % 4} == set()  # all float32
    total, replicated = sum(tensors.values()), sum(s for name, s in tensors.items() if REPLICATED.search(name))
    config = fit.parse_config(json.loads((path / "config.json").read_text()))
    one, two = (fit.rank_sizes("tiny", config, tp, fit.Workload(), False) for tp in (1, 2))
    assert 0 < replicated < total // 10
    assert one.weight_bytes * 2 == total
    assert two.weight_bytes * 2 == (total + replicated) // 2


def _transformers_model(stem: str, fields: dict[str, Any]) -> torch.nn.Module:
    """transformers' own model of a published config (text tower only, as HYPIC serves it)."""
    from transformers.models.kimi_linear import KimiLinearConfig, KimiLinearForCausalLM
    from transformers.models.minimax import MiniMaxConfig, MiniMaxForCausalLM
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    from transformers.models.qwen3_next import Qwen3NextConfig, Qwen3NextForCausalLM
    fields = {k: v for k, v in fields.get("text_config", fields).items() if k != "model_type"}
    if "attn_type_list" in fields:  # transformers' minimax reads layer_types only
        fields["layer_types"] = ["full_attention" if t else "linear_attention" for t in fields.pop("attn_type_list")]
    classes = {"qwen3.5": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
               "qwen3-next": (Qwen3NextConfig, Qwen3NextForCausalLM),
               "kimi": (KimiLinearConfig, KimiLinearForCausalLM), "minimax": (MiniMaxConfig, MiniMaxForCausalLM)}
    config_class, model_class = next(pair for prefix, pair in classes.items() if stem.startswith(prefix))
    with torch.device("meta"):
        return model_class(config_class(**fields))


@pytest.mark.parametrize("stem", ["qwen3.5-35b-a3b", "qwen3.5-122b-a10b", "qwen3-next-80b-a3b", "kimi-linear-48b-a3b",
                                  "minimax-text-01"])
def test_full_size_parameter_count_is_transformers(fit: ModuleType, stem: str) -> None:
    """Every parameter transformers builds for the published config (and the expert-bias buffers it keeps
    outside its parameters, which the checkpoints store), no more (Ring-linear has no transformers class)."""
    fields, _ = fit.published_config(stem)
    reference = _transformers_model(stem, fields)
    expected = sum(p.numel() for p in reference.parameters())
    expected += sum(b.numel() for name, b in reference.named_buffers() if name.endswith("e_score_correction_bias"))
    ours = fit.rank_sizes(stem, fit.parse_config(fields), 1, fit.Workload(), False)
    assert ours.parameters == expected
    assert ours.weight_bytes == 2 * expected


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen35_35b_entry_and_state_closed_form(fit: ModuleType, tp: int) -> None:
    """30 Gated DeltaNet layers of 32 value heads (128 x 128 fp32 state, and T_C in the entry), conv
    channels 2 x 16 x 128 + 32 x 128 with k - 1 = 3 rows in bf16; 10 attention layers of 2 KV heads of
    256 + 256 in bf16 (at 4 ranks the 2 KV heads are replicated: one each); a 1024-token document keeps
    1024 - 8 - 8 interior tokens."""
    fields, _ = fit.published_config("qwen3.5-35b-a3b")
    row = fit.rank_sizes("q", fit.parse_config(fields), tp, fit.Workload(), False)
    state, conv, kv_token = 32 // tp * 128 * 128 * 4, 3 * (2 * 16 * 128 + 32 * 128) // tp * 2, max(2 // tp, 1) * 512 * 2
    assert row.entry_bytes == 30 * (2 * state + conv) + 10 * (1024 - 16) * kv_token
    assert row.state_bytes == 30 * (state + conv) + 10 * 8192 * kv_token


def test_the_table_is_written(fit: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fit.main(["--out", str(tmp_path)])
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert len(rows) == len(fit.MODELS) * len(fit.TP_SIZES)
    assert all(not row["refused"] for row in rows)
    minimax_one = next(r for r in rows if r["model"] == "MiniMax-Text-01" and r["tp"] == 1)
    assert minimax_one["fits"] == {"H100": False, "H200": False}  # 456B parameters: 0.9 TB in bfloat16
    assert (tmp_path / "table.md").read_text() in capsys.readouterr().out
