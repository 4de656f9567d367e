"""``hypic eval``: the accuracy-TTFT studies of section 6 of the paper "HYPIC: Accelerating
Hybrid-Attention LLM Serving with Position-Independent Caching" (the figures named below are its)
as a tool for a user's own model and data. Apart from the runtime: it drives an ``Engine`` or a server like any client would.

- ``metrics``: exact match, token F1 (SQuAD / LongBench normalisation), ROUGE-L (rouge-score),
  the first token where two greedy outputs part;
- ``data``: LongBench-format JSONL and the synthetic multi-document QA, split into documents;
- ``methods``: full, prefix, naive and hypic (any w), each with an explicit warm-up policy;
- ``results``: resumable per-sample JSONL;
- ``targets``: the in-process engine, or a running server's SGLang ``/generate`` (``--url``);
- ``studies``: ``pareto`` and ``seam``, with their summary tables and figures; ``drift``: per-layer state
  drift; ``scaling``: the Fig. 12 TTFT sweeps;
- ``trace`` and ``load``: a Prod-RAG-like request trace replayed against servers at rising QPS
  (Fig. 11); ``parallel``: a cold request on 1..N Ray workers
  (Fig. 14);
- ``cli``: the ``hypic eval`` command.
"""
