"""eval/bench_state_cache.py on a tiny checkpoint: entry bytes by part against the closed form."""
from pathlib import Path

from .conftest import load_script


def test_entry_bytes_and_layer0_error_per_dtype(tiny_checkpoint: Path) -> None:
    bench = load_script("bench_state_cache")
    rows = {row["dtype"]: row for row in bench.main(["--model", str(tiny_checkpoint), "--doc-tokens", "60"])}
    assert rows["bfloat16"]["transition"] * 2 == rows["float32"]["transition"] > 0
    assert rows["float16"]["zero_start_state"] * 2 == rows["float32"]["zero_start_state"] > 0
    assert rows["bfloat16"]["kv"] == rows["float32"]["kv"] and rows["float32"]["conv_tail"] > 0
    assert rows["float32"]["layer0_rel_l2"] <= 1e-5 < rows["bfloat16"]["layer0_rel_l2"] <= 1e-2
