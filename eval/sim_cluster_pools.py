"""How well each routing policy keeps a working set larger than one replica's pool cached: the cluster
study's tenant workload (8 tenants x 6 documents, 3 a request) replayed against stand-in replicas
(``hypic.evaluation.pool_replay``: least-recently-used pools, the real ``DocumentIndex`` and the real
policies), no engines and no clock, so every number here is a count, the same on every machine.

For each shape (replicas, one pool's size in documents, how fast the queues drain) and each policy:
the timed segment hit rate of one level per workload seed (``--seeds``), and its mean over the
seeds against ``pooled``'s (one replica whose pool is all the replicas' pools together: the
reference the study's hit-rate target is measured against). ``cache_aware`` runs at each
``--eviction-weights`` value so the weight's choice can be seen; with ``--tenant-namespaces`` (each
tenant's requests in a namespace of their own) at each ``--namespace-weights`` value instead.

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
    parser.add_argument("--tenant-namespaces", action="store_true", help="a cache namespace per tenant")
    parser.add_argument("--namespace-weights", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0, 2.0, 4.0])
    parser.add_argument("--json", help="write every level's hit rate here")
    return parser.parse_args()


def levels(make_policy, shape: ReplayShape, args: argparse.Namespace) -> list[float]:
    configs = (TenantConfig(seed=seed, tenant_namespaces=args.tenant_namespaces) for seed in range(args.seeds))
    return [replay_level(make_policy(), TenantWorkload(config), shape)["segment_hit_rate"] for config in configs]


def policies(args: argparse.Namespace) -> dict[str, object]:
    option, label, weights = (("namespace_weight", "nw", args.namespace_weights) if args.tenant_namespaces
                              else ("eviction_weight", "w", args.eviction_weights))
    made = {f"cache_aware {label}={w:g}": (lambda w=w: policy_named("cache_aware", **{option: w})) for w in weights}
    made["cache_aware (default)"] = lambda: policy_named("cache_aware")
    made.update({name: (lambda name=name: policy_named(name)) for name in OTHERS})
    made["power_of_two"] = lambda: policy_named("power_of_two", rng=random.Random(0))  # the same draws every run
    return made


def one_shape(replicas: int, pool_docs: int, drain: float, args: argparse.Namespace) -> dict:
    shape = ReplayShape(replicas, pool_docs * DOC_TOKENS, DOC_TOKENS, drain)
    pooled = replace(shape, replicas=1, pool_tokens=replicas * shape.pool_tokens)
    rates = {"pooled": levels(lambda: policy_named("round_robin"), pooled, args)}
    rates.update({name: levels(make, shape, args) for name, make in policies(args).items()})
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
            json.dump({"study": "cluster pool replay", "seeds": args.seeds, "tenant_namespaces": args.tenant_namespaces,
                       "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
