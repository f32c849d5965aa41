"""Batch-scaling report from MLflow: ``ctr report experiment_name=batch_scaling`` (``parent=<run id>``: a sweep's).

Reads the finished training runs of an experiment (latest run per batch size × scaling rule × L2 scope
× seed; a cell with several seeds gives their mean, the number of seeds and their spread),
writes ``<out>/report.md`` (test AUC per batch size and rule, difference to the 1K baseline,
epochs, throughput) and ``<out>/auc_vs_batch.png`` (one line per rule), and logs both to MLflow
as a run named ``report`` in the same experiment.

At the base batch size (scale s = 1) the rules ``none``, ``sqrt`` and ``linear`` set identical
hyperparameters, so one unclipped run there stands for all three; such filled-in cells are marked †.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import hydra
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from pipeline.commands.overrides import check_overrides
from pipeline.runtime.config_source import config_path  # noqa: E402

RULE_ORDER = ("none", "sqrt", "linear", "cowclip", "auto")
SAME_AT_SCALE_1 = ("none", "sqrt", "linear")  # identical hyperparameters at the base batch size


@dataclass(frozen=True)
class RunSummary:
    run_id: str
    batch_size: int
    rule: str
    clip: bool
    test_auc: float
    test_logloss: float
    epochs: float | None
    best_epoch: float | None
    samples_per_s: float | None
    start_time: int
    scale: float = 0.0
    shared: bool = False  # filled in from the equivalent s = 1 run of another rule
    l2_scope: str = "batch"
    seed: str = ""
    seeds: int = 1        # runs averaged into this summary
    spread: float = 0.0   # their max − min test AUC

    @property
    def label(self) -> str:
        base = self.rule if self.clip == (self.rule == "cowclip") else f"{self.rule}{'+clip' if self.clip else '-clip'}"
        return base + ("·all" if self.l2_scope == "all" else "")


def _mean(runs: list[RunSummary]) -> RunSummary:
    """One summary of the seeds of a cell: mean AUC / logloss / epochs, their number and AUC spread."""
    if len(runs) == 1:
        return runs[0]
    aucs = [r.test_auc for r in runs]
    epochs = [r.epochs for r in runs if r.epochs is not None]
    return replace(runs[0], test_auc=sum(aucs) / len(aucs), test_logloss=sum(r.test_logloss for r in runs) / len(runs),
                   epochs=sum(epochs) / len(epochs) if epochs else None, best_epoch=None, seeds=len(runs),
                   spread=max(aucs) - min(aucs), seed="")


def collect_runs(client: MlflowClient, experiment: str, parent: str | None = None) -> list[RunSummary]:
    """The latest finished run per (batch size, rule) of an experiment — or of a sweep's parent run."""
    if parent is not None:
        exp_id, only = client.get_run(parent).info.experiment_id, f" and tags.`mlflow.parentRunId` = '{parent}'"
    else:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise SystemExit(f"MLflow experiment {experiment!r} not found at {client.tracking_uri}")
        exp_id, only = exp.experiment_id, ""
    latest: dict[tuple[int, str, str], RunSummary] = {}
    for run in client.search_runs([exp_id], filter_string="attributes.status = 'FINISHED'" + only,
                                  max_results=5000):
        p, m = run.data.params, run.data.metrics
        if "test/auc" not in m or "scaling/rule" not in p:
            continue
        s = RunSummary(run.info.run_id, int(p["trainer/batch_size"]), p["scaling/rule"],
                       p.get("scaling/cowclip/enabled", "False") == "True", m["test/auc"], m["test/logloss"],
                       m.get("train/epochs"), m.get("val/best_epoch"), m.get("train/samples_per_s_run"),
                       run.info.start_time, float(p.get("scaled/scale", "nan")),
                       l2_scope=p.get("optim/embedding_l2_scope", "batch"), seed=p.get("seed", ""))
        key = (s.batch_size, s.label, s.seed)
        if key not in latest or latest[key].start_time < s.start_time:
            latest[key] = s
    for r in list(latest.values()):
        if r.scale == 1.0 and not r.clip and not r.shared:
            for rule in SAME_AT_SCALE_1:
                same = replace(r, rule=rule, shared=rule != r.rule)
                latest.setdefault((r.batch_size, same.label, r.seed), same)
    cells: dict[tuple[int, str], list[RunSummary]] = {}
    for (batch, label, _), r in latest.items():
        cells.setdefault((batch, label), []).append(r)
    return sorted((_mean(rs) for rs in cells.values()), key=lambda r: (r.batch_size, r.label))


def _labels(runs: list[RunSummary]) -> list[str]:
    """Rule labels in RULE_ORDER (each with its L2-scope variants), then any others."""
    def key(label: str) -> tuple[int, str]:
        base = label.split("·")[0]
        return (RULE_ORDER.index(base) if base in RULE_ORDER else len(RULE_ORDER), label)

    return sorted({r.label for r in runs}, key=key)


def _grid(runs: list[RunSummary], labels: list[str], cell: Callable[[RunSummary], str]) -> list[str]:
    """A markdown table: one row per batch size, one column per rule label, ``cell(run)`` in each."""
    by = {(r.batch_size, r.label): r for r in runs}
    lines = ["| batch | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for b in sorted({r.batch_size for r in runs}):
        cells = [cell(by[b, lab]) if (b, lab) in by else "–" for lab in labels]
        lines.append(f"| {b:,} | " + " | ".join(cells) + " |")
    return lines


def markdown_table(runs: list[RunSummary], baseline_rule: str = "none") -> str:
    labels = _labels(runs)
    batches = sorted({r.batch_size for r in runs})
    base = next((r for r in runs if r.batch_size == batches[0] and r.label == baseline_rule), None) if batches else None
    if base is None and batches:  # the L2-scope variant of the baseline rule
        base = next((r for r in runs if r.batch_size == batches[0] and r.label.split("·")[0] == baseline_rule), None)

    def auc(r: RunSummary) -> str:
        delta = f" ({r.test_auc - base.test_auc:+.4f})" if base else ""
        seeds = f" [mean of {r.seeds} seeds, spread {r.spread:.4f}]" if r.seeds > 1 else ""
        return f"{r.test_auc:.4f}{delta}{' †' if r.shared else ''}{seeds}"

    def epochs(r: RunSummary) -> str:
        ep = "?" if r.epochs is None else f"{r.epochs:.0f}"
        best = "" if r.best_epoch is None else f" ({r.best_epoch + 1:.0f})"
        sps = "" if r.samples_per_s is None else f", {r.samples_per_s:,.0f}/s"
        return f"{ep}{best}{sps}"

    lines = [f"Test AUC (Δ vs the {batches[0] if batches else '?'} `{base.label if base else baseline_rule}` run"
             f"{f' = {base.test_auc:.4f}' if base else ''}); epochs trained (best epoch); samples/s. `·all`: "
             f"L2 on every embedding row (optim.embedding_l2_scope=all).", ""]
    lines += _grid(runs, labels, auc)
    if any(r.shared for r in runs):
        lines += ["", "† the same run as the unclipped rule trained at s = 1 (identical hyperparameters)."]
    lines += [""] + _grid(runs, labels, epochs)
    return "\n".join(lines) + "\n"


def plot(runs: list[RunSummary], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for lab in _labels(runs):
        pts = sorted((r.batch_size, r.test_auc) for r in runs if r.label == lab)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=lab)
    base = [r for r in runs if r.label.split("·")[0] == "none"]
    if base:
        b0 = min(base, key=lambda r: r.batch_size)
        ax.axhspan(b0.test_auc - 0.002, b0.test_auc + 0.002, color="grey", alpha=0.15,
                   label=f"{b0.batch_size:,} baseline ± 0.002")
    ax.set_xscale("log", base=2)
    ticks = sorted({r.batch_size for r in runs})
    ax.set_xticks(ticks, [f"{b // 1024}K" if b % 1024 == 0 else str(b) for b in ticks])
    ax.minorticks_off()
    ax.set_xlabel("global batch size")
    ax.set_ylabel("test AUC")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@dataclass
class ReportArgs:
    """``conf/report.yaml``."""

    experiment_name: str = "batch_scaling"
    tracking_uri: str = "sqlite:///mlflow.db"
    parent: Optional[str] = None
    out: Optional[str] = None
    log_to_mlflow: bool = True


@hydra.main(version_base="1.3", config_path=config_path(), config_name="report")
def main(cfg: DictConfig) -> None:
    from pipeline.commands.args import command_args

    args = command_args(cfg, ReportArgs)
    client = MlflowClient(tracking_uri=args.tracking_uri)
    runs = collect_runs(client, args.experiment_name, args.parent)
    if not runs:
        raise SystemExit(f"no finished training runs in {f'sweep {args.parent}' if args.parent else args.experiment_name!r}")
    out = Path(args.out or f"reports/{args.parent or args.experiment_name}")
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(runs)
    (out / "report.md").write_text(table)
    plot(runs, out / "auc_vs_batch.png", f"{args.experiment_name}: test AUC vs batch size")
    print(table)
    if args.log_to_mlflow:
        if args.parent is not None:  # onto the sweep's own parent run
            target = args.parent
        else:
            exp = client.get_experiment_by_name(args.experiment_name)
            target = client.create_run(exp.experiment_id, run_name="report", tags={"report": "true"}).info.run_id
        for name in ("report.md", "auc_vs_batch.png"):
            client.log_artifact(target, str(out / name), artifact_path="report" if args.parent else None)
        if args.parent is None:
            client.set_terminated(target)
        print(f"report logged to MLflow run {target}; files in {out}")


def cli() -> None:
    """``ctr report`` / ``python -m pipeline.commands.report``."""
    check_overrides(config_path(), "report")
    main()


if __name__ == "__main__":
    cli()
