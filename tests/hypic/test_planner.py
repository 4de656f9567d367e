"""A request's plan, made once: the weightless planner a router uses plans as the engine does; a
head cut from a plan is the plan of the cut prompt; what a warm combine pass recomputes is known
from the plan alone."""

import pytest

from hypic import DEFAULT_SEPARATOR, Engine
from hypic.cache.plan import RequestPlan, plan_request
from hypic.cache.segments import PromptParts
from hypic.planner import Planner

DOCS = [f"Record {i}: the {a} was born in {1900 + 7 * i} and studied near the river. It had a red coat."
        for i, a in enumerate(["otter", "heron", "badger", "lynx"])]
PROMPT = DEFAULT_SEPARATOR.join(["Answer from the records.", *DOCS, "Question: who had a red coat?\nAnswer:"])


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_pretrained("default")


def _fields(plan: RequestPlan) -> tuple:
    return plan.parts, plan.policy, plan.spliced, plan.entry_keys, plan.marks, plan.tree_key, plan.logits_from


@pytest.mark.parametrize("namespace", ["", "team-a"])
def test_the_routers_planner_plans_as_the_engine_does(engine: Engine, namespace: str) -> None:
    planner = Planner.for_model("default")
    for mode in ("hypic", "naive", "full"):
        assert _fields(planner.plan(planner.parse(PROMPT, namespace), mode)) == _fields(
            engine.plan(engine.parse(PROMPT, namespace), mode))


@pytest.mark.parametrize("namespace", ["", "team-a"])
def test_a_head_is_the_plan_of_the_prompt_cut_there(engine: Engine, namespace: str) -> None:
    plan = engine.plan(engine.parse(PROMPT, namespace))
    for segments in range(len(plan.parts.segments) + 1):
        parts = plan.parts
        cut = PromptParts(parts.leading, parts.segments[:segments], (), parts.namespace)
        assert _fields(plan.head(segments)) == _fields(plan_request(cut, plan.policy, engine.fingerprint))


def test_recomputed_tokens_are_what_a_warm_combine_pass_recomputes(engine: Engine) -> None:
    warm = Engine.from_pretrained("default")
    warm.warmup(DOCS)
    parts = warm.parse(PROMPT)
    prefill = warm.prefill(parts)
    assert prefill.stats.segments_hit == len(DOCS) and prefill.stats.prefix_hit_tokens == 0
    assert warm.plan(parts).recomputed_tokens() == prefill.stats.combine_tokens
    assert warm.plan(parts, "full").recomputed_tokens() == prefill.stats.prompt_tokens
