"""The caches: what a request reuses and how it is kept.

- ``segments``: a prompt's anatomy (leading part, PIC segments, query), seams, recompute layout;
- ``modes``: each prefill mode as a policy (what it reuses, its private-pool tree);
- ``plan``: a request's reuse worked out once (``RequestPlan``);
- ``composition``: transitions and eq. 6 (composing cached linear states);
- ``store``: the public pool of segment entries; ``eviction``: its eviction orders;
  ``entry_check``: what an entry must be to be spliced by a model;
- ``prefix_cache``: the private pool (a radix tree of request states, KV in shared pages);
- ``tiers``: the public pool below memory (disk, Mooncake Store).

The engine, the serving loop and the model runtime use these; nothing here drives a model.
"""
