"""Time to a target validation AUC: the 1K-batch baseline against large-batch recipes, same data.

    python benchmarks/time_to_auc.py --rows 2400000 --epochs 3 \
        --recipes 1024:none:all 16384:cowclip:all 16384:sqrt:all 65536:cowclip:all:6
    python benchmarks/time_to_auc.py ... --device cuda        # the same measurement on one GPU

The number the CowClip paper sells (12 hours → 10 minutes) is wall time to a given AUC, not AUC at a
given batch. Each recipe ``batch:rule[/embedding_lr][:l2_scope[:epochs]]`` (``16384:cowclip/sqrt:all``: CowClip with the
embedding LR × √s, ``scaling.embedding_lr``) is one ``python -m pipeline.commands.train`` in its own
process with the batch-scaling experiment's settings (``+experiment=batch_scaling``: the reference's
base hyperparameters at batch 1,024, DeepFM, the same synthetic data), validating
``--val-per-epoch`` times per epoch. A callback (:class:`AUCTimeline`, given to the run through
``trainer.callbacks``) records at each validation the seconds spent training so far — validation and
start-up excluded — and the validation AUC. The target is the first recipe's (the baseline's) best
validation AUC minus ``--target-delta``; each recipe's time to target is its training seconds at its
first validation at or above it. The table gives that time, the speed-up against the baseline, the
epochs it took and the recipe's best validation AUC; ``—`` where a recipe never reaches the target.
On a CPU the MLP's cost per sample bounds what a larger batch can save, and the embedding Adam of
the reference's settings runs on dense gradients there (O(table) per step: the 1K baseline pays it
most); the GPU line runs the same recipes with every optimizer fused.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import Callback

ROOT = Path(__file__).resolve().parents[1]


class AUCTimeline(Callback):
    """Writes ``[{"train_seconds", "epoch", "step", "val_auc"}, ...]`` to ``path`` at each validation
    (training seconds: time between the start and end of training batches, summed)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.train_seconds = 0.0
        self.points: list[dict] = []
        self._t0: float | None = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        if self._t0 is not None:
            self.train_seconds += time.perf_counter() - self._t0
            self._t0 = None

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        auc = trainer.callback_metrics.get("val/auc")
        if trainer.sanity_checking or auc is None or not trainer.is_global_zero:
            return
        steps_per_epoch = max(1, trainer.num_training_batches)
        self.points.append({"train_seconds": self.train_seconds, "step": trainer.global_step,
                            "epoch": trainer.global_step / steps_per_epoch, "val_auc": float(auc)})
        self.path.write_text(json.dumps(self.points))


def run_recipe(recipe: str, args: argparse.Namespace, out: Path) -> list[dict]:
    """One recipe's timeline; a recipe finished earlier in ``out`` (its ``.done`` file) is read, not run again."""
    parts = recipe.split(":")
    batch, rule = parts[:2]
    rule, _, embedding_lr = rule.partition("/")  # cowclip/sqrt: CowClip with the embedding LR × √s
    scope = parts[2] if len(parts) > 2 else "batch"
    epochs = parts[3] if len(parts) > 3 else args.epochs
    timeline = out / f"{recipe.replace(':', '_').replace('/', '-')}.json"
    done = timeline.with_suffix(".done")
    if done.exists():
        print(f"[{recipe}] finished earlier: {timeline}", flush=True)
        return json.loads(timeline.read_text())
    cmd = [sys.executable, "-m", "pipeline.commands.train", "+experiment=batch_scaling", "hydra.mode=RUN",
           f"hydra.run.dir={out / timeline.stem}", f"data.synthetic.rows={args.rows}",
           f"paths.cache_dir={out / 'cache'}", f"trainer.batch_size={batch}", f"scaling={rule}",
           f"optim.embedding_l2_scope={scope}", f"trainer.max_epochs={epochs}",
           "trainer.early_stopping_patience=null", f"trainer.val_check_interval={1.0 / args.val_per_epoch}",
           "trainer.enable_progress_bar=false", "logger.log_model=false", f"seed={args.seed}",
           f"logger.tracking_uri=sqlite:///{out / 'mlflow.db'}", "logger.experiment_name=time_to_auc",
           f"+trainer.callbacks=[{{_target_: benchmarks.time_to_auc.AUCTimeline, path: '{timeline}'}}]",
           *([f"scaling.embedding_lr={embedding_lr}"] if embedding_lr else []),
           *(["topology=1gpu"] if args.device == "cuda" else []), *args.extra]
    print(f"[{recipe}] {' '.join(cmd[3:])}", flush=True)
    from work_folder import child_env
    proc = subprocess.run(cmd, cwd=out, env=child_env(), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"[{recipe}] failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    done.touch()
    return json.loads(timeline.read_text())


def first_reaching(points: list[dict], target: float) -> dict | None:
    return next((p for p in points if p["val_auc"] >= target), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="+", default=["1024:none:all", "16384:cowclip:all", "16384:sqrt:all"],
                   help="batch:rule[:l2_scope[:epochs]], the first is the baseline")
    p.add_argument("--rows", type=int, default=2_400_000, help="synthetic rows generated (85 %% train)")
    p.add_argument("--epochs", type=int, default=3, help="epochs of a recipe that names none")
    p.add_argument("--val-per-epoch", type=int, default=4)
    p.add_argument("--target-delta", type=float, default=0.001, help="target = baseline's best val AUC − this")
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default=None, help="folder for the data and runs (default: a temporary one, removed at "
                                               "the end); run again with the same folder, recipes finished there are "
                                               "read instead of run")
    p.add_argument("--extra", nargs="*", default=[], help="more Hydra overrides for every run")
    args = p.parse_args()
    from work_folder import work_folder  # beside this file (the module is also imported as benchmarks.time_to_auc)
    with work_folder(args.out, "time-to-auc-") as out:
        report(args, out)


def report(args: argparse.Namespace, out: Path) -> None:
    timelines = {r: run_recipe(r, args, out) for r in args.recipes}
    baseline = args.recipes[0]
    target = max(q["val_auc"] for q in timelines[baseline]) - args.target_delta
    base_hit = first_reaching(timelines[baseline], target)
    print(f"\ntarget: validation AUC ≥ {target:.4f} (baseline {baseline}'s best − {args.target_delta}); "
          f"{args.rows:,} synthetic rows, {args.device}, training time only\n")
    print("| recipe | train s to target | speed-up vs baseline | epochs to target | best val AUC | train s total |")
    print("|---|---:|---:|---:|---:|---:|")
    for recipe, points in timelines.items():
        hit = first_reaching(points, target)
        best = max(q["val_auc"] for q in points)
        total = points[-1]["train_seconds"]
        if hit is None:
            print(f"| {recipe} | — | — | — | {best:.4f} | {total:.0f} |")
            continue
        speedup = base_hit["train_seconds"] / hit["train_seconds"] if hit["train_seconds"] else float("inf")
        print(f"| {recipe} | {hit['train_seconds']:.0f} | {speedup:.2f}× | {hit['epoch']:.2f} | {best:.4f} | "
              f"{total:.0f} |")
    (out / "timelines.json").write_text(json.dumps(timelines, indent=1))
    print(f"\ntimelines: {out / 'timelines.json'}")


if __name__ == "__main__":
    main()
