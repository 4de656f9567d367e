"""The cluster router's policy at scale, on synthetic data: the real ``DocumentIndex`` and
``policy_named(--policy)`` (``cache_aware`` by default; ``ttft`` with each replica given a synthetic
prefill, decode and fetch rate) at many replicas and documents, no Ray, no engines.

Each run:
1. fill: every document is announced by 1-3 replicas (one in memory, the others in host or disk),
   in batches of ``--batch`` events per replica, timed as events applied per second;
2. serve: ``--requests`` requests, each of 3-8 documents of one tenant in a random order plus a
   question, with its token ids (prefix matching included); each is routed (timed: the decision, in
   wall time and in the thread's CPU time, which a busy shared box does not inflate),
   its replica's queue grows by what it prefills for it (every queue drains each step by 1.25 x the
   recent mean prompt over the replica count), the replica records the prompt's prefix and
   announces storing the documents it missed, and a random replica evicts one document a request
   (the churn is timed as events applied per second too);
3. memory (once, under tracemalloc): the index's bytes after the fill over its (document, holder)
   pairs and over its documents.

Then the same requests served by the other policies (``--compare``, one run each), for what each
leaves to prefill.

    python eval/sim_cluster_router.py --json eval/results/cluster_router_sim.json
    python eval/sim_cluster_router.py --replicas 1024 --policy ttft --fetch-credit 0.05 --json ...
"""
import argparse
import gc
import hashlib
import json
import platform
import random
import statistics
import subprocess
import time
import tracemalloc

from hypic.cluster.index import Announcement, DocumentIndex, HoldingEvent, Tier
from hypic.cluster.routing import CacheAware, ReplicaLoad, ReplicaRates, RouteRequest, policy_named

QUESTION_TOKENS = 64
TOKEN_SPAN = 1 << 13  # document d's token ids are d * TOKEN_SPAN + 0 .. tokens - 1


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256, help="events per announcement")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", default="cache_aware", help="the policy timed (cache_aware or ttft)")
    parser.add_argument("--fetch-credit", type=float, default=None,
                        help="the timed policy's fetch_credit (the service sets 0.05; default: none, documents rebuilt)")
    parser.add_argument("--compare", default="prefix,power_of_two,round_robin",
                        help="other policies to serve the same requests with, one run each (empty: none)")
    parser.add_argument("--json", help="write the per-run data here")
    return parser.parse_args()


class Corpus:
    """Documents (content-address keys, token counts, tenants) and who holds them at the start."""

    def __init__(self, args: argparse.Namespace, rng: random.Random) -> None:
        self.keys = [hashlib.sha256(b"doc%d" % d).hexdigest() for d in range(args.documents)]
        self.tokens = [rng.randint(500, 4000) for _ in range(args.documents)]
        self.tenant_of = [d % args.tenants for d in range(args.documents)]
        self.replicas = [f"replica-{r:02d}" for r in range(args.replicas)]
        self.holders = [self._holders(rng) for _ in range(args.documents)]

    def _holders(self, rng: random.Random) -> list[tuple[str, Tier]]:
        count = rng.choices((1, 2, 3), weights=(5, 3, 2))[0]
        chosen = rng.sample(self.replicas, count)
        return [(chosen[0], Tier.MEMORY)] + [(r, rng.choice((Tier.HOST, Tier.DISK))) for r in chosen[1:]]

    def namespace(self, d: int) -> str:
        return f"tenant-{self.tenant_of[d]}"

    def stored(self, d: int, tier: Tier) -> HoldingEvent:
        return HoldingEvent("stored", self.keys[d], self.namespace(d), tier, self.tokens[d])

    def pairs(self) -> int:
        return sum(len(h) for h in self.holders)


class Announcer:
    """Each replica's event numbering, cut into announcements."""

    def __init__(self, replicas: list[str]) -> None:
        self.seq = dict.fromkeys(replicas, 0)
        self.incarnation = dict.fromkeys(replicas, 1)

    def start(self, index: DocumentIndex) -> None:
        """Every replica's first dump: empty (what it then stores comes in numbered announcements)."""
        for replica in self.seq:
            assert index.apply(Announcement(replica, str(self.incarnation[replica]), 0, (), full=True))

    def restart(self, replica: str, index: DocumentIndex) -> None:
        """``replica``'s process starts again, empty."""
        self.seq[replica], self.incarnation[replica] = 0, self.incarnation[replica] + 1
        assert index.apply(Announcement(replica, str(self.incarnation[replica]), 0, (), full=True))

    def announce(self, replica: str, events: list[HoldingEvent]) -> Announcement:
        self.seq[replica] += len(events)
        return Announcement(replica, str(self.incarnation[replica]), self.seq[replica], tuple(events))


def fill_announcements(corpus: Corpus, announcer: Announcer, batch: int) -> list[Announcement]:
    pending: dict[str, list[HoldingEvent]] = {r: [] for r in corpus.replicas}
    out = []
    for d, holders in enumerate(corpus.holders):
        for replica, tier in holders:
            pending[replica].append(corpus.stored(d, tier))
            if len(pending[replica]) == batch:
                out.append(announcer.announce(replica, pending[replica]))
                pending[replica] = []
    out.extend(announcer.announce(r, events) for r, events in pending.items() if events)
    return out


def fill(index: DocumentIndex, announcements: list[Announcement]) -> float:
    """Seconds to apply every announcement."""
    start = time.perf_counter()
    for announcement in announcements:
        assert index.apply(announcement)
    return time.perf_counter() - start


def tenant_documents(corpus: Corpus, tenants: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in range(tenants)]
    for d, tenant in enumerate(corpus.tenant_of):
        out[tenant].append(d)
    return out


def make_request(corpus: Corpus, documents: list[int], rng: random.Random) -> tuple[RouteRequest, list[int]]:
    picked = rng.sample(documents, rng.randint(3, 8))
    ids = [t for d in picked for t in range(d * TOKEN_SPAN, d * TOKEN_SPAN + corpus.tokens[d])]
    ids += range(QUESTION_TOKENS)
    docs = tuple((corpus.keys[d], corpus.tokens[d]) for d in picked)
    return RouteRequest(corpus.namespace(picked[0]), docs, len(ids), tuple(ids)), picked


def serve(corpus: Corpus, index: DocumentIndex, announcer: Announcer, args: argparse.Namespace,
          rng: random.Random, policy_name: str) -> dict:
    """Route ``args.requests`` requests, with the replicas' stores and evictions announced between them."""
    options = {"rng": rng} if policy_name == "power_of_two" else {}
    if policy_name in ("cache_aware", "ttft") and args.fetch_credit is not None:
        options["fetch_credit"] = args.fetch_credit
    policy, work = policy_named(policy_name, **options), CacheAware()
    loads = {r: ReplicaLoad(r, rates=synthetic_rates(rng)) for r in corpus.replicas}
    by_tenant = tenant_documents(corpus, args.tenants)
    drain = 0.0
    latencies, cpu, reasons, events, event_s, held_tokens, doc_tokens = [], [], {}, 0, 0.0, 0, 0
    prefilled, queues = 0, []
    for _ in range(args.requests):
        request, picked = make_request(corpus, by_tenant[rng.randrange(args.tenants)], rng)
        start, start_cpu = time.perf_counter_ns(), time.thread_time_ns()
        decision = policy.choose(request, list(loads.values()), index)
        cpu.append(time.thread_time_ns() - start_cpu)
        latencies.append(time.perf_counter_ns() - start)
        reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
        holders = [index.holders(request.namespace, key) for key, _ in request.documents]
        held_tokens += sum(t for (_, t), h in zip(request.documents, holders) if decision.replica in h)
        doc_tokens += request.document_tokens()
        load = loads[decision.replica]
        prefill = int(work.prefill_tokens(request, [decision.replica], index)[decision.replica])  # what it must do
        load.queued_prefill_tokens += prefill
        prefilled += prefill
        drain = 0.8 * drain + 0.2 * request.prompt_tokens / len(loads) * 1.25  # serve ~80 % busy
        for each in loads.values():
            each.queued_prefill_tokens = max(0, each.queued_prefill_tokens - int(drain))
        queues.append(max(each.queued_prefill_tokens for each in loads.values()))
        index.record_prefix(decision.replica, request.token_ids, request.namespace)
        stores = [corpus.stored(d, Tier.MEMORY) for d, h in zip(picked, holders) if h.get(decision.replica) != Tier.MEMORY]
        victim_replica, victim = rng.choice(corpus.replicas), rng.randrange(len(corpus.keys))
        churn = [announcer.announce(decision.replica, stores),
                 announcer.announce(victim_replica, [HoldingEvent("evicted", corpus.keys[victim], tier=Tier.MEMORY)])]
        start = time.perf_counter_ns()
        for announcement in churn:
            assert index.apply(announcement)
        event_s += (time.perf_counter_ns() - start) / 1e9
        events += len(stores) + 1
    latencies.sort()
    cpu.sort()
    return {"requests": len(latencies), "decision_us": percentiles(latencies), "decision_cpu_us": percentiles(cpu),
            "reasons": reasons,
            "held_token_share": held_tokens / doc_tokens, "prefill_tokens_per_request": prefilled / len(latencies),
            "mean_longest_queue": statistics.fmean(queues), "churn_events": events,
            "churn_events_per_s": events / event_s}


def synthetic_rates(rng: random.Random) -> ReplicaRates:
    """A replica's measured rates as the ingress would hold them (what ``ttft`` decides by; the other
    policies ignore them): a prefill of 8k-12k tokens/s, a 20 ms decode step, entries from other
    replicas at 200k tokens/s, 8k-token chunks."""
    return ReplicaRates(rng.uniform(8000, 12000), 0.02, 200_000.0, 8192)


def percentiles(sorted_ns: list[int]) -> dict[str, float]:
    def at(q: float) -> float:
        return sorted_ns[min(len(sorted_ns) - 1, int(q * len(sorted_ns)))] / 1000
    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "p999": at(0.999), "max": sorted_ns[-1] / 1000,
            "mean": statistics.fmean(sorted_ns) / 1000}


def index_memory(corpus: Corpus, batch: int) -> dict:
    """The index's bytes once filled (tracemalloc sees the numpy arrays too), per pair and document."""
    announcer = Announcer(corpus.replicas)
    announcements = fill_announcements(corpus, announcer, batch)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = DocumentIndex()
    announcer.start(index)
    fill(index, announcements)
    after, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    used = after - before
    return {"bytes": used, "peak_bytes": peak - before, "documents": index.documents(), "pairs": corpus.pairs(),
            "bytes_per_pair": used / corpus.pairs(), "bytes_per_document": used / index.documents(),
            "table_rows": len(index._table.keys)}


def machine() -> dict:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    flags = fields.get("Flags", "").split()
    simd = [f for f in ("sse4_2", "avx", "avx2", "avx512f", "avx512bw", "avx512_vnni", "amx_tile") if f in flags]
    return {"model": fields.get("Model name", "").strip(), "arch": platform.machine(),
            "cpus": fields.get("CPU(s)", "").strip(), "simd": simd, "python": platform.python_version()}


def one_run(corpus: Corpus, args: argparse.Namespace, run: int, policy_name: str = "cache_aware") -> dict:
    rng = random.Random(args.seed * 1000 + run)
    announcer = Announcer(corpus.replicas)
    announcements = fill_announcements(corpus, announcer, args.batch)
    events = sum(len(a.events) for a in announcements)
    index = DocumentIndex()
    announcer.start(index)
    seconds = fill(index, announcements)
    del announcements
    result = {"run": run, "policy": policy_name, "fill_events": events, "fill_s": seconds, "fill_events_per_s": events / seconds}
    forget_start = time.perf_counter()
    index.forget(corpus.replicas[-1])
    result["forget_ms"] = (time.perf_counter() - forget_start) * 1000
    announcer.restart(corpus.replicas[-1], index)  # it comes back empty
    result |= serve(corpus, index, announcer, args, rng, policy_name)
    return result


def main() -> None:
    args = parse()
    started = time.perf_counter()
    corpus = Corpus(args, random.Random(args.seed))
    print(f"corpus: {args.documents:,} documents, {corpus.pairs():,} (document, holder) pairs, "
          f"{args.replicas} replicas, {args.tenants} tenants ({time.perf_counter() - started:.1f} s)")
    memory = index_memory(corpus, args.batch)
    print(f"memory: {memory['bytes_per_pair']:.1f} B per (document, holder), {memory['bytes_per_document']:.1f} B per document")
    runs = []
    for run in range(args.runs):
        runs.append(one_run(corpus, args, run, args.policy))
        r = runs[-1]
        print(f"run {run}: fill {r['fill_events_per_s']:,.0f} events/s, churn {r['churn_events_per_s']:,.0f} events/s, "
              f"decision p50 {r['decision_us']['p50']:.0f} us p99 {r['decision_us']['p99']:.0f} us "
              f"(CPU p50 {r['decision_cpu_us']['p50']:.0f} us p99 {r['decision_cpu_us']['p99']:.0f} us), "
              f"forget {r['forget_ms']:.0f} ms, reasons {r['reasons']}, held share {r['held_token_share']:.3f}, "
              f"prefill {r['prefill_tokens_per_request']:,.0f} tokens/request, longest queue {r['mean_longest_queue']:,.0f}")
    for name in filter(None, args.compare.split(",")):
        runs.append(one_run(corpus, args, 0, name))
        r = runs[-1]
        print(f"{name}: held share {r['held_token_share']:.3f}, prefill {r['prefill_tokens_per_request']:,.0f} "
              f"tokens/request, longest queue {r['mean_longest_queue']:,.0f}, decision p50 {r['decision_us']['p50']:.0f} us")
    report = {"args": vars(args), "machine": machine(), "memory": memory, "runs": runs,
              "wall_s": time.perf_counter() - started}
    print(json.dumps(report["machine"]))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
