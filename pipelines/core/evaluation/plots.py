"""PNG plots of a run: each training stage's loss curves, the evaluation metrics per model, and the
merge stage's candidates (facts against retention).

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


def tradeoff(points: list[dict], path: Path, max_retention_loss: float | None = None) -> None:
    """The merge stage's choice as a picture: each point's validation strict match (y) against its
    retention loss on the validation prompts (x, nats/token; lower keeps more of the base), the
    candidates as numbered circles (their methods in the legend), the unmerged models as grey
    squares with their names, the chosen candidate ringed in red, `max_retention_loss` a dashed
    line. Points without a retention loss (no base model) are drawn as bars of their strict match.

    Each point: `label`, `kind` (`candidate` or `model`), `strict_match`, `retention_loss` (None
    without a base model), `chosen`; candidates numbered in the order given, from 1."""
    with_retention = all(p.get("retention_loss") is not None for p in points)
    plt, fig, (ax,) = _figure(1)
    fig.set_size_inches(10.5, 4.4)
    candidates = [p for p in points if p["kind"] == "candidate"]
    number = {id(p): i for i, p in enumerate(candidates, start=1)}
    if with_retention:
        for p in points:
            x, y = p["retention_loss"], p["strict_match"]
            if p["kind"] == "model":
                ax.scatter([x], [y], marker="s", s=40, color="0.55", zorder=3)
                ax.annotate(p["label"], (x, y), textcoords="offset points", xytext=(6, -10), fontsize=8, color="0.35")
            else:
                ax.scatter([x], [y], marker="o", s=50, zorder=4, label=f"#{number[id(p)]} {p['label']}")
                ax.annotate(f"#{number[id(p)]}", (x, y), textcoords="offset points", xytext=(6, 4), fontsize=8)
            if p.get("chosen"):
                ax.scatter([x], [y], marker="o", s=260, facecolors="none", edgecolors="red", linewidths=1.5, zorder=5, label="chosen")
        if max_retention_loss is not None:
            ax.axvline(max_retention_loss, color="red", linestyle="--", linewidth=0.8, label=f"max retention loss {max_retention_loss:g}")
        low, high = ax.get_ylim()
        ax.set_ylim(max(low, -0.02), min(high, 1.02))  # a share: no room below 0 or above 1
        ax.set_xlabel("retention loss on the validation prompts (nats/token; lower keeps more of the base)")
        ax.set_ylabel("validation strict match")
        ax.set_title("merge candidates: facts against retention (grey: the models merged)")
        ax.grid(alpha=0.3)
    else:
        names = [p["label"] if p["kind"] == "model" else f"#{number[id(p)]} {p['label']}" + (" (chosen)" if p.get("chosen") else "") for p in points]
        colors = ["red" if p.get("chosen") else ("0.55" if p["kind"] == "model" else "C0") for p in points]
        bars = ax.barh(range(len(points)), [p["strict_match"] for p in points], color=colors)
        ax.bar_label(bars, fmt="%.3f", fontsize=7)
        ax.set_yticks(range(len(points)), names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, 1.1)
        ax.set_xlabel("validation strict match")
        ax.set_title("merge candidates (red: chosen; grey: the models merged); no base model, so no retention measure")
        ax.grid(axis="x", alpha=0.3)
    if with_retention:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata=PNG_METADATA)
    plt.close(fig)
