"""Early refusal's rule on hand-made predictions: refused only when no replica meets every
objective set, and told which one failed."""
from hypic.cluster.slo import SloRefusal


def test_a_request_is_refused_only_when_no_replica_meets_every_objective() -> None:
    ttft, tbt = {"r0": 0.4, "r1": 2.0}, {"r0": 0.9, "r1": 0.1}
    assert SloRefusal(ttft_s=1.0).why(ttft, tbt) is None  # r0 answers in time
    assert SloRefusal(tbt_s=0.5).why(ttft, tbt) is None  # r1 decodes fast enough
    both = SloRefusal(ttft_s=1.0, tbt_s=0.5).why(ttft, tbt)  # r0 decodes too slowly, r1 answers too late
    assert both is not None and "no replica would meet both" in both
    assert SloRefusal(ttft_s=1.0, tbt_s=1.0).why(ttft, tbt) is None


def test_the_refusal_names_the_objective_every_replica_misses_and_the_best_prediction() -> None:
    late = SloRefusal(ttft_s=0.3, tbt_s=1.0).why({"r0": 0.4, "r1": 2.0}, {"r0": 0.1, "r1": 0.1})
    assert late is not None and "--ttft-slo of 0.3 s (the soonest in 0.40 s" in late
    slow = SloRefusal(ttft_s=5.0, tbt_s=0.05).why({"r0": 0.4, "r1": 2.0}, {"r0": 0.2, "r1": 0.1})
    assert slow is not None and "--tbt-slo of 0.05 s" in slow and "the least 0.10 s" in slow


def test_nothing_is_refused_before_a_prediction_and_a_replica_unpredicted_counts_as_meeting() -> None:
    assert SloRefusal(ttft_s=0.1, tbt_s=0.1).why({}, {}) is None
    assert SloRefusal(ttft_s=0.1, tbt_s=0.1).why({"r0": 0.05}, {"r1": 9.0}) is None  # r0: no decode measured
    assert SloRefusal().why({"r0": 99.0}, {"r0": 99.0}) is None and not SloRefusal().active
