"""``model.zch``: raw 64-bit feature ids mapped to table rows without collisions while there is room.

* :mod:`.remapper` — the config and the remapper in front of the sharded model (TorchRec's
  ``MCHManagedCollisionModule`` per table), its state and the read-only lookup serving uses;
* :mod:`.ttl` — eviction by a TTL in days of data;
* :mod:`.admission` — admission by frequency (new ids counted exactly on a bounded probation list).
"""
