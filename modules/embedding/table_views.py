"""Reading and writing a sharded model's tables through their weight views, with caches in front of them.

A TorchRec state dict (checkpoints, the model folder, ``init_from``, the best-epoch copy) holds views of each table's
backing store. Two kinds of kernel train rows somewhere else first:

* the CPU ``ssd`` tier (:class:`modules.embedding.ssd_tier.cached_tbe.CachedRowsTBE`): rows in a row cache in host
  memory, the files behind;
* FBGEMM's UVM caching kernels (tier ``uvm_cache`` on CUDA): rows in cache lines in GPU memory
  (``lxu_cache_weights``), the UVM store (host memory mapped into the GPU) behind.

So the views hold every row only after :func:`sync_tables` (the row cache writes its rows to the files; FBGEMM's
``flush`` writes the cache lines back to the UVM store), and after anything writes the views from outside,
:func:`reload_tables` makes the caches forget what they hold (the row cache drops its slots; FBGEMM's
``reset_cache_states`` invalidates every line), so the next lookup reads the written rows, not stale cached ones.
Call :func:`sync_tables` before a write as well when only some rows are written.
"""

from __future__ import annotations

from torch import nn

from modules.embedding.sharded_kernels import kernels
from modules.embedding.ssd_tier.cached_tbe import CachedRowsTBE, cached_tbes


def uvm_cached(model: nn.Module) -> list[nn.Module]:
    """FBGEMM kernels of a DMP model with a cache in GPU memory in front of their UVM tables (CUDA only)."""
    out = []
    for _, _, kernel in kernels(model):
        emb = getattr(kernel, "emb_module", None)
        lines = getattr(emb, "lxu_cache_weights", None)
        if lines is not None and lines.numel() and not isinstance(emb, CachedRowsTBE):
            out.append(emb)
    return out


def sync_tables(model: nn.Module) -> None:
    """Before the tables are read through their views: every row written to its backing store."""
    for tbe in cached_tbes(model):
        tbe.sync_to_file()
    for tbe in uvm_cached(model):
        tbe.flush()


def reload_tables(model: nn.Module) -> None:
    """After the views were written from outside: the caches forget the rows they hold."""
    for tbe in cached_tbes(model):
        tbe.reload()
    for tbe in uvm_cached(model):
        tbe.reset_cache_states()
