"""Where the tables go: the hardware topology, the placement of each table on a memory tier (GPU, host
memory with a UVM cache, the ``ssd`` tier) with its row cache, stacking of one-id tables, TorchRec's planner
and DistributedModelParallel, and the plan as a table for people.

* :mod:`.topology` — ``topology``: nodes, ranks, each tier's capacity;
* :mod:`.placement` — tables on tiers within the budget the process leaves (measured), row-cache sizes;
* :mod:`.cache_allocation` — on CPU, host memory shared between whole tables and row caches by lookups served;
* :mod:`.resident_memory` — what the process holds, GPU libraries' pages left out on CPU;
* :mod:`.step_memory` — what a training or evaluation step adds to it;
* :mod:`.table_stacking` — ``model.stack_tables=auto``: whether the one-id tables become one;
* :mod:`.planner` — placement → TorchRec plan → the sharded model; :mod:`.plan_checks` — what a plan needs here;
* :mod:`.plan_report` — the plan per table (rows, bytes, tier, cache);
* :mod:`.replicated_tables` — every table whole on every rank, its looked-up rows merged every k steps.

May import: modules, modules.embedding, modules.models, modules.optim
"""
