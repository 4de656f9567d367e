"""``hypic eval cluster``: the multi-tenant workload against its definition, the targets' verdicts in
closed form, and one tiny run (``single`` and two replicas behind the cache-aware router, real
``hypic serve`` processes) whose summary is recomputed from its raw records and whose answers are
replayed on an in-process engine."""
import argparse
import json
import statistics
from pathlib import Path

import pytest

from hypic import DEFAULT_SEPARATOR, Engine
from hypic.cli import main
from hypic.evaluation.cluster import Goal, add_arguments, judge, warm_requests_covering, workload_of
from hypic.evaluation.tenants import TenantConfig, TenantWorkload
from hypic.evaluation.trace import TraceError

TINY = ["--tenants", "2", "--docs-per-tenant", "3", "--docs-per-request", "2", "--doc-words", "60", "--qps", "4",
        "--requests", "6", "--warm-requests", "6", "--output-tokens", "3", "--pool-ratio", "1.2",
        "--dtype", "float32", "--no-progress"]


def test_each_request_names_k_distinct_documents_of_its_own_tenant_only() -> None:
    """Read back from the prompt text: every document segment carries its tenant's header and is one
    of that tenant's documents, of exactly ``doc_words`` words; no document text belongs to two tenants."""
    config = TenantConfig(tenants=5, docs_per_tenant=4, docs_per_request=3, doc_words=40, seed=2)
    workload = TenantWorkload(config)
    texts = [set(docs) for docs in workload.documents]
    assert sum(len(t) for t in texts) == len(set().union(*texts)) == 20  # disjoint, none repeated
    for request in workload.requests(300, 1):
        parts = request.prompt.split(DEFAULT_SEPARATOR)
        assert len(parts) == 2 + 3 and parts[0].startswith("System line ") and "Question" in parts[-1]
        documents = parts[1:-1]
        assert len(set(documents)) == 3 and set(documents) <= texts[request.tenant]
        for text, index in zip(documents, request.documents):
            header, _, body = text.partition(": ")
            assert header == f"Tenant {request.tenant} document {index}" and len(body.split()) == 40
    orders = {r.documents for r in workload.requests(300, 1) if r.tenant == 0}
    assert len({frozenset(o) for o in orders}) < len(orders)  # the same documents come in other orders


def test_with_tenant_namespaces_each_request_names_its_tenants_salt() -> None:
    shared = TenantWorkload(TenantConfig(tenants=3)).requests(50, 1)
    isolated = TenantWorkload(TenantConfig(tenants=3, tenant_namespaces=True)).requests(50, 1)
    assert {r.salt for r in shared} == {None}
    assert all(r.salt == f"tenant-{r.tenant}" for r in isolated) and len({r.salt for r in isolated}) == 3
    assert [(r.tenant, r.prompt) for r in isolated] == [(r.tenant, r.prompt) for r in shared]


def test_tenants_are_uniform_or_skewed_and_arrivals_poisson() -> None:
    uniform = [r.tenant for r in TenantWorkload(TenantConfig(tenants=4)).requests(4000, 1)]
    assert all(abs(uniform.count(t) / 4000 - 0.25) < 0.03 for t in range(4))
    skewed = [r.tenant for r in TenantWorkload(TenantConfig(tenants=4, tenant_zipf=1.0)).requests(4000, 1)]
    assert skewed.count(0) / 4000 == pytest.approx(1 / (1 + 1 / 2 + 1 / 3 + 1 / 4), abs=0.03)  # Zipf's 48 %
    times = TenantWorkload(TenantConfig()).arrivals(4001, qps=4.0)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0 and statistics.mean(gaps) == pytest.approx(0.25, rel=0.06)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.08)  # exponential: CV 1
    with pytest.raises(TraceError, match="--docs-per-request"):
        TenantConfig(docs_per_tenant=2, docs_per_request=3)


def _capacity(qps: float | None, lower_bound: bool = False) -> dict:
    return {"qps": qps, "lower_bound": lower_bound}


@pytest.mark.parametrize("zipf, capped", [(0.0, False), (1.2, True)])
def test_the_default_warm_up_is_the_shortest_that_names_every_document(zipf: float, capped: bool) -> None:
    """Read back from the prompts' text: the default warm-up's requests name all T x D documents
    between them, one request fewer leaves one unnamed; where tenants are so skewed that two requests
    a document do not name them all, it is two a document; a shorter cap is kept."""
    workload = TenantWorkload(TenantConfig(tenants=5, docs_per_tenant=4, docs_per_request=2, tenant_zipf=zipf))
    every = set().union(*map(set, workload.documents))

    def named(count: int) -> set[str]:
        return {part for r in workload.requests(count, 0) for part in r.prompt.split(DEFAULT_SEPARATOR)} & every

    count = warm_requests_covering(workload)
    if capped:
        assert count == 2 * len(every) and named(count) < every
    else:
        assert named(count) == every and named(count - 1) != every and count < 2 * len(every)
    assert workload.covering_count(count - 1) == count - 1
    assert _args().warm_requests is None


def test_targets_are_ratios_with_their_bounds() -> None:
    """QPS 3.4 over 2.0 is 1.7x exactly (PASS at 1.7); a lower bound over an exact value passes only
    when it already clears the goal; an exact value over a lower bound can only miss."""
    goal = Goal("QPS at SLO", "a", "b", 1.7)

    def verdict(mine: dict, theirs: dict) -> tuple:
        found = judge(goal, [], {"a": mine, "b": theirs})
        return found["verdict"], found["bound"], found["ratio"] and round(found["ratio"], 3)

    assert verdict(_capacity(3.4), _capacity(2.0)) == ("PASS", "=", 1.7)
    assert verdict(_capacity(3.0), _capacity(2.0)) == ("MISS", "=", 1.5)
    assert verdict(_capacity(4.0, True), _capacity(2.0)) == ("PASS", ">=", 2.0)
    assert verdict(_capacity(3.0, True), _capacity(2.0)) == ("UNKNOWN", ">=", 1.5)
    assert verdict(_capacity(3.0), _capacity(2.0, True)) == ("MISS", "<=", 1.5)
    assert verdict(_capacity(4.0), _capacity(2.0, True)) == ("UNKNOWN", "<=", 2.0)
    assert verdict(_capacity(None), _capacity(2.0))[0] == "UNKNOWN"
    records = [{"method": m, "qps": q, "ok": True, "segments_hit": h, "segments_missed": x}
               for m, q, h, x in (("a", 1, 9, 1), ("b", 1, 10, 0), ("b", 2, 0, 10))]  # b's QPS 2: not a's
    hit = judge(Goal("segment hit rate", "a", "b", 0.9), records, {})
    assert (hit["ratio"], hit["verdict"]) == (pytest.approx(0.9), "PASS")


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("cluster")
    assert main(["eval", "cluster", "--policies", "cache_aware", "--no-pooled", "--hit-dp-size", "0",
                 "--tenant-namespaces", "--out", str(out), *TINY]) == 0
    return out


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "cluster.jsonl").read_text().splitlines()]


def test_the_summary_is_the_raw_records(study: Path) -> None:
    """Hit rates and TTFT medians recomputed from the JSONL equal the summary's; the TTFT is the
    server's; replicated answers name their replica, plain ones do not; the pools were sized as asked."""
    records, summary = _records(study), json.loads((study / "cluster_summary.json").read_text())
    assert len(records) == 2 * 6 and all(r["ok"] for r in records)
    assert [(r["method"], r["qps"]) for r in summary["rows"]] == [("single", 4), ("dp2-cache_aware", 4)]
    for row in summary["rows"]:
        mine = [r for r in records if r["method"] == row["method"]]
        hit, missed = sum(r["segments_hit"] for r in mine), sum(r["segments_missed"] for r in mine)
        # a document inside a prompt prefix resumed from the private pool is neither hit nor missed
        assert all(r["segments_hit"] + r["segments_missed"] <= 2 for r in mine) and hit + missed > 0
        assert row["segment_hit_rate"] == pytest.approx(hit / (hit + missed))
        assert row["hit_rate"] == pytest.approx(sum(r["cached_tokens"] for r in mine) /
                                                sum(r["prompt_tokens"] for r in mine))
        assert row["ttft_p50_s"] == pytest.approx(statistics.median(r["ttft_s"] for r in mine))
        replicas = [r.get("replica") for r in mine]
        assert row["per_replica"] == sorted((replicas.count(x) for x in set(replicas) - {None}), reverse=True)
    for r in records:
        # ranked by the client's TTFT; the server's (from the arrival at its ingress) is never more
        assert r["ttft_source"] == "client" and 0 < r["server_ttft_s"] <= r["ttft_s"]
        assert ("replica" in r) == (r["method"] == "dp2-cache_aware")
    working_set = summary["working_set"]
    assert working_set["entries"] == 2 * 3 and summary["workload"]["tenant_namespaces"]
    assert summary["public_pool_bytes"] == int(working_set["bytes"] / 1.2)
    assert "QPS at SLO dp2-cache_aware / single" in (study / "cluster_summary.md").read_text()


def test_answers_are_an_engines_with_the_same_documents(study: Path) -> None:
    """Each record is the workload's request of its index (tenant, documents); a request whose
    documents all hit answers as an engine that cached them, one that missed them all as a fresh
    engine (greedy, float32)."""
    summary = json.loads((study / "cluster_summary.json").read_text())
    workload = TenantWorkload(TenantConfig(**summary["workload"]))
    requests = workload.requests(6, 1)
    checked = 0
    for record in _records(study):
        request = requests[record["request"]]
        assert (record["tenant"], tuple(record["documents"])) == (request.tenant, request.documents)
        if record["segments_missed"] and record["segments_hit"] or checked >= 2:
            continue
        engine = Engine.from_pretrained("default", dtype="float32")
        if record["segments_hit"]:
            engine.warmup([workload.documents[request.tenant][d] for d in request.documents])
        assert record["output_ids"] == engine.generate(request.prompt, max_new_tokens=3).output_ids
        checked += 1
    assert checked == 2


def _args(*options: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(options))


def test_the_shared_workload_is_one_corpus_every_request_draws_from_by_zipf_popularity() -> None:
    """--workload shared: one tenant of --corpus-docs documents; read back from the prompts, each
    request names --docs-per-request distinct ones, the most popular about as often as Zipf(1) over
    50 documents says (1 / H_50 of the draws before the k distinct are taken: more than 2.5x the
    tenth's); --churn adds documents the corpus never had, in about that share of requests."""
    workload = workload_of(_args("--workload", "shared", "--corpus-docs", "50", "--docs-per-request", "5"))
    assert (workload.config.tenants, workload.config.docs_per_tenant, workload.config.document_zipf) == (1, 50, 1.0)
    corpus, named = set(workload.documents[0]), []
    for request in workload.requests(2000, 1):
        documents = request.prompt.split(DEFAULT_SEPARATOR)[1:-1]
        assert len(set(documents)) == 5 and set(documents) <= corpus
        named += request.documents
    assert named.count(0) > 2.5 * named.count(9) > 0
    churned = workload_of(_args("--workload", "shared", "--corpus-docs", "50", "--churn", "0.2"))
    new = sum(any(d >= 50 for d in r.documents) for r in churned.requests(2000, 1))
    assert new / 2000 == pytest.approx(0.2, abs=0.03)


@pytest.mark.parametrize("bad, message", [
    (["--pool-ratio", "2.5"], "--pool-ratio must be between 1 and --dp-size (2)"),
    (["--qps", "0"], "--qps levels and --hit-qps must be > 0"),
    (["--hit-dp-size", "1"], "--hit-dp-size 0 (none) or >= 2"),
    (["--docs-per-request", "9"], "--docs-per-request must be between 1 and --docs-per-tenant"),
    (["--workload", "shared", "--corpus-docs", "2"], "--docs-per-request must be between 1 and --docs-per-tenant"),
    (["--workload", "shared", "--churn", "2"], "--churn must be in [0, 1]"),
])
def test_bad_cluster_input_is_a_clear_error(bad: list[str], message: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "cluster", "--out", str(tmp_path), "--no-progress", *bad]) == 2
    assert message in capsys.readouterr().err


def test_a_working_set_that_one_pool_holds_is_refused(study: Path, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A public pool as large as the measured working set would leave nothing for replicas to share."""
    working_set = json.loads((study / "cluster_summary.json").read_text())["working_set"]["bytes"]
    options = ["--public-pool-size", str(working_set), "--policies", "--no-single", "--no-pooled",
               "--hit-dp-size", "0", "--out", str(tmp_path), *TINY]
    assert main(["eval", "cluster", *options]) == 2
    assert "must be larger than one replica's public pool" in capsys.readouterr().err
    assert not (tmp_path / "cluster.jsonl").exists()
