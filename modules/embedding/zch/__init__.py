"""``model.zch``: raw 64-bit feature ids mapped to table rows without collisions while there is room.

* :mod:`.config` — ``model.zch``, typed, and the rows every table reserves;
* :mod:`.remapper` — the remapper in front of the sharded model (TorchRec's ``MCHManagedCollisionModule`` per
  table, or per bucket of a table);
* :mod:`.ttl` — eviction by a TTL in the data's own time (its day, or its rows' times);
* :mod:`.exchange` — the mapping split over the ranks (tables' buckets dealt to ranks) and the ids' way to it and back;
* :mod:`.mapping` — the mapping as state: gathered for a model folder, continued, and read-only for scoring;
* :mod:`.admission` — admission by frequency (new ids counted exactly on a bounded probation list).
"""
