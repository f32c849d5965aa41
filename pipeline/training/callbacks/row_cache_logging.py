"""The CPU ``ssd`` tier's row caches (:mod:`modules.embedding.ssd_tier.row_cache`) in MLflow and the log: their size
as parameters, every ``log_every_n_steps`` steps the hit rate and the rows and bytes read, drawn and written per
step since the last log (``ssd/*``), and the whole training's totals on each rank's last line."""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback

from modules.embedding.ssd_tier.backing import CacheStats
from modules.embedding.ssd_tier.cached_tbe import cached_tbes


class RowCacheLogging(Callback):
    def __init__(self) -> None:
        self.totals = CacheStats()  # over training
        self.bytes = [0.0, 0.0]     # read, written

    def on_train_start(self, trainer: L.Trainer, task: L.LightningModule) -> None:
        caches = cached_tbes(task.model)
        if caches and trainer.logger is not None:
            trainer.logger.log_hyperparams({"ssd/cache_rows": sum(t.cache_slots for t in caches),
                                            "ssd/cache_mb": round(sum(t.cache_bytes for t in caches) / 2**20, 1),
                                            "ssd/cache_policy": task.topology.ssd.cache_policy})

    def _take(self, task: L.LightningModule) -> list[tuple[CacheStats, float]]:
        stats = [(t.take_stats(), t.row_bytes) for t in cached_tbes(task.model)]
        for step, row_bytes in stats:
            self.bytes[0] += step.rows_read * row_bytes
            self.bytes[1] += step.rows_written * row_bytes
            self.totals.add(step)
        return stats

    def on_train_batch_end(self, trainer: L.Trainer, task: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        every = max(1, trainer.log_every_n_steps)
        if trainer.global_step % every or not (stats := self._take(task)):
            return
        lookups = sum(s.lookups for s, _ in stats)
        task.log_dict({"ssd/hit_rate": sum(s.hits for s, _ in stats) / max(1, lookups),
                       "ssd/rows_read": sum(s.rows_read for s, _ in stats) / every,
                       "ssd/rows_drawn": sum(s.rows_drawn for s, _ in stats) / every,
                       "ssd/rows_written": sum(s.rows_written for s, _ in stats) / every,
                       "ssd/bytes_read": sum(s.rows_read * b for s, b in stats) / every,
                       "ssd/bytes_written": sum(s.rows_written * b for s, b in stats) / every})

    def on_fit_end(self, trainer: L.Trainer, task: L.LightningModule) -> None:
        """(After the task's own ``on_train_end``, whose L2 flush writes rows through the caches too.)"""
        tbes = cached_tbes(task.model)
        if not tbes:
            return
        self._take(task)
        t, (read, written) = self.totals, self.bytes
        print(f"Row caches (rank {trainer.global_rank}): {sum(x.cache_slots for x in tbes):,} rows, "
              f"{sum(x.cache_bytes for x in tbes) / 2**20:,.0f} MB; training: hit rate {t.hits / max(1, t.lookups):.4f} "
              f"of {t.lookups:,} row lookups, rows read {t.rows_read:,} ({read / 2**20:,.0f} MB), drawn "
              f"{t.rows_drawn:,}, written {t.rows_written:,} ({written / 2**20:,.0f} MB)", flush=True)
