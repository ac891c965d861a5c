"""Issue-4 benchmark: each bias-reduction method against its baseline on Fashion-MNIST.

Every pair compares a method with its baseline on the same model, at the same privacy (epsilon,
delta = 1e-5, PLD unless the method is accounted otherwise), the same number of epochs and the same
tuning budget: the learning rate of *each* arm is chosen from the same grid (``--lrs``) by accuracy
on a validation split carved out of the training data (``--validation``, never used for training,
never the test set); the chosen rate is then run with every seed (``--seeds``) and the test accuracy
reported as mean ± std. Method settings are fixed at the documented defaults (flags below), so
both arms get exactly ``len(--lrs)`` tuning runs.

Pairs (``--pairs``):

=================  ==========================================  ==========================================
pair               baseline                                    method
=================  ==========================================  ==========================================
perturb            dpsgd                                       perturb (k = --perturb-k)
self-aug           dpsgd                                       self-aug (K = --augmentations)
p-avg              dpsgd                                       p-avg (p = --p; noise 2p x DPSGD's)
inner-outer        dpsgd + SGD momentum 1 - gamma1              inner-outer (K0, gamma0, gamma1)
dpgd-momentum      dpsgd, full batch (q = 1)                    dpgd-momentum (full batch; use --subset)
batch-clip         dpsgd on the GroupNorm model                BatchNorm variant + 100 public features
resnet20-enhanced  dpsgd on resnet20-gn                        dpsgd on resnet20-enhanced
gru-norm           dpsgd on gru                                dpsgd on gru-norm
dice-self-aug      dice (C2 = C/B)                             dice-self-aug
dice-perturb       dice (C2 = C/B)                             dice-perturb
dice-enhanced      dice on resnet20-gn                         dice on resnet20-enhanced
=================  ==========================================  ==========================================

For every run the *sampling noise of the clipped quantity* (Xiao et al. Def. 2.5,
``tau^2 = mean ||r_i - mean r||^2`` over the rows the method clips) is measured at the end of each
epoch on a fixed probe of ``--probe-size`` validation examples, next to the sampling noise of the
plain per-example gradients at the same model. These diagnostics read raw gradients: they use
held-out validation examples only, never the private training set.

Public data for batch-clip: ``--public-size`` images of the Fashion-MNIST *test* split (labels never
read); they are removed from the test split for every pair, so all pairs are scored on the same
10000 - 100 test images.

Smoke run (minutes on 2 CPU cores)::

    python benchmarks/methods_fmnist.py --epochs 1 --seeds 0 --subset 2000 --validation 1000 \\
        --lrs 1.0 --probe-size 64 --out /tmp/methods-smoke

Full run: see docs/methods.md ("Benchmark"). Finished runs are cached under ``OUT/methods_runs/``;
re-running the same command skips them. Writes ``OUT/methods_<pair>.json`` per pair,
``OUT/methods_summary.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from clipbias.config import AlgoConfig
from clipbias.data.catalog import load_dataset
from clipbias.engine.core import DPEngine
from clipbias.grads.rows import FuncGradients
from clipbias.algorithms import (PerExampleMomentum, batchclip_predict, batchnorm_variant,
                                 noise_ratio_vs_dpsgd, public_split)
from clipbias.analysis.diagnostics import clipped_quantity
from clipbias.analysis.diagnostics import sampling_noise_report as sampling_noise
from clipbias.models import build_model
from clipbias.step import StepContext


@dataclasses.dataclass(frozen=True)
class Arm:
    """One side of a pair: algorithm, model, settings."""

    label: str
    algo: str
    model: str
    extra: tuple = ()               # sorted (key, value) pairs of AlgoConfig.extra
    momentum: float = 0.0
    full_batch: bool = False
    batchnorm: bool = False          # BatchNorm variant of the model (batch-clip)
    ef_ratio: float | None = None    # DiceSGD: C2 = ef_ratio * C / B


def pairs(a: argparse.Namespace) -> dict[str, tuple[Arm, Arm]]:
    m = a.model
    dice = dict(ef_ratio=a.ef_ratio)
    return {
        "perturb": (Arm("dpsgd", "dpsgd", m), Arm("perturb", "perturb", m, (("k", a.perturb_k),))),
        "self-aug": (Arm("dpsgd", "dpsgd", m),
                     Arm("self-aug", "self-aug", m, (("K", a.augmentations), ("flip", True), ("pad", 2)))),
        "p-avg": (Arm("dpsgd", "dpsgd", m), Arm("p-avg", "p-avg", m, (("p", a.p),))),
        "inner-outer": (Arm("dpsgd+outer momentum", "dpsgd", m, momentum=1 - a.gamma1),
                        Arm("inner-outer", "inner-outer", m,
                            (("K0", a.k0), ("gamma0", a.gamma0), ("gamma1", a.gamma1)))),
        "dpgd-momentum": (Arm("dp-gd (q=1)", "dpsgd", m, full_batch=True),
                          Arm("dpgd-momentum", "dpgd-momentum", m, (("gamma_m", a.gamma_m),), full_batch=True)),
        "batch-clip": (Arm("dpsgd", "dpsgd", m),
                       Arm(f"batch-clip ({m} -> BN)", "batch-clip", m, (("p", a.p),), batchnorm=True)),
        "resnet20-enhanced": (Arm("resnet20-gn", "dpsgd", "resnet20-gn"),
                              Arm("resnet20-enhanced", "dpsgd", "resnet20-enhanced")),
        "gru-norm": (Arm("gru", "dpsgd", "gru"), Arm("gru-norm", "dpsgd", "gru-norm")),
        "dice-self-aug": (Arm("dice", "dice", m, **dice),
                          Arm("dice-self-aug", "dice-self-aug", m, (("K", a.augmentations),), **dice)),
        "dice-perturb": (Arm("dice", "dice", m, **dice),
                         Arm("dice-perturb", "dice-perturb", m, (("k", a.perturb_k),), **dice)),
        "dice-enhanced": (Arm("dice resnet20-gn", "dice", "resnet20-gn", **dice),
                          Arm("dice resnet20-enhanced", "dice", "resnet20-enhanced", **dice)),
    }


PAIR_NAMES = ("perturb", "self-aug", "p-avg", "inner-outer", "dpgd-momentum", "batch-clip",
              "resnet20-enhanced", "gru-norm", "dice-self-aug", "dice-perturb", "dice-enhanced")


# ---------------------------------------------------------------- one run
@torch.no_grad()
def accuracy(model, x, y, arm: Arm, public, a) -> float:
    if len(y) == 0:
        return math.nan
    if arm.batchnorm:
        pred = batchclip_predict(model, x, public, a.p, draws=10, seed=0, chunk=a.eval_batch)
    else:
        was = model.training
        model.eval()
        pred = torch.cat([model(x[s:s + a.eval_batch]).argmax(1) for s in range(0, len(x), a.eval_batch)])
        model.train(was)
    return float((pred.cpu() == y.cpu()).double().mean())


def run(arm: Arm, lr: float, seed: int, data: dict, a: argparse.Namespace) -> dict:
    """Train one arm with one learning rate and seed; return accuracies, privacy, sampling noise."""
    x, y, xv, yv, xt, yt, public = (data[k] for k in ("x", "y", "xv", "yv", "xt", "yt", "public"))
    n = len(y)
    torch.manual_seed(seed)
    model = build_model(arm.model, tuple(x.shape[1:]), 10).to(a.device)
    if arm.batchnorm:
        model = batchnorm_variant(model)
    extra = dict(arm.extra)
    if arm.algo == "batch-clip":
        extra["public"] = public
    batch = float(n) if arm.full_batch else a.batch_size
    ef_clip = arm.ef_ratio * a.clip / batch if arm.ef_ratio is not None else None
    cfg = AlgoConfig(lr=lr, clip=a.clip, ef_clip=ef_clip, momentum=arm.momentum, extra=extra)
    epochs = a.full_batch_steps if arm.full_batch else a.epochs
    t0 = time.perf_counter()
    eng = DPEngine(model, arm.algo, n=n, batch_size=batch, epochs=epochs, epsilon=a.epsilon, delta=a.delta,
                   accountant=a.accountant, dice_accounting=a.dice_accounting, config=cfg,
                   max_physical_batch=a.max_physical_batch,
                   noise_seed=seed)  # reproducible: a benchmark releases numbers, not models
    calib_s = time.perf_counter() - t0
    xp, yp = xv[:a.probe_size], yv[:a.probe_size]
    plain = None if arm.batchnorm else FuncGradients(model)  # BatchNorm: no per-example gradient exists
    shadow = PerExampleMomentum(len(yp), extra["gamma_m"]) if arm.algo == "dpgd-momentum" else None

    def probe() -> dict:
        if shadow is not None:  # Alg. 1's momentum for the probe examples, tracked alongside
            rows = shadow.buf if shadow.buf is not None else plain(xp, yp)[0]
        else:
            rows = clipped_quantity(eng, xp, yp)
        out = {"clipped_quantity": sampling_noise(rows, a.clip)}
        if plain is not None:
            g = torch.cat([plain(xp[s:s + a.max_physical_batch], yp[s:s + a.max_physical_batch])[0]
                           for s in range(0, len(yp), a.max_physical_batch)])
            out["per_example_gradient"] = sampling_noise(g, a.clip)
        return out

    history = []
    t_train = time.perf_counter()
    for epoch in range(epochs if not arm.full_batch else 1):
        steps = eng.total_steps if arm.full_batch else len(eng.sampler)
        for _ in range(steps):
            if eng.steps_taken >= eng.total_steps:
                break
            if shadow is not None:
                gp = plain(xp, yp)[0]
                shadow(gp, StepContext(torch.arange(len(yp)), eng.steps_taken))
                shadow.commit()
            idx = eng.sampler.sample()
            eng.step(x[idx], y[idx], idx)
            if arm.full_batch and (eng.steps_taken % max(1, eng.total_steps // a.probes_full_batch) == 0):
                history.append({"step": eng.steps_taken, "val_accuracy": accuracy(model, xv, yv, arm, public, a),
                                **probe()})
        if not arm.full_batch and ((epoch + 1) % a.probe_every == 0 or epoch + 1 == epochs):
            history.append({"epoch": epoch + 1, "step": eng.steps_taken,
                            "val_accuracy": accuracy(model, xv, yv, arm, public, a), **probe()})
    train_s = time.perf_counter() - t_train
    rep = eng.privacy()
    return {
        "arm": arm.label, "algo": arm.algo, "model": arm.model, "lr": lr, "seed": seed, "extra": dict(arm.extra),
        "momentum": arm.momentum, "batch_size": batch, "N": n, "steps": eng.steps_taken,
        "noise_multiplier": eng.noise_multiplier, "update_noise_std": eng.pipeline.noise.std,
        "epsilon": rep.epsilon, "delta": rep.delta, "accountant": rep.accountant, "basis": rep.basis,
        "certified": rep.certified,
        "val_accuracy": accuracy(model, xv, yv, arm, public, a),
        "test_accuracy": accuracy(model, xt, yt, arm, public, a),
        "train_s": train_s, "calibration_s": calib_s, "history": history,
        "p_avg_noise_ratio_vs_dpsgd": noise_ratio_vs_dpsgd(a.p, batch) if arm.algo == "p-avg" else None,
    }


# ---------------------------------------------------------------- driver
def cached(path: Path, key: dict, fn):
    name = hashlib.sha1(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    f = path / f"{name}.json"
    if f.exists():
        return json.loads(f.read_text())
    res = {**fn(), "key": key}
    path.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(res, indent=1, default=str))
    return res


def arm_result(arm: Arm, data: dict, a, out: Path) -> dict:
    base_key = {"arm": dataclasses.asdict(arm), "eps": a.epsilon, "delta": a.delta, "epochs": a.epochs,
                "fbs": a.full_batch_steps, "B": a.batch_size, "clip": a.clip, "subset": a.subset,
                "val": a.validation, "split": a.split_seed, "acc": a.accountant, "dice": a.dice_accounting,
                "probe": a.probe_size, "pub": a.public_size}
    runs = out / "methods_runs"

    def one(lr, seed):
        if not a.quiet:
            print(f"  {arm.label}: lr={lr:g} seed={seed}", file=sys.stderr, flush=True)
        return cached(runs, {**base_key, "lr": lr, "seed": seed}, lambda: run(arm, lr, seed, data, a))

    tuning = [one(lr, a.tune_seed) for lr in a.lrs]
    best = max(tuning, key=lambda r: (r["val_accuracy"], -r["lr"]))
    finals = [best if s == a.tune_seed else one(best["lr"], s) for s in a.seeds]
    accs = [r["test_accuracy"] for r in finals]

    def noise_summary(kind: str) -> dict:
        vals = [h[kind] for r in finals for h in r["history"] if kind in h]
        keys = ("tau2", "relative", "frac_clipped", "mean_row_norm")
        return {k: statistics.fmean(v[k] for v in vals) for k in keys} if vals else {}

    return {"arm": arm.label, "algo": arm.algo, "model": arm.model, "extra": dict(arm.extra),
            "tuning": [{"lr": r["lr"], "val_accuracy": r["val_accuracy"]} for r in tuning],
            "chosen_lr": best["lr"], "test_accuracy_mean": statistics.fmean(accs),
            "test_accuracy_std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
            "epsilon": max(r["epsilon"] for r in finals), "certified": all(r["certified"] for r in finals),
            "noise_multiplier": finals[0]["noise_multiplier"], "update_noise_std": finals[0]["update_noise_std"],
            "sampling_noise_clipped": noise_summary("clipped_quantity"),
            "sampling_noise_plain": noise_summary("per_example_gradient"),
            "train_s_mean": statistics.fmean(r["train_s"] for r in finals), "runs": finals}


def write_summary(path: Path, protocol: dict, results: dict) -> None:
    """Merge this command's pairs into ``methods_summary.json`` (pairs of earlier commands are kept,
    each with the protocol of the command that produced it)."""
    old = json.loads(path.read_text()) if path.exists() else {}
    pairs_ = old.get("pairs", {})
    if "protocol" in old:   # older single-command layout: attach its protocol to its pairs
        pairs_ = {k: {"protocol": old["protocol"], "arms": v} for k, v in pairs_.items()}
    for k, v in results.items():
        pairs_[k] = {"protocol": protocol, "arms": [{kk: vv for kk, vv in r.items() if kk != "runs"} for r in v]}
    path.write_text(json.dumps({"pairs": pairs_}, indent=1, default=str))


def fmt(x: float, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}g}"


def markdown(results: dict) -> str:
    lines = ["| pair | arm | model | lr (val) | test acc % (mean ± std) | epsilon | z | update noise std | "
             "tau² clipped | tau²/‖mean‖² clipped | tau² plain grad | frac clipped | s/run |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for pair, arms in results.items():
        for r in arms:
            sc, sp = r["sampling_noise_clipped"], r["sampling_noise_plain"]
            lines.append(
                f"| {pair} | {r['arm']} | {r['model']} | {r['chosen_lr']:g} | "
                f"{100 * r['test_accuracy_mean']:.2f} ± {100 * r['test_accuracy_std']:.2f} | "
                f"{r['epsilon']:.3g}{'' if r['certified'] else ' (uncertified)'} | {r['noise_multiplier']:.3g} | "
                f"{r['update_noise_std']:.3g} | {fmt(sc.get('tau2'))} | {fmt(sc.get('relative'))} | "
                f"{fmt(sp.get('tau2'))} | {fmt(sc.get('frac_clipped'), 2)} | {r['train_s_mean']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", nargs="+", default=list(PAIR_NAMES), choices=PAIR_NAMES)
    p.add_argument("--model", default="cnn-gn", help="model of the method pairs (GroupNorm: batch-clip converts it)")
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--accountant", default="pld", choices=("pld", "rdp"))
    p.add_argument("--dice-accounting", default="certified", choices=("certified", "conservative", "authors"))
    p.add_argument("--ef-ratio", type=float, default=1.0, help="DiceSGD C2 = R * clip / B (r = 1)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--full-batch-steps", type=int, default=100, help="steps of the q = 1 arms (dpgd-momentum pair)")
    p.add_argument("--probes-full-batch", type=int, default=5, help="sampling-noise probes in a full-batch run")
    p.add_argument("--batch-size", type=float, default=256.0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--lrs", nargs="+", type=float, default=[0.5, 1.0, 2.0, 4.0],
                   help="learning-rate grid, the same for every arm (the tuning budget)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--tune-seed", type=int, default=0)
    p.add_argument("--subset", type=int, default=None, help="train on the first N training examples")
    p.add_argument("--validation", type=int, default=5000, help="validation split for tuning (not trained on)")
    p.add_argument("--split-seed", type=int, default=0)
    p.add_argument("--probe-size", type=int, default=256)
    p.add_argument("--probe-every", type=int, default=1, help="epochs between sampling-noise probes")
    p.add_argument("--perturb-k", type=float, default=0.003, help="perturb: k (||k zeta|| ~ k sqrt(d))")
    p.add_argument("--augmentations", type=int, default=4, help="self-aug: K")
    p.add_argument("--p", type=int, default=4, help="p-avg group size / batch-clip group size")
    p.add_argument("--k0", type=int, default=2)
    p.add_argument("--gamma0", type=float, default=0.08)
    p.add_argument("--gamma1", type=float, default=0.9)
    p.add_argument("--gamma-m", type=float, default=0.1, help="dpgd-momentum: weight of the new gradient")
    p.add_argument("--public-size", type=int, default=100)
    p.add_argument("--max-physical-batch", type=int, default=256)
    p.add_argument("--eval-batch", type=int, default=1000)
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a shared machine a 2-thread pool fighting "
                        "for the cores was 10x slower; run several processes instead)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--arms", default="both", choices=("both", "baseline", "method"),
                   help="run only one arm of each pair (to split a pair over two processes with the same "
                        "--out; a later 'both' call assembles the pair from the cached runs)")
    p.add_argument("--out", default="benchmarks/results/methods_pairs")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.tune_seed not in a.seeds:
        p.error("--tune-seed must be one of --seeds (its tuning run is reused)")
    if a.validation < a.probe_size:
        p.error("--validation must be >= --probe-size (the probe uses validation examples)")

    ds = load_dataset("fashion-mnist", validation=a.validation, seed=a.split_seed)
    public, ds = public_split(ds, a.public_size, "test", seed=a.split_seed)
    x, y = ds.x_train, ds.y_train
    if a.subset is not None:
        x, y = x[:a.subset], y[:a.subset]
    dev = torch.device(a.device)
    data = {"x": x.to(dev), "y": y.to(dev), "xv": ds.x_val.to(dev), "yv": ds.y_val.to(dev),
            "xt": ds.x_test.to(dev), "yt": ds.y_test.to(dev), "public": public.to(dev)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    table = pairs(a)
    results = {}
    protocol = {
        "epsilon": a.epsilon, "delta": a.delta, "accountant": a.accountant, "dice_accounting": a.dice_accounting,
        "N": len(y), "validation": a.validation, "test": len(ds.y_test), "public_features": a.public_size,
        "public_source": "Fashion-MNIST test split (removed from the test set for every pair; labels never read)",
        "batch_size": a.batch_size, "epochs": a.epochs, "full_batch_steps": a.full_batch_steps, "clip": a.clip,
        "lr_grid": a.lrs, "seeds": a.seeds, "tune_seed": a.tune_seed,
        "tuning": "per arm, learning rate by validation accuracy (seed --tune-seed); same grid for every arm",
        "sampling_noise": "Xiao et al. Def. 2.5 on --probe-size validation examples, after every epoch",
        "command": " ".join(sys.argv),
    }
    for name in a.pairs:
        if not a.quiet:
            print(f"pair {name}", file=sys.stderr, flush=True)
        chosen = {"both": table[name], "baseline": table[name][:1], "method": table[name][1:]}[a.arms]
        arms = [arm_result(arm, data, a, out) for arm in chosen]
        results[name] = arms
        if a.arms == "both":
            (out / f"methods_{name}.json").write_text(json.dumps(
                {"protocol": protocol, "pair": name, "arms": arms}, indent=1, default=str))
    if a.arms == "both":
        write_summary(out / "methods_summary.json", protocol, results)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
