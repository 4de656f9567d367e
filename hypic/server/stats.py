"""Counters of the engine loop, and their Prometheus text exposition."""
from typing import Any

from ..scheduler.stats import PREFILL_TOTALS, TTFT_BUCKETS


def prometheus_text(snapshot: dict[str, Any], workers: dict[str, Any] | None = None) -> str:
    """The loop's published snapshot (and, with peers, the workers' status) in the Prometheus text
    format (metric prefix ``hypic_``)."""
    lines: list[str] = []

    def metric(name: str, kind: str, value: float, help_text: str) -> None:
        lines.extend(_metric_lines(name, kind, help_text, {"": value}))

    for name in ("requests_received", "requests_finished", "requests_cancelled", "requests_failed", "requests_refused",
                 "generated_tokens", *PREFILL_TOTALS):
        metric(f"{name}_total", "counter", snapshot[name], name.replace("_", " "))
    metric("heap_trimmed_bytes_total", "counter", snapshot.get("heap_trimmed_bytes", 0),
           "resident bytes the C allocator gave back to the system when the loop trimmed it")
    lines.extend(_metric_lines("loop_errors_total", "counter", "failures of engine-loop steps no request depends on "
                               "(heap trim, counters' snapshot): logged, and the loop goes on",
                               {f'{{step="{step}"}}': count for step, count in snapshot.get("loop_errors", {}).items()}))
    metric("waiting_requests", "gauge", snapshot["waiting_requests"], "requests waiting for prefill")
    metric("running_requests", "gauge", snapshot["running_requests"], "requests decoding")
    lines.extend(_metric_lines("requests_in_phase", "gauge", "requests in the loop by phase (queued, building on "
                               "peers, receiving a peer's combine pass, combining here, decoding)",
                               {f'{{phase="{phase}"}}': count for phase, count in snapshot["requests_by_phase"].items()}))
    for pool in ("public_pool", "private_pool"):
        metric(f"{pool}_bytes", "gauge", snapshot[pool]["bytes"],
               f"bytes held by the {pool.replace('_', ' ')} (the private pool's KV: whole arena slots)")
        metric(f"{pool}_evictions_total", "counter", snapshot[pool]["evictions"], f"{pool.replace('_', ' ')} evictions")
    for pool, value in snapshot.get("running_state_bytes", {}).items():
        metric(f"running_state_{pool}_bytes", "gauge", value,
               f"bytes of the running requests' states in {pool.replace('_', ' ')} layers")
    metric("running_state_shared_bytes", "gauge", snapshot.get("running_shared_bytes", 0),
           "bytes of KV the running requests read without owning it (private-pool pages, prompts shared by samples)")
    for pool, key, kind, help_text in POOL_DETAILS:
        suffix = "_total" if kind == "counter" else ""
        metric(f"{pool}_{key}{suffix}", kind, snapshot[pool][key], help_text)
    if snapshot.get("tiers"):
        lines += _tier_lines(snapshot["tiers"])
    if snapshot.get("resume_points"):
        lines += _resume_lines(snapshot["resume_points"])
    lines += ["# HELP hypic_time_to_first_token_seconds time to first token", "# TYPE hypic_time_to_first_token_seconds histogram"]
    timed = snapshot.get("ttft_count", snapshot["requests_finished"])  # an ingress times the requests itself
    own = _ingress_label(snapshot.get("data_parallel"))
    for bound, count in zip(TTFT_BUCKETS, snapshot["ttft_buckets"]):
        lines.append(f"hypic_time_to_first_token_seconds_bucket{_labels(own, _le(bound))} {count}")
    lines.append(f"hypic_time_to_first_token_seconds_bucket{_labels(own, _le('+Inf'))} {timed}")
    lines.append(f"hypic_time_to_first_token_seconds_sum{_labels(own)} {snapshot['ttft_sum_s']}")
    lines.append(f"hypic_time_to_first_token_seconds_count{_labels(own)} {timed}")
    if "data_parallel" in snapshot:
        lines += _replica_lines(snapshot["data_parallel"], snapshot["routing"])
        for name, help_text in FETCH_TOTALS:
            metric(f"{name}_total", "counter", snapshot.get(name, 0), help_text)
    if workers is not None:
        metric("workers_live", "gauge", len(workers["workers"]), "workers serving (this process included)")
        metric("workers_lost_total", "counter", len(workers["lost_workers"]), "workers lost (died or timed out)")
        for path, count in workers.get("received_entries", {}).items():
            metric(f"peer_entries_received_{path}_total", "counter", count,
                   f"peers' document entries this server received ({path.replace('_', ' ')})")
        if "peer_build_failures" in workers:
            metric("peer_build_failures_total", "counter", workers["peer_build_failures"],
                   "peers' document builds that failed (their documents were recomputed)")
        if "group_rebuilds" in workers:
            metric("transfer_group_rebuilds_total", "counter", workers["group_rebuilds"],
                   "torch.distributed transfer groups built (the first one included)")
    return "\n".join(lines) + "\n"


def _ingress_label(replicas: dict[str, Any] | None) -> str:
    """``ingress="NAME"`` for what one of several ingresses counts itself (each scrape may reach
    another: each one's series only grows), else nothing."""
    if replicas is None or replicas.get("ingress_replicas", 1) <= 1:
        return ""
    return f'ingress="{replicas["ingress"]}"'


def _le(bound: Any) -> str:
    return f'le="{bound}"'


def _labels(*pairs: str) -> str:
    """A sample's label set from ``name="value"`` pairs (empty ones left out; none: no braces)."""
    given = [pair for pair in pairs if pair]
    return "{" + ",".join(given) + "}" if given else ""


ROUTING_HELP = {"documents_fetched": "documents a request's replica was sent from the replica holding them, not built",
                "prefixes_fetched": "prompt heads a request's replica asked another replica's private pool for",
                "refused_for_slo": "requests refused at once: no replica was predicted to meet --ttft-slo and --tbt-slo",
                "documents_copied": "hot documents copied off a busy replica to an idle one ahead of need"}
FETCH_TOTALS = (  # the replicas' own counts of what they fetched
    ("fetched_documents", "documents fetched from other replicas' pools for requests here"),
    ("fetched_bytes", "bytes of those documents' entries"),
    ("fetched_tokens", "tokens of the documents and prompt heads fetched (what a router's fetch rate is read from)"),
    ("fetched_prefixes", "prompt heads fetched from other replicas' private pools for requests here"),
    ("fetched_prefix_tokens", "tokens of those heads"),
    ("fetch_wait_seconds", "seconds requests waited for what other replicas sent them"),
    ("copied_documents", "hot documents copied here from another replica's pool ahead of need"))


def _replica_lines(replicas: dict[str, Any], routing: dict[str, int]) -> list[str]:
    """A replicated service's replicas and its router's decisions (``hypic serve --dp-size``)."""
    lines = _metric_lines("replicas_live", "gauge", "replicas serving", {"": replicas["dp_size"]})
    own = _labels(_ingress_label(replicas))
    for name, count in routing.items():
        help_text = ROUTING_HELP.get(name, f"requests {name.replace('_', ' ')}")
        lines += _metric_lines(f"{name}_total", "counter", help_text, {own: count})
    lines += _metric_lines("replica_documents_held", "gauge", "documents each replica's memory holds",
                           {f'{{replica="{r["replica"]}"}}': r["documents_held"] for r in replicas["replicas"]})
    return lines


TIER_METRICS = (  # (name, kind, field of a tier's status, help)
    ("tier_healthy", "gauge", "healthy", "1 while the tier answers, 0 while it connects or is skipped after a failure"),
    ("tier_connecting", "gauge", "connecting", "1 while the tier makes its first connection (not failed yet)"),
    ("tier_bytes", "gauge", "bytes", "bytes of entry files the tier holds (this server's index)"),
    ("tier_entries", "gauge", "entries", "entry files the tier holds (this server's index)"),
    ("tier_hits_total", "counter", "hits", "memory misses served from the tier"),
    ("tier_misses_total", "counter", "misses", "memory misses the tier did not hold"),
    ("tier_bad_entries_total", "counter", "bad_files", "truncated, damaged or foreign entries found, deleted, recomputed"),
    ("tier_loaded_bytes_total", "counter", "loaded_bytes", "bytes loaded from the tier"),
    ("tier_load_seconds_total", "counter", "load_seconds", "time spent loading from the tier (read, check, decode)"),
    ("tier_load_gigabytes_per_second", "gauge", "load_gb_per_s",
     "mean load rate from the tier since start: loaded bytes / load seconds, in 1e9 bytes a second"),
    ("tier_writes_total", "counter", "writes", "entries written to the tier"),
    ("tier_write_errors_total", "counter", "write_errors", "writes that failed"),
    ("tier_evictions_total", "counter", "evictions", "entries the tier evicted to stay within its budget"),
)


RESUME_METRICS = (  # (name, kind, field of a tier's resume-point counters, help)
    ("resume_points_written_total", "counter", "written", "private-pool resume points written to the tier"),
    ("resume_chunks_written_total", "counter", "chunks_written", "their KV chunks written (a chunk held already is not)"),
    ("resume_written_bytes_total", "counter", "written_bytes", "bytes of resume points and chunks written to the tier"),
    ("resume_write_errors_total", "counter", "write_errors", "resume-point writes that failed"),
)


def _resume_lines(report: dict[str, Any]) -> list[str]:
    """The private pool's resume points below memory: finds, and writes per tier (label ``tier``)."""
    lines = []
    for name, kind, key, help_text in (
            ("resume_hits_total", "counter", "hits", "requests resumed from a resume point below memory"),
            ("resume_misses_total", "counter", "misses", "lookups below memory that found none"),
            ("resume_bad_total", "counter", "bad_files", "damaged, foreign or incomplete resume points found, deleted"),
            ("resume_write_queue", "gauge", "write_queue", "resume points waiting to be written")):
        lines += _metric_lines(name, kind, help_text, {"": float(report[key])})
    for name, kind, key, help_text in RESUME_METRICS:
        lines += _metric_lines(name, kind, help_text, {f'{{tier="{tier}"}}': float(counters[key])
                                                       for tier, counters in report["tiers"].items()})
    return lines


# per-pool numbers beyond bytes and evictions: (pool, key in its snapshot, kind, help)
POOL_DETAILS = (
    ("public_pool", "arena_reserved_bytes", "gauge",
     "bytes of the slabs holding the public pool's (T_C, S_C|0) slots, used and free"),
    ("private_pool", "pages", "gauge",
     "KV pages in the private pool's arenas (the tree's, and evicted ones a request still reads)"),
    ("private_pool", "arena_reserved_bytes", "gauge",
     "bytes of the slabs the private pool's arenas hold (KV pages, snapshot states), slots used and free"),
    ("private_pool", "window_bytes", "gauge",
     "bytes of sliding-window tails held by the private pool (included in private_pool_bytes)"),
    ("private_pool", "snapshot_evictions", "counter",
     "inner resume points that gave up their linear states (their KV kept for deeper ones)"),
    ("private_pool", "window_evictions", "counter",
     "resume points that lost their sliding-window tails to the window budget"),
)


def _metric_lines(name: str, kind: str, help_text: str, samples: dict[str, float]) -> list[str]:
    """One metric's HELP and TYPE lines and its samples (key: the label set, "" for none)."""
    return [f"# HELP hypic_{name} {help_text}", f"# TYPE hypic_{name} {kind}",
            *(f"hypic_{name}{labels} {value}" for labels, value in samples.items())]


def _tier_lines(tiers: dict[str, Any]) -> list[str]:
    """Per-tier metrics (label ``tier``) and the write-back queue."""
    lines = []
    for name, kind, key, help_text in TIER_METRICS:
        lines += _metric_lines(name, kind, help_text, {f'{{tier="{tier}"}}': float(status.get(key) or 0)
                                                       for tier, status in tiers["tiers"].items()})
    for name, kind, key, help_text in (
            ("tier_write_queue", "gauge", "write_queue", "entries waiting to be written to the tiers"),
            ("tier_write_queue_bytes", "gauge", "write_queue_bytes", "bytes waiting to be written"),
            ("tier_dropped_writes_total", "counter", "dropped_writes", "writes dropped because the queue was full")):
        lines += _metric_lines(name, kind, help_text, {"": tiers[key]})
    return lines
