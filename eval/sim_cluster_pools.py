"""How well each routing policy keeps a working set larger than one replica's pool cached: the cluster
study's tenant workload (8 tenants x 6 documents, 3 a request) replayed against stand-in replicas
(``hypic.evaluation.pool_replay``: least-recently-used pools, the real ``DocumentIndex`` and the real
policies), no engines and no clock, so every number here is a count, the same on every machine.

For each shape (replicas, one pool's size in documents, how fast the queues drain) and each policy:
the timed segment hit rate of one level per workload seed (``--seeds``), and its mean over the
seeds against ``pooled``'s (one replica whose pool is all the replicas' pools together: the
reference the study's hit-rate target is measured against). ``cache_aware`` runs at each
``--eviction-weights`` value so the weight's choice can be seen.

    python eval/sim_cluster_pools.py --json eval/results/cluster/pool_replay/pool_replay.json
"""
import argparse
import json
import random
import statistics
from dataclasses import asdict, replace

from hypic.cluster.routing import policy_named
from hypic.evaluation.pool_replay import ReplayShape, replay_level
from hypic.evaluation.tenants import TenantConfig, TenantWorkload

DOC_TOKENS = 285  # a document of the study's 160 words on the shipped model
SHAPES = [(2, 25), (2, 20), (2, 30), (4, 13)]  # (replicas, one pool in documents): the study's is (2, 25)
DRAINS = (150, 300, 600)  # tokens each queue drains per request: busy, moderate, light
OTHERS = ("round_robin", "prefix")  # and power_of_two, on a seeded generator


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10, help="workload seeds, one level each")
    parser.add_argument("--eviction-weights", type=float, nargs="+", default=[0.0, 1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--json", help="write every level's hit rate here")
    return parser.parse_args()


def levels(make_policy, shape: ReplayShape, seeds: int) -> list[float]:
    return [replay_level(make_policy(), TenantWorkload(TenantConfig(seed=seed)), shape)["segment_hit_rate"]
            for seed in range(seeds)]


def policies(weights: list[float]) -> dict[str, object]:
    made = {f"cache_aware w={w:g}": (lambda w=w: policy_named("cache_aware", eviction_weight=w)) for w in weights}
    made["cache_aware (default)"] = lambda: policy_named("cache_aware")
    made.update({name: (lambda name=name: policy_named(name)) for name in OTHERS})
    made["power_of_two"] = lambda: policy_named("power_of_two", rng=random.Random(0))  # the same draws every run
    return made


def one_shape(replicas: int, pool_docs: int, drain: float, args: argparse.Namespace) -> dict:
    shape = ReplayShape(replicas, pool_docs * DOC_TOKENS, DOC_TOKENS, drain)
    pooled = replace(shape, replicas=1, pool_tokens=replicas * shape.pool_tokens)
    rates = {"pooled": levels(lambda: policy_named("round_robin"), pooled, args.seeds)}
    rates.update({name: levels(make, shape, args.seeds) for name, make in policies(args.eviction_weights).items()})
    return {"shape": asdict(shape), "pool_documents": pool_docs, "hit_rates": rates,
            "mean": {name: statistics.mean(r) for name, r in rates.items()}}


def main() -> None:
    args = parse()
    rows = [one_shape(n, docs, drain, args) for n, docs in SHAPES for drain in DRAINS]
    for row in rows:
        mean = row["mean"]
        print(f"replicas {row['shape']['replicas']}, pool {row['pool_documents']} of 48 documents, drain "
              f"{row['shape']['drain_tokens']:g}: pooled {mean['pooled']:.3f}; "
              + ", ".join(f"{name} {rate:.3f} ({rate / mean['pooled']:.3f}x)"
                          for name, rate in mean.items() if name != "pooled"))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"study": "cluster pool replay", "seeds": args.seeds, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
