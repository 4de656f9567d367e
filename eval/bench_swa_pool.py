"""Cached tokens per GiB of private pool for MiMo-V2-Flash's layer mix, with and without the SWA pool.

Without it, every layer keeps every token's K and V along the radix tree's edges. With it (what
``hypic.cache.prefix_cache`` does), only the full-attention layers do; a sliding-window layer keeps its
last W tokens once per resume point (every ``--snapshot-interval`` tokens, and at document edges),
since no later token reads further back. So the SWA pool's saving depends on how dense the resume
points are. The closed form is printed at the released model's shapes (48 layers: 9 full, 39
sliding with window 129 and twice the KV heads; keys 192 wide, values 128; bf16), then checked
against the bytes the private pool actually holds after a long prompt on a tiny random model with
the same layer mix.

    python eval/bench_swa_pool.py --tokens 4096 --snapshot-interval 256 1024 4096
"""
import argparse
import random
import tempfile
from pathlib import Path

from hypic import Engine
from hypic.loading.checkpoints import write_random_checkpoint
from hypic.config import ModelConfig
from hypic.models.arch import parse_config

GIB = 1 << 30
MIMO_V2_FLASH = dict(  # config.json of XiaomiMiMo/MiMo-V2-Flash as transformers reads it (the fields that size the KV)
    model_type="mimo_v2_flash", vocab_size=152576, hidden_size=4096, intermediate_size=16384, moe_intermediate_size=2048,
    num_hidden_layers=48, num_attention_heads=64, num_key_value_heads=4, head_dim=192, v_head_dim=128,
    sliding_window_size=128, n_routed_experts=256, num_experts_per_tok=8,
)


def token_bytes(config: ModelConfig, index: int, size: int) -> int:
    """K and V of one token in attention layer ``index``."""
    return config.kv_elements(index) * size


def pool_bytes(config: ModelConfig, size: int, tokens: int, resume_points: int, swa_pool: bool) -> int:
    """Private-pool bytes of one cached prefix of ``tokens`` tokens with ``resume_points`` snapshots."""
    full = sum(tokens * token_bytes(config, i, size) for i in config.attention_layers() if config.window(i) is None)
    windows = config.window_layers()
    if not swa_pool:
        return full + sum(tokens * token_bytes(config, i, size) for i in windows)
    return full + resume_points * sum(config.window(i) * token_bytes(config, i, size) for i in windows)


def closed_form(config: ModelConfig, size: int, tokens: int, intervals: list[int]) -> None:
    """Cached tokens per GiB with and without the SWA pool, per resume-point interval."""
    without = GIB * tokens / pool_bytes(config, size, tokens, 0, swa_pool=False)
    print(f"MiMo-V2-Flash ({len(config.attention_layers()) - len(config.window_layers())} full + "
          f"{len(config.window_layers())} sliding layers, window {config.sliding_window.size}, {size}-byte KV), "
          f"a {tokens}-token prefix:")
    print("| resume point every | tokens / GiB without SWA pool | with SWA pool | ratio |")
    print("|---|---|---|---|")
    for interval in intervals:
        with_pool = GIB * tokens / pool_bytes(config, size, tokens, -(-tokens // interval), swa_pool=True)
        print(f"| {interval} tokens | {without:,.0f} | {with_pool:,.0f} | {with_pool / without:.2f}x |")
    full_only = GIB * tokens / pool_bytes(config, size, tokens, 0, swa_pool=True)
    print(f"| (no resume point: full-attention KV alone) | {without:,.0f} | {full_only:,.0f} | {full_only / without:.2f}x |")


def measured(tokens: int, interval: int) -> None:
    """The private pool's own byte count after one prompt on a tiny MiMo-shaped model vs the closed form."""
    kinds = ["full_attention" if i == 0 or (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)]
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp), "mimo_v2_flash", 0, hidden_size=64, num_hidden_layers=48,
                                       layer_types=kinds, mlp_layer_types=["dense"] * 48, sliding_window=129,
                                       max_position_embeddings=tokens + 64)
        engine = Engine.from_pretrained(path, snapshot_interval=interval)
        rng = random.Random(0)
        engine.generate("".join(rng.choice("abcdefgh ") for _ in range(tokens)), max_new_tokens=1, mode="prefix")
        pool, config = engine.cache.private, engine.model.config
        points = sum(1 for node in pool._nodes() if node.snapshot)
        cached = max(node.depth for node in pool._nodes())
        expected = pool_bytes(config, 4, cached, points, swa_pool=True)
        print(f"tiny MiMo-shaped model (48 layers, fp32), {tokens}-token prompt, resume point every {interval}: "
              f"{cached} tokens cached at {points} resume points in {pool.nbytes:,} B "
              f"({pool.window_nbytes:,} B of window tails); closed form {expected:,} B; "
              f"without the SWA pool it would be {pool_bytes(config, 4, cached, points, swa_pool=False):,} B "
              f"({pool_bytes(config, 4, cached, points, swa_pool=False) / pool.nbytes:.2f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="length of the cached prefix")
    parser.add_argument("--snapshot-interval", type=int, nargs="+", default=[128, 256, 1024, 4096],
                        help="tokens between resume points")
    args = parser.parse_args()
    closed_form(parse_config(MIMO_V2_FLASH), 2, args.tokens, args.snapshot_interval)
    print()
    for interval in args.snapshot_interval:
        measured(args.tokens, interval)


if __name__ == "__main__":
    main()
