"""PNG plots of a run: each training stage's loss curves, and the evaluation metrics per model.

    plots.loss_curves({"pretrain": Path("data/models/pretrain"), ...}, Path("loss_curves.png"))
    plots.metric_bars(results, ["exact_match", "rougeL"], Path("metrics.png"))

Headless (matplotlib's Agg backend) and without timestamps in the files, so the same inputs give
the same bytes. The curves come from the `training_log.csv`/`eval_log.csv` every training stage
writes next to its model (`training.write_history`).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

from pipelines.core.training.loop import EVAL_LOG, TRAINING_LOG

PNG_METADATA = {"Software": None}  # no version stamp: reproducible bytes


def _read(path: Path, column: str) -> tuple[list[int], list[float]]:
    if not path.exists():
        return [], []
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    return [int(r["step"]) for r in rows], [float(r[column]) for r in rows]


def _figure(panels: int):
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    cols = min(2, panels)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
    return plt, fig, [ax for row in axes for ax in row]


def loss_curves(model_dirs: dict[str, Path], path: Path) -> None:
    """One panel per model with training and validation loss against the step (models without
    logs, e.g. a directory from elsewhere, get an empty panel saying so)."""
    plt, fig, axes = _figure(len(model_dirs))
    for ax, (name, model_dir) in zip(axes, model_dirs.items(), strict=False):
        steps, train = _read(model_dir / TRAINING_LOG, "train_loss")
        val_steps, val = _read(model_dir / EVAL_LOG, "val_loss")
        if steps:
            ax.plot(steps, train, label="train/loss", linewidth=1)
        if val_steps:
            ax.plot(val_steps, val, "o-", label="val/loss", markersize=3)
        if not (steps or val_steps):
            ax.text(0.5, 0.5, "no training log", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        if steps or val_steps:
            ax.legend()
    for ax in axes[len(model_dirs) :]:
        ax.set_visible(False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata=PNG_METADATA)
    plt.close(fig)


def metric_bars(results: dict[str, dict], metrics: list[str], path: Path) -> None:
    """Grouped bars: one group per metric (all in [0, 1]), one bar per model, values on top."""
    plt, fig, (ax,) = _figure(1)
    names = list(results)
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs = [m + (i - (len(names) - 1) / 2) * width for m in range(len(metrics))]
        values = [results[name].get(metric, 0.0) or 0.0 for metric in metrics]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(metrics)), metrics)
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("held-out score")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata=PNG_METADATA)
    plt.close(fig)
