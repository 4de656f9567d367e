"""What fetching a document from the replica that holds it, instead of rebuilding it, does to the
replicas' hit rate, replayed against stand-in replicas (``hypic.evaluation.pool_replay``: least-
recently-used pools, the real ``DocumentIndex`` and the real policies), no engines and no clock:
every number is a count, the same on every machine.

Workloads: ``shared``, one knowledge base every user asks (400 documents, Zipf popularity 1.0, 5 a
request in random order, each replica's pool 1/N of 120 documents), at 2, 4 and 8 replicas; and the
cluster study's tenants (8 x 6 documents, 3 a request, pools of 25 documents at 2 replicas, 13 at 4),
without and with churn (a document new to its tenant in 20 % of requests). For each shape and drain
rate, each policy's mean over ``--seeds`` workload seeds against ``pooled`` (one replica whose pool is
all of theirs together). The hit rate counts a document found where the request went, or fetched
from the replica that held it; ``cold`` is the share no replica held (built wherever the request
went), ``rebuilt`` the share built though another replica held it (no fetch).

Policies: ``cache_aware`` as it routes today (rebuilds what another replica holds); ``+fetch``: the
same policy told that a document another replica holds costs 5 % of its tokens to fetch, the
replicas fetching it (the copy used for the request, not kept); ``+fetch keep``: the copy kept in the
pool it was fetched to; ``round_robin``, alone and with fetch.

    python eval/sim_shared_corpus.py --json eval/results/cluster/shared_corpus/replay.json
"""
import argparse
import json
import statistics
from dataclasses import asdict, replace

from hypic.cluster.routing import policy_named
from hypic.evaluation.pool_replay import ReplayShape, replay_level
from hypic.evaluation.tenants import TenantConfig, TenantWorkload, shared_corpus

DOC_TOKENS = 285  # a document of 160 words on the shipped model
FETCH_CREDIT = 0.05  # a fetched document's cost in prefill tokens of it (an entry moves far faster than it is rebuilt)
DRAINS = (150, 600)  # tokens each queue drains per request: busy, light
WORKLOADS = {  # name -> (the workload of a seed, [(replicas, one pool in documents)], warm-up, timed requests)
    "shared": (lambda seed: shared_corpus(seed=seed), [(2, 60), (4, 30), (8, 15)], 200, 400),
    "tenants": (lambda seed: TenantConfig(seed=seed), [(2, 25), (4, 13)], 16, 96),
    "tenants_churn": (lambda seed: TenantConfig(seed=seed, churn=0.2), [(2, 25), (4, 13)], 16, 96),
}
POLICIES = {  # name -> (policy, fetch, keep the fetched copy)
    "cache_aware": (lambda: policy_named("cache_aware"), False, True),
    "cache_aware+fetch": (lambda: policy_named("cache_aware", fetch_credit=FETCH_CREDIT), True, False),
    "cache_aware+fetch keep": (lambda: policy_named("cache_aware", fetch_credit=FETCH_CREDIT), True, True),
    "round_robin": (lambda: policy_named("round_robin"), False, True),
    "round_robin+fetch": (lambda: policy_named("round_robin"), True, False),
}


def levels(make_policy, workload, shape: ReplayShape, seeds: int) -> list[dict[str, float]]:
    return [replay_level(make_policy(), TenantWorkload(workload(seed)), shape) for seed in range(seeds)]


def one_shape(name: str, replicas: int, pool_docs: int, drain: float, seeds: int) -> dict:
    workload, _, warm, timed = WORKLOADS[name]
    shape = ReplayShape(replicas, pool_docs * DOC_TOKENS, DOC_TOKENS, drain, warm, timed)
    pooled = replace(shape, replicas=1, pool_tokens=replicas * shape.pool_tokens)
    found = {"pooled": levels(lambda: policy_named("round_robin"), workload, pooled, seeds)}
    for policy, (make, fetch, keep) in POLICIES.items():
        found[policy] = levels(make, workload, replace(shape, fetch=fetch, keep_fetched=keep), seeds)
    mean = {policy: {key: statistics.mean(level[key] for level in rows) for key in rows[0]}
            for policy, rows in found.items()}
    return {"workload": name, "shape": asdict(shape), "pool_documents": pool_docs, "levels": found, "mean": mean,
            "of_pooled": {p: m["hit_rate_with_fetch"] / mean["pooled"]["hit_rate_with_fetch"] for p, m in mean.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10, help="workload seeds, one level each")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--json", help="write every level's counts here")
    args = parser.parse_args()
    rows = []
    for name in args.workloads:
        for replicas, pool_docs in WORKLOADS[name][1]:
            for drain in DRAINS:
                row = one_shape(name, replicas, pool_docs, drain, args.seeds)
                rows.append(row)
                cold = row["mean"]["pooled"]["cold"]
                print(f"{name}: {replicas} replicas, pool {pool_docs} documents, drain {drain:g}: pooled "
                      f"{row['mean']['pooled']['hit_rate_with_fetch']:.3f} (cold {cold:.3f}); "
                      + ", ".join(f"{p} {r:.2f}x (cold {row['mean'][p]['cold']:.3f}, rebuilt {row['mean'][p]['rebuilt']:.3f})"
                                  for p, r in row["of_pooled"].items() if p != "pooled"), flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"study": "shared corpus replay", "seeds": args.seeds, "fetch_credit": FETCH_CREDIT,
                       "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
