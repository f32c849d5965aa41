"""The ``ssd`` tier on CPU: embedding tables in files, trained through a row cache in host memory.

* :mod:`.files` — the seam: while DistributedModelParallel builds the sharded modules, each FBGEMM
  table batch made only of ``ssd`` tables gets memory-mapped files as its host buffers and becomes a
  :class:`~.cached_tbe.CachedRowsTBE`;
* :mod:`.cached_tbe` — that module: ids remapped to slots, FBGEMM's own kernel run on the slots;
  what reads or writes the files from outside calls :mod:`modules.embedding.table_views` first;
* :mod:`.row_cache` — the set-associative cache of one table batch's tables (each its own sets and slot
  table): lookup, LFU/LRU eviction, write-back, rows drawn when first met (their initial values:
  :mod:`modules.embedding.row_init`); what it works on and counts: :mod:`.backing`;
* :mod:`.rows_ahead` — the next training batch's rows brought into the cache in a thread while the current
  step computes (one process);
* :mod:`.set_victims` — the eviction policy, and the per-row step (lookup, victims) in torch;
* :mod:`.native_loops` — the per-row loops in C (``cache_loops.c``: slot assignment, the runs' Bloom filters and
  page lookups), built on first use; their torch / numpy twins are the reference and the fallback;
* :mod:`.sorted_runs` — evicted dirty rows kept as sorted runs on disk (an LSM store; a run's records:
  :mod:`.paged_records`), merged in key
  order, and written to their scattered homes in one sweep when something reads the files.

Placement (which tables, how many cache rows) is :mod:`modules.sharding.placement`; docs/ssd_tier.md has the
measurements.
"""
