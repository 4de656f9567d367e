"""The global segment index and one request's plan: combine node, LPT builds, pulls."""
from hypic.router import PrefixIndex, SegmentIndex, SegmentJob, make_plan


def _job(name: str, tokens: int) -> SegmentJob:
    return SegmentJob(name, tuple(range(tokens)))


def test_index_records_syncs_and_forgets() -> None:
    index = SegmentIndex()
    index.record(0, ["a", "b"])
    index.record(1, ["b"])
    assert index.holders("b") == {0, 1}
    index.sync(0, ["b", "c"])  # worker 0 evicted a, built c
    assert index.holders("a") == set() and index.holders("c") == {0}
    index.forget_worker(1)
    assert index.holders("b") == {0} and len(index) == 2


def test_combine_node_holds_most_hit_tokens_and_cold_go_by_lpt() -> None:
    index = SegmentIndex()
    index.record(0, ["small"])
    index.record(1, ["big"])
    jobs = [_job("small", 100), _job("big", 900), _job("c1", 500), _job("c2", 400), _job("c3", 300)]
    plan = make_plan(jobs, index, {0: 0, 1: 0})
    assert plan.combine == 1
    assert plan.pulls == {0: ["small"]}
    assert plan.build_tokens() == {0: 500, 1: 700}  # LPT: 500 -> 0, 400 -> 1, 300 -> 1
    assert [j.key for j in plan.builds[0]] == ["c1"]


def test_dead_workers_are_neither_holders_nor_builders() -> None:
    index = SegmentIndex()
    index.record(2, ["warm"])  # worker 2 is not live
    plan = make_plan([_job("warm", 300), _job("warm", 300), _job("cold", 200)], index, {0: 50, 1: 0})
    assert plan.combine == 1 and plan.pulls == {}
    assert sorted(j.key for jobs in plan.builds.values() for j in jobs) == ["cold", "warm"]  # built once each


def test_ties_go_to_the_least_loaded_worker() -> None:
    assert make_plan([_job("x", 10)], SegmentIndex(), {0: 500, 1: 20}).combine == 1


def test_a_busy_holder_loses_the_combine_to_an_idle_worker_only_when_it_holds_little() -> None:
    """score = 2 x cached fraction - queued / (busiest queue + the request's 1000 document tokens)."""
    index = SegmentIndex()
    index.record(0, ["a"])
    jobs = [_job("a", 300), _job("b", 700)]  # worker 0 holds 30 % of the request
    assert make_plan(jobs, index, {0: 1000, 1: 0}).combine == 0  # 0.6 - 0.5 > 0 - 0
    assert make_plan(jobs, index, {0: 5000, 1: 0}).combine == 1  # 0.6 - 0.83 < 0
    index.record(0, ["b"])  # now it holds everything
    assert make_plan(jobs, index, {0: 5000, 1: 0}).combine == 0  # 2.0 - 0.83 > 0
    assert make_plan(jobs, index, {0: 5000, 1: 0}, match_weight=0.5).combine == 1  # 0.5 - 0.83 < 0


def test_prefix_index_matches_whole_leading_blocks_behind_the_same_prefix() -> None:
    prefixes = PrefixIndex(block=64)
    prompt = list(range(1000, 1200))  # three whole blocks of 64, then 8 tokens
    prefixes.record(1, prompt)
    assert prefixes.matched(prompt + [7, 8, 9]) == {1: 192}
    assert prefixes.matched(prompt[:100]) == {1: 64}
    assert prefixes.matched([0] + prompt[1:]) == {}  # block 2 alone matches nothing: the hash chains
    assert prefixes.matched(prompt[:63]) == {}
    prefixes.forget_worker(1)
    assert prefixes.matched(prompt) == {} and len(prefixes) == 0


def test_prefix_index_forgets_least_recently_used_blocks_first() -> None:
    prefixes = PrefixIndex(block=4, max_blocks=3)
    prefixes.record(0, list(range(8)))  # blocks a, b
    prefixes.record(0, [9] * 8)  # blocks c, d: a, the oldest, goes
    assert len(prefixes) == 3 and prefixes.matched(list(range(8))) == {}
    assert prefixes.matched([9] * 8) == {0: 8}


def test_a_prompt_without_documents_goes_where_its_prefix_is_unless_that_worker_is_swamped() -> None:
    """Whole-request routing (a prompt with no documents goes to the worker that can resume it, unless
    that worker is swamped): 2 x held fraction of the 600-token prompt - queued / (busiest + 600)."""
    assert make_plan([], SegmentIndex(), {0: 0, 1: 0}, prefixes={1: 512}, prompt_tokens=600).combine == 1
    assert make_plan([], SegmentIndex(), {0: 0, 1: 9000}, prefixes={1: 512}, prompt_tokens=600).combine == 1  # 1.71 - 0.94
    assert make_plan([], SegmentIndex(), {0: 0, 1: 100}, prefixes={1: 64}, prompt_tokens=600).combine == 1  # 0.21 - 0.14
    assert make_plan([], SegmentIndex(), {0: 0, 1: 9000}, prefixes={1: 64}, prompt_tokens=600).combine == 0  # 0.21 - 0.94
    assert make_plan([], SegmentIndex(), {0: 0, 1: 0}, prompt_tokens=600).combine == 0  # nobody holds it: ties


def test_a_prefix_served_again_is_kept_over_older_ones() -> None:
    prefixes = PrefixIndex(block=4, max_blocks=3)
    prefixes.record(0, list(range(8)))  # blocks a, b
    prefixes.record(0, list(range(4)))  # a used again: b is now the oldest
    prefixes.record(0, [9] * 4)
    prefixes.record(0, [8] * 4)  # b goes
    assert prefixes.matched(list(range(8))) == {0: 4}


def test_the_combine_pass_counts_as_load_on_the_combine_node() -> None:
    """Eleven equal cold documents: without the combine pass LPT gives the combine node six, with
    it the peer builds six and the combine node five (it combines the head while the sixth arrives)."""
    jobs = [_job(f"d{i}", 2400) for i in range(11)]
    plain = make_plan(jobs, SegmentIndex(), {0: 0, 1: 0})
    assert plain.combine == 0 and plain.build_tokens() == {0: 6 * 2400, 1: 5 * 2400}
    weighted = make_plan(jobs, SegmentIndex(), {0: 0, 1: 0}, combine_tokens=200)
    assert weighted.combine == 0 and weighted.build_tokens() == {0: 5 * 2400, 1: 6 * 2400}
    assert [j.key for j in weighted.builds[1]] == [f"d{i}" for i in range(0, 11, 2)]  # in prompt order
    heavy = make_plan(jobs, SegmentIndex(), {0: 0, 1: 0}, combine_tokens=3 * 2400)
    assert heavy.build_tokens() == {0: 4 * 2400, 1: 7 * 2400}
