"""The embedding tables: what the models look up, how rows start and start again, where a sharded model's
kernels are, and the tiers that hold rows outside FBGEMM's own memory.

* :mod:`.feature_spec` — what a model knows of the data: features, the tables they read, the tables' sizes;
* :mod:`.sparse_arch` — the sparse side every model shares: TorchRec collections over the sparse features, the
  first-order table, stacking of one-id tables, pooling of bags;
* :mod:`.lookup_inputs` — what the collections are fed (shifted ids of shared and stacked tables) and the id
  checks (an id outside its table is refused before any lookup);
* :mod:`.row_init` — initial rows drawn from (seed, table, row), the same wherever a table sits;
* :mod:`.row_reset` — rows that start afresh while training (an id evicted by ``model.zch``);
* :mod:`.sharded_kernels` — where TorchRec put the FBGEMM kernels of a sharded model and what each holds;
* :mod:`.ssd_tier` — tables in files behind a row cache in host memory (the CPU ``ssd`` tier);
* :mod:`.table_views` — reading and writing tables through their views, with a row cache or UVM cache in front;
* :mod:`.zch` — raw 64-bit ids mapped to rows without collisions, with eviction and admission.

Placing and sharding the tables is :mod:`modules.sharding`; what acts on their gradients is :mod:`modules.optim`.

May import: modules
"""
