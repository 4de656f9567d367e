"""The router's split of a prompt, against the engine that serves it."""
from collections.abc import Callable

from hypic import Engine
from hypic.router.splitter import Splitter


def test_combine_tokens_are_what_a_warm_combine_pass_recomputes(docs: list[str],
                                                                pic_prompt: Callable[[list[int], str], str]) -> None:
    engine, splitter = Engine.from_pretrained("default"), Splitter.for_model("default")
    prompt = pic_prompt([0, 1, 2], "Who had a red coat?")
    engine.warmup(docs[:3])
    prefill = engine.prefill(engine.parse(prompt))
    assert prefill.stats.segments_hit == 3 and prefill.stats.prefix_hit_tokens == 0
    assert splitter.combine_tokens(splitter.parse(prompt), "hypic") == prefill.stats.combine_tokens
    assert splitter.combine_tokens(splitter.parse(prompt), "full") == prefill.stats.prompt_tokens
