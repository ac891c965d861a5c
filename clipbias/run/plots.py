"""Training curves: test accuracy and training loss per epoch, one line per algorithm.

``plot_curves({"dpsgd": [history_seed0, history_seed1], "dice": [...]}, "curves.png")`` draws the
mean over seeds with a +-1 std band (when there are several seeds). A history is the list of
per-epoch records that :func:`clipbias.run.train` returns (``results["history"]``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from ..errors import MissingDependencyError, require
from ..files import atomic_write


def _stack(histories: list[list[dict]], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    series = [[h[key] for h in hist if h.get(key) is not None] for hist in histories]
    series = [s for s in series if s]
    if not series:
        return None
    k = min(len(s) for s in series)  # runs of unequal length: the common prefix
    arr = np.asarray([s[:k] for s in series], dtype=float)
    return np.arange(1, k + 1), arr.mean(0), arr.std(0)


def plot_curves(runs: dict[str, list[list[dict]]], path: str | os.PathLike, title: str = "") -> Path:
    """Write a two-panel PNG (accuracy, loss vs. epoch) to ``path``; returns the path."""
    require("matplotlib", "drawing the training curves").use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, histories in runs.items():
        n_seeds = len(histories)
        name = label if n_seeds == 1 else f"{label} (mean of {n_seeds} seeds)"
        acc = _stack(histories, "test_accuracy")
        if acc is not None:
            x, m, s = acc
            (line,) = ax_acc.plot(x, m, marker="o", ms=3, label=f"{name}: test")
            if n_seeds > 1:
                ax_acc.fill_between(x, m - s, m + s, color=line.get_color(), alpha=0.2)
            val = _stack(histories, "val_accuracy")
            if val is not None:
                ax_acc.plot(val[0], val[1], ls="--", color=line.get_color(), label=f"{label}: val")
        loss = _stack(histories, "train_loss")
        if loss is not None:
            x, m, s = loss
            (line,) = ax_loss.plot(x, m, marker="o", ms=3, label=name)
            if n_seeds > 1:
                ax_loss.fill_between(x, m - s, m + s, color=line.get_color(), alpha=0.2)
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="test accuracy")
    ax_loss.set(xlabel="epoch", ylabel="mean training loss", title="training loss")
    for ax in (ax_acc, ax_loss):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    atomic_write(path, lambda fh: fig.savefig(fh, dpi=110, format="png"))
    plt.close(fig)
    return path


def plot_curves_or_notice(runs: dict[str, list[list[dict]]], path: str | os.PathLike, title: str = "") -> Path | None:
    """:func:`plot_curves`, or, without matplotlib, a one-line notice on stderr and ``None``: the run's
    results stand without the figure."""
    try:
        return plot_curves(runs, path, title)
    except MissingDependencyError as e:
        print(f"{Path(path).name} not written: {e}", file=sys.stderr)
        return None
