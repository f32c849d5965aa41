"""A plain PyTorch DeepFM — the baselines ``benchmarks/throughput.py`` runs beside the project.

Same model sizes as the project's DeepFM (an embedding of dim D per field, first-order weights, FM,
MLP 400-400-400, dense features into the linear part and the MLP), written the usual way:
``nn.Embedding(sparse=True)`` tables updated by ``SparseAdam``, the dense part by ``Adam``, batches
sliced from the same preprocessed arrays (numpy → torch), no framework around the loop.

* ``--layout shared`` (the strong baseline): one embedding table and one first-order table for all
  fields, each field's ids shifted by its offset (the sum of the earlier fields' sizes): one lookup
  and one sparse update per step;
* ``--layout per_field``: an ``nn.Embedding`` per field (26 lookups and updates per step);
* ``--mlp-only``: the MLP alone on random inputs of the same width, forward, backward and Adam — the
  dense-compute bound of any DeepFM of these sizes on this machine. With ``--input-grad`` the backward
  also computes the gradient of the embedding columns of the input (a [B, F·D] GEMM more), which a
  DeepFM needs to train its embeddings: the bound a DeepFM can actually reach. ``--project-mlp`` runs
  that bound with the project's MLP layers (the embeddings and dense features as blocks of the first
  layer, hidden layers on oneDNN): the dense compute of the project's own step.

``--precision bf16`` runs the forward under ``torch.autocast("cpu", torch.bfloat16)`` (the loss in fp32), as a user
wraps a plain model on a CPU with bf16 instructions: the baseline of ``trainer.precision=bf16-mixed``.

    python benchmarks/reference_deepfm.py <store dir> --batch 8192 --epochs 1 --dim 16 [--layout shared]
prints one JSON line: samples_per_s (training only), test_auc, test_logloss (null for --mlp-only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_mlp(width: int, mlp: list[int]) -> nn.Sequential:
    layers, d = [], width
    for h in mlp:
        layers += [nn.Linear(d, h), nn.ReLU()]
        d = h
    return nn.Sequential(*layers, nn.Linear(d, 1))


class PlainDeepFM(nn.Module):
    def __init__(self, table_sizes: list[int], n_dense: int, dim: int, mlp: list[int], shared: bool) -> None:
        super().__init__()
        self.shared = shared
        sizes = [sum(table_sizes)] if shared else table_sizes
        self.emb = nn.ModuleList(nn.Embedding(n, dim, sparse=True) for n in sizes)
        self.first = nn.ModuleList(nn.Embedding(n, 1, sparse=True) for n in sizes)
        self.register_buffer("offsets", torch.tensor([0, *np.cumsum(table_sizes)[:-1]], dtype=torch.int64))
        for e in self.emb:
            nn.init.normal_(e.weight, std=0.01)
        for e in self.first:
            nn.init.zeros_(e.weight)
        self.linear = nn.Linear(n_dense, 1)
        self.mlp = make_mlp(len(table_sizes) * dim + n_dense, mlp)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        if self.shared:  # [B, F] ids + field offsets → one lookup of [B, F, D]
            ids = sparse + self.offsets
            emb, first = self.emb[0](ids), self.first[0](ids).sum((1, 2))
        else:
            emb = torch.stack([e(sparse[:, j]) for j, e in enumerate(self.emb)], 1)  # [B, F, D]
            first = torch.cat([e(sparse[:, j]) for j, e in enumerate(self.first)], 1).sum(1)
        fm = 0.5 * (emb.sum(1).pow(2) - emb.pow(2).sum(1)).sum(1)
        deep = self.mlp(torch.cat([emb.flatten(1), dense], 1)).squeeze(1)
        return first + self.linear(dense).squeeze(1) + fm + deep


def mlp_bound(width: int, batch: int, steps: int, lr: float, grad_width: int = 0, project: bool = False) -> float:
    """Samples/s of the MLP alone: forward, backward and Adam on random [batch, width] inputs; the
    backward also computes the input gradient of the first ``grad_width`` columns (the embeddings).
    ``project``: the project's MLP (:class:`modules.models.layers.MLP`: the embeddings and the dense
    features as two blocks of the first layer, hidden layers on oneDNN) instead of the plain one."""
    if project:
        from modules.models.layers import MLP
        mlp: nn.Module = MLP((grad_width, width - grad_width), [400, 400, 400], 1)
    else:
        mlp = make_mlp(width, [400, 400, 400])
    opt = torch.optim.Adam(mlp.parameters(), lr=lr)
    x, y = torch.randn(batch, width), torch.randint(0, 2, (batch,)).float()
    emb = x[:, :grad_width].clone().requires_grad_() if grad_width else None
    for step in range(steps + 3):
        if step == 3:  # after warm-up
            t0 = time.perf_counter()
        if project:
            inputs = (emb, x[:, grad_width:])
        else:
            inputs = x if emb is None else torch.cat([emb, x[:, grad_width:]], 1)  # as DeepFM concatenates them
        loss = F.binary_cross_entropy_with_logits(mlp(inputs).squeeze(1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if emb is not None:
            emb.grad = None
    return steps * batch / (time.perf_counter() - t0)


def main() -> None:
    from torchmetrics.functional.classification import binary_auroc

    from pipeline.data.store import ColumnarStore

    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layout", choices=["shared", "per_field"], default="shared")
    p.add_argument("--mlp-only", action="store_true", help="the MLP alone: the dense-compute bound")
    p.add_argument("--input-grad", action="store_true", help="with --mlp-only: also the embedding input's gradient")
    p.add_argument("--project-mlp", action="store_true", help="with --mlp-only --input-grad: the project's MLP layers")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: the forward under autocast")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    store = ColumnarStore(args.store)
    sizes = [store.table_sizes[c] for c in store.categorical_names]
    if args.mlp_only:
        steps = store.meta["splits"]["train"] // args.batch * args.epochs
        width = len(sizes) * args.dim + len(store.dense_names)
        grad_width = len(sizes) * args.dim if args.input_grad else 0
        if args.project_mlp and not args.input_grad:
            raise SystemExit("--project-mlp needs --input-grad (its first layer takes the embeddings as a block)")
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            rate = mlp_bound(width, args.batch, steps, args.lr, grad_width, args.project_mlp)
        print(json.dumps({"samples_per_s": rate,
                          "test_auc": None,
                          "test_logloss": None}))
        return
    train, test = store.split("train", mmap=False), store.split("test", mmap=False)
    model = PlainDeepFM(sizes, len(store.dense_names), args.dim, [400, 400, 400], args.layout == "shared")
    sparse_params = [p for m in (*model.emb, *model.first) for p in m.parameters()]
    ids = {id(p) for p in sparse_params}
    dense_opt = torch.optim.Adam([p for p in model.parameters() if id(p) not in ids], lr=args.lr)
    sparse_opt = torch.optim.SparseAdam(sparse_params, lr=args.lr)
    dense_t, sparse_t = torch.from_numpy(train.dense), torch.from_numpy(train.sparse.astype(np.int64))
    label_t = torch.from_numpy(train.label.astype(np.float32))
    n = len(train) // args.batch * args.batch
    seconds = 0.0
    for epoch in range(args.epochs):
        order = torch.from_numpy(np.random.default_rng([args.seed, epoch]).permutation(len(train)))
        t0 = time.perf_counter()
        for start in range(0, n, args.batch):
            rows = order[start:start + args.batch]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                logits = model(dense_t[rows], sparse_t[rows])
            loss = F.binary_cross_entropy_with_logits(logits.float(), label_t[rows])
            dense_opt.zero_grad()
            sparse_opt.zero_grad()
            loss.backward()
            dense_opt.step()
            sparse_opt.step()
        seconds += time.perf_counter() - t0
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
        logits = torch.cat([model(torch.from_numpy(test.dense[i:i + 65536]),
                                  torch.from_numpy(test.sparse[i:i + 65536].astype(np.int64))).float()
                            for i in range(0, len(test), 65536)])
    y = torch.from_numpy(test.label.astype(np.int64))
    print(json.dumps({"samples_per_s": n * args.epochs / seconds,
                      "test_auc": float(binary_auroc(torch.sigmoid(logits), y)),
                      "test_logloss": float(F.binary_cross_entropy_with_logits(logits, y.float()))}))


if __name__ == "__main__":
    main()
