"""Figures of ``clipbias diagnose`` and ``clipbias toy`` (matplotlib, Agg backend, PNG).

Every figure has a title, labelled axes and a legend where there is more than one curve. Figures
of diagnostics carry a footnote saying they read raw per-example gradients (not DP).
(Training curves live in ``clipbias.run.plots``.)
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from ..errors import require
from ..files import atomic_write

require("matplotlib", "drawing the figures of clipbias diagnose and clipbias toy").use("Agg", force=False)
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

NOT_DP_NOTE = "diagnostic of raw per-example gradients - NOT differentially private"


def _save(fig, path: str | Path, note: str | None = None) -> str:
    if note:
        fig.text(0.995, 0.002, note, ha="right", va="bottom", fontsize=7, color="0.4")
    path = Path(path)
    try:  # through a temporary and a rename: a full disk or a kill never leaves a half-written figure
        atomic_write(path, lambda fh: fig.savefig(fh, dpi=110, bbox_inches="tight",
                                                  format=path.suffix.lstrip(".") or "png"))
    finally:
        plt.close(fig)
    return str(path)


def _steps(records: Sequence[dict]) -> list[int]:
    return [r["step"] for r in records]


def _marker(records: Sequence[dict]) -> str:
    return "o-" if len(records) < 30 else "-"


# ----------------------------------------------------------------------------- diagnostics

def norms(records: Sequence[dict], path: str | Path, title: str = "") -> str:
    """Xiao et al. Fig. 1a-c: per-example norm quantiles, mean-gradient norm, fraction clipped."""
    s, m = _steps(records), _marker(records)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, lab in (("q25", "25% quantile of ||g_i||"), ("q50", "median ||g_i||"),
                     ("q75", "75% quantile of ||g_i||"), ("mean_grad_norm", "||mean g_i||")):
        ax.plot(s, [r["norms"][key] for r in records], m, label=lab)
    clip = records[0].get("clip") if records else None
    if clip:
        ax.axhline(clip, color="k", ls="--", lw=1, label=f"clip C = {clip:g}")
    ax.set_xlabel("training step")
    ax.set_ylabel("L2 norm")
    ax.set_yscale("log")
    ax.set_title("per-example gradient norms")
    ax.legend(fontsize=8)
    ax2.plot(s, [r["norms"]["fraction_clipped"] for r in records], m, color="C3")
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_xlabel("training step")
    ax2.set_ylabel("fraction with ||g_i|| > C")
    ax2.set_title("fraction of examples clipped")
    fig.suptitle(title or "Gradient norms (cf. Xiao et al. Fig. 1)")
    fig.tight_layout()
    return _save(fig, path, NOT_DP_NOTE)


def sampling_noise(records: Sequence[dict], path: str | Path, title: str = "") -> str:
    """Xiao et al. Definition 2.5 before/after clipping."""
    s, m = _steps(records), _marker(records)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(s, [r["sampling_noise"]["before"] for r in records], m, label="raw g_i")
    ax.plot(s, [r["sampling_noise"]["after"] for r in records], m, label="clipped clip(g_i, C)")
    ax.set_xlabel("training step")
    ax.set_ylabel("E_i ||g_i - mean g||^2")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(title or "Sampling noise (Xiao et al. Def. 2.5)", fontsize=10)
    return _save(fig, path, NOT_DP_NOTE)


def clipping_bias(records: Sequence[dict], path: str | Path, title: str = "") -> str:
    s, m = _steps(records), _marker(records)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax.plot(s, [r["clipping_bias"]["norm"] for r in records], m, label="||b||")
    ax.plot(s, [r["norms"]["mean_grad_norm"] for r in records], m, label="||mean g_i||")
    ax.plot(s, [r["sampling_noise"]["tau_before"] for r in records], m,
            label="tau = sqrt(sampling noise)")
    ax.set_yscale("log")
    ax.set_xlabel("training step")
    ax.set_ylabel("L2 norm")
    ax.set_title("bias b = mean clip(g_i) - mean g_i")
    ax.legend(fontsize=8)
    ax2.plot(s, [r["clipping_bias"]["cos_true"] for r in records], m, label="cos(b, true gradient)")
    ax2.plot(s, [r["clipping_bias"]["cos_clipped_true"] for r in records], m,
             label="cos(mean clip(g_i), true gradient)")
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set_ylim(-1.05, 1.05)
    ax2.set_xlabel("training step")
    ax2.set_ylabel("cosine")
    ax2.set_title("direction of the bias")
    ax2.legend(fontsize=8)
    fig.suptitle(title or "Clipping bias")
    fig.tight_layout()
    return _save(fig, path, NOT_DP_NOTE)


def _grid(k: int, max_cols: int = 4) -> tuple[int, int]:
    cols = max(1, min(k, max_cols))
    return max(1, math.ceil(k / cols)), cols


def cosine_histograms(records: Sequence[dict], path: str | Path, title: str = "") -> str:
    """Chen et al. Fig. 3: histograms of cos(g_i, full-batch gradient), one panel per recorded step."""
    rows, cols = _grid(len(records))
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 3.0 * rows), squeeze=False)
    for ax, r in zip(axes.flat, records):
        h = r["cosine_histogram"]
        e = h["edges"]
        ax.bar(e[:-1], h["counts"], width=e[1] - e[0], align="edge", color="C0", edgecolor="white", lw=0.3)
        ax.axvline(0, color="k", lw=0.8)
        ax.set_xlim(-1, 1)
        ax.set_title(f"step {r['step']}: mean {h['mean']:.2f}, skew {h['skewness']:.2f}", fontsize=9)
        ax.set_xlabel("cos(g_i, full gradient)")
        ax.set_ylabel("examples")
    for ax in list(axes.flat)[len(records):]:
        ax.axis("off")
    fig.suptitle(title or "Cosine of per-example gradients with the full gradient (cf. Chen et al. Fig. 3)")
    fig.tight_layout()
    return _save(fig, path, NOT_DP_NOTE)


def projections(records: Sequence[dict], path: str | Path, title: str = "", max_rows: int = 6) -> str:
    """Chen et al. Figs. 1-2: rows = recorded steps, columns = the random 2-D projections."""
    recs = [r for r in records if "_arrays" in r]
    if len(recs) > max_rows:  # keep the first and last, evenly spaced in between
        pick = sorted({round(i * (len(recs) - 1) / (max_rows - 1)) for i in range(max_rows)})
        recs = [recs[i] for i in pick]
    k = recs[0]["_arrays"]["projections"].shape[0] if recs else 1
    fig, axes = plt.subplots(max(1, len(recs)), k, figsize=(2.2 * k, 2.3 * max(1, len(recs))), squeeze=False)
    for i, r in enumerate(recs):
        p = r["_arrays"]["projections"]
        scores = r["symmetry"]["scores"]
        for j in range(k):
            ax = axes[i, j]
            pts = p[j]
            ax.scatter(pts[:, 0], pts[:, 1], s=3, alpha=0.5, color="C0", lw=0)
            c = pts.mean(0)
            ax.plot([float(c[0])], [float(c[1])], "r+", ms=9, mew=1.5)
            ax.set_title(f"P{j + 1}: sym {scores[j]:.2f}", fontsize=8)
            ax.tick_params(labelsize=6)
            ax.xaxis.set_major_locator(MaxNLocator(3))
            ax.yaxis.set_major_locator(MaxNLocator(4))
            if j == 0:
                ax.set_ylabel(f"step {r['step']}\nprojection dim 2", fontsize=8)
            if i == len(recs) - 1:
                ax.set_xlabel("projection dim 1", fontsize=8)
    fig.suptitle(title or "Random 2-D Gaussian projections of per-example gradients (cf. Chen et al. "
                 "Figs. 1-2); red +: mean; sym: symmetry score (1 = centrally symmetric)", fontsize=10)
    fig.tight_layout()
    return _save(fig, path, NOT_DP_NOTE)


def symmetry(records: Sequence[dict], path: str | Path, title: str = "") -> str:
    s, m = _steps(records), _marker(records)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(s, [r["symmetry"]["mean_score"] for r in records], m, label="mean over 2-D projections")
    ax.plot(s, [r["symmetry"]["min_score"] for r in records], m, label="least symmetric projection")
    ax.plot(s, [r["symmetry"]["null"] for r in records], "k--", label="symmetric reference (sign-flipped)")
    if records and "full_dim_score" in records[0]["symmetry"]:
        ax.plot(s, [r["symmetry"]["full_dim_score"] for r in records], m, label="full dimension")
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("training step")
    ax.set_ylabel("symmetry score (1 = symmetric)")
    ax.legend(fontsize=8)
    ax.set_title(title or "Central symmetry of the gradient distribution", fontsize=10)
    return _save(fig, path, NOT_DP_NOTE)


def noise_correlation(result: dict, path: str | Path, title: str = "") -> str:
    """Xiao et al. Fig. 5a: mean norm of the K0-window average of per-example sampling noise."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    w = result["windows"]
    ax.plot(w, result["ratio_to_k1"], "o-", label="measured")
    ax.plot(w, result["independent_ratio"], "k--", label="independent noise: 1/sqrt(K0)")
    ax.plot(w, [1.0] * len(w), "k:", label="identical noise: 1")
    ax.set_xscale("log", base=2)
    ax.set_xticks(w)
    ax.set_xticklabels([str(v) for v in w])
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("window length K0 (iterations)")
    ax.set_ylabel("mean ||window avg of xi_l^(i)||, / value at K0 = 1")
    ax.legend(fontsize=8)
    rho = result.get("lag1_correlation")
    ax.set_title(title or f"Sampling-noise correlation across iterations (cf. Xiao et al. Fig. 5a)\n"
                          f"{result['iterations']} iterations, lag-1 correlation {rho:.2f}", fontsize=10)
    return _save(fig, path, NOT_DP_NOTE)


def p_averaging(records: Sequence[dict], path: str | Path, title: str = "") -> str:
    """Xiao et al. Fig. 7: cos(full gradient, p-averaged clipped gradient) vs p."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    lo = 0.0
    for i, r in enumerate(records):
        ps = [int(p) for p in r["p_averaging"]]
        vals = list(r["p_averaging"].values())
        lo = min(lo, *vals)
        ax.plot(ps, vals, "o-", color=f"C{i % 10}", label=f"step {r['step']}")
        if r.get("p_averaging_ceiling") is not None:
            ax.axhline(r["p_averaging_ceiling"], color=f"C{i % 10}", ls=":", lw=1)
    ax.set_xscale("log")
    if records:
        ps = [int(p) for p in records[0]["p_averaging"]]
        ax.set_xticks(ps)
        ax.set_xticklabels([str(p) for p in ps])
    ax.set_ylim(lo - 0.02, 1.02)
    ax.set_xlabel("group size p (p = 1: per-example clipping)")
    ax.set_ylabel("cos(full gradient, p-averaged clipped)")
    ax.legend(fontsize=8)
    ax.set_title((title or "p-averaged clipping (cf. Xiao et al. Fig. 7)") +
                 "\ndotted: same cosine without clipping (sampling-only ceiling)", fontsize=10)
    return _save(fig, path, NOT_DP_NOTE)


# ----------------------------------------------------------------------------- toy problems

def toy_distances(curves: dict[str, Sequence[float]], path: str | Path, title: str,
                  predicted: dict[str, float] | None = None, private: Sequence[str] = (),
                  smoothed: dict[str, Sequence[float]] | None = None, window: int | None = None) -> str:
    """Distance to the optimum vs iteration, one curve per algorithm (log scale).

    Non-private algorithms (no noise, deterministic) go in the left panel; the ``private`` ones
    (with DP noise) in the right panel, as thin raw curves plus, from ``smoothed``, the distance of
    the running mean of the last ``window`` iterates. Dotted lines mark the distances of the biased
    fixed points the papers predict.
    """
    floor = 1e-8
    groups = [("without noise (non-private algorithms)", [n for n in curves if n not in private]),
              (f"with DP noise (private algorithms); bold: running mean of the last {window} iterates"
               if smoothed else "with DP noise (private algorithms)", [n for n in curves if n in private])]
    groups = [g for g in groups if g[1]]
    fig, axes = plt.subplots(1, len(groups), figsize=(7.5 * len(groups), 4.8), squeeze=False)
    colors = {n: f"C{i % 10}" for i, n in enumerate(curves)}
    styles = {n: ["-", "--", "-."][(i // 10) % 3] for i, n in enumerate(curves)}
    steps = len(next(iter(curves.values()), [0]))
    for ax, (sub, names) in zip(axes[0], groups):
        lowest = min((max(v, floor) for n in names for v in curves[n]), default=floor)
        for n in names:
            d = [max(v, floor) for v in curves[n]]
            if smoothed and n in smoothed and n in private:
                ax.plot(range(len(d)), d, styles[n], color=colors[n], lw=0.5, alpha=0.3)
                ax.plot(range(len(smoothed[n])), [max(v, floor) for v in smoothed[n]], styles[n],
                        color=colors[n], lw=1.8, label=n)
            else:
                ax.plot(range(len(d)), d, styles[n], color=colors[n], lw=1.5, label=n)
        for label, v in (predicted or {}).items():
            if v > floor:
                ax.axhline(v, color="0.4", ls=":", lw=1)
                ax.text(steps * 0.5, v, f"predicted fixed point ({label}): {v:.3g}", fontsize=7,
                        color="0.25", va="bottom", ha="center")
        ax.set_yscale("log")
        ax.set_ylim(bottom=lowest * 0.5)
        ax.set_xlabel("iteration t")
        ax.set_ylabel("||x_t - x*||  (log scale)")
        ax.set_title(sub, fontsize=9)
        ax.legend(fontsize=8, ncol=2, loc="lower left")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, path)
