"""``model.zch``: raw 64-bit feature ids mapped to table rows without collisions while there is room.

* :mod:`.config` — ``model.zch``, typed, and the rows every table reserves;
* :mod:`.remapper` — the remapper in front of the sharded model (TorchRec's ``MCHManagedCollisionModule`` per
  table), its state and the read-only lookup serving uses;
* :mod:`.ttl` — eviction by a TTL in the data's own time (its day, or its rows' times);
* :mod:`.global_batch` — the global batch's ids (and latest time) that every rank's remapper admits;
* :mod:`.admission` — admission by frequency (new ids counted exactly on a bounded probation list).
"""
