"""What a run reports: the header before the first step, ``results.json`` after the last, the
privacy note in words, and the summary over seeds. JSON never holds a bare infinity
(``jsonable``): epsilon = inf must never read as a number.

``results.json`` holds the config, per-epoch history, final accuracy, the privacy statement and
wall times. What it holds besides the model's guarantee is listed in its ``outside_guarantee``
(``train_loss`` and validation metrics are statistics of the private data, not noised; wall times
depend on the data; the sizes of a keyed split are private).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from torch import Tensor

from ..data.catalog import HOLDOUT_CAVEAT
from ..files import atomic_write, jsonable
from .config import TrainConfig

RESULTS, CURVES = "results.json", "curves.png"
COMPARE = "compare.json"  # written by `clipbias compare`


def write_json(data: dict, path: str | os.PathLike) -> None:
    text = (json.dumps(jsonable(data), indent=2) + "\n").encode()
    atomic_write(Path(path), lambda fh: fh.write(text))


PRIVATE_STATISTICS_CAVEAT = ("the data were preprocessed with statistics of the private training split, which the "
                             "guarantee does not cover")


def statement(run, steps: int | None = None):
    """The run's privacy statement: the engine's (``DPEngine.privacy``: the mechanism, and the
    seed caveat of a reproducible run), not certified when the data's preprocessing used statistics
    of the private training split."""
    rep = run.engine.privacy(steps)
    if run.algo.private and run.splits.info.get("preprocessing") == "private-statistics":
        rep = rep.with_caveat(PRIVATE_STATISTICS_CAVEAT)
    if run.algo.private and run.splits.info.get("public_source") == "holdout":
        rep = rep.with_caveat(HOLDOUT_CAVEAT)
    return rep


def outside_guarantee(cfg: TrainConfig) -> list[str]:
    """What a run outputs that the DP guarantee (which covers the model weights) does not cover. Each entry
    names its fields (results.json's keys) before the first colon, then why."""
    out = ["train_loss (results.json, console, progress bar): mean loss of the private examples sampled, "
           "not noised"]
    if cfg.validation:
        out.append("val_accuracy, val_loss: measured on a validation split of the private training data, "
                   "not noised")
    out.append("wall_time_s, wall_time_per_epoch_s, epoch_time_s, eval_time_s (results.json, history, console): the "
               "run's wall times depend on the data (realised batch sizes, refused steps, the fast path's probe "
               "rechecks) and are not noised")
    if cfg.grad_path == "auto":
        out.append("gradients, grad_path_fallback (results.json, a warning): the path grad_path='auto' kept after "
                   "the first step, where a refusal of its first choice on the first batch moves it to the other "
                   "path; a refusal that depends on the data (the fast path's probe) tells one bit about that batch")
    out.append("n_given, n_expected, num_test, num_classes, input_shape (dataset): the training set as given (after "
               "--subset), its size N, the training part's expected size N - K - P (public parameters), the test "
               "split's size and the shapes are declared public; the add/remove guarantee does not hide N")
    split = cfg.validation or (cfg.extra.get("public_size") and cfg.public_source == "holdout")
    if split:
        out.append("n, dataset.n, num_val, num_public: the realised sizes of the keyed validation / held-out split "
                   "are private (they depend on which examples fell in which part) and are released exactly; q, the "
                   "steps and the noise multiplier are computed from the public expected size N - K - P, not from n")
    else:
        out.append("n, sample_rate, steps, planned_steps, noise_multiplier: n is N, declared public (above); q, the "
                   "steps and the noise are computed from it")
    return out


def privacy_note(cfg: TrainConfig, rep, private: bool, info: dict) -> str | None:
    """What the guarantee does not cover, in words (``None`` when nothing needs saying)."""
    notes = []
    if not private:
        notes.append("non-private: no DP guarantee")
    elif rep.basis and "REFUTED" in rep.basis:
        notes.append(f"NOT a guarantee: DiceSGD's '{cfg.dice_accounting}' bound is refuted by a canary attack "
                     f"(docs/privacy.md); for reproducing the paper only")
    if private:
        notes.extend(f"NOT certified: {c}" for c in rep.caveats)
    if private and info.get("preprocessing") == "none":
        notes.append("the arrays were used as given: the guarantee covers training on them, not whatever "
                     "made them")
    return "; ".join(notes) or None


def diverged(rec: dict, params: list[Tensor]) -> bool:
    """An infinite/NaN training or test loss, or a non-finite weight."""
    losses = [rec["train_loss"], rec.get("test_loss")]
    if any(v is not None and not math.isfinite(v) for v in losses):
        return True
    return not all(bool(torch.isfinite(p).all()) for p in params)


def eps_label(res: dict) -> str:
    eps = res["epsilon"]
    return "non-private" if math.isinf(eps) else f"epsilon={eps:.3g}, delta={res['delta']:g}"


def header(run, cfg: TrainConfig, resumed_at_epoch: int | None) -> dict:
    """What ``clipbias train`` prints before the first step: data, model, algorithm, the noise and
    the privacy statement projected to the end of the run."""
    from .. import privacy
    engine, info, private = run.engine, run.splits.info, run.algo.private
    projected = statement(run, engine.total_steps)
    h = {
        "dataset": info["name"], "N": engine.n, "N_given": info.get("n_given", engine.n),
        "q": engine.sample_rate, "B": engine.expected_batch_size,
        "steps": engine.total_steps, "steps_per_epoch": len(engine.sampler), "epochs": cfg.epochs,
        "model": cfg.model, "params": sum(p.numel() for p in run.model.parameters() if p.requires_grad),
        "algo": cfg.algo, "private": private, "noise_multiplier": engine.noise_multiplier,
        "target_epsilon": cfg.epsilon if private else math.inf, "delta": cfg.delta,
        "epsilon_at_end": projected.epsilon, "accountant": projected.accountant,
        "basis": projected.basis, "certified": projected.certified, "caveats": list(projected.caveats),
        "warning": privacy.delta_warning(cfg.delta, round(info.get("n_expected", engine.n))) if private else None,
        "noise_floor": privacy.gaussian.floor_note(cfg.epsilon, projected.epsilon, engine.noise_multiplier,
                                                 cfg.accountant) if private and cfg.noise_multiplier is None else None,
        "preprocessing": info["preprocessing"],
        "reproducible_noise": cfg.reproducible_noise, "outside_guarantee": outside_guarantee(cfg) if private else [],
        "resumed_at_epoch": resumed_at_epoch, "device": str(run.device),
        "gradients": engine.grad_path_note, "world_size": engine.world_size,
    }
    if engine.mechanism.takes_basis and engine.spec.dice is not None:  # error feedback: its ratio and clip
        h["ef_ratio_r"] = engine.spec.dice.ratio
        h["ef_clip"] = engine.spec.dice.ef_clip
    return h


def results(run, cfg: TrainConfig, head: dict, history: list[dict], wall: float, resumed: bool) -> dict:
    """The content of ``results.json``."""
    engine, algo = run.engine, run.algo
    final = statement(run)
    epoch_times = [h["epoch_time_s"] for h in history]
    return {
        "config": cfg.to_dict(),
        "dataset": run.splits.info,
        "model": {"name": cfg.model, "params": head["params"]},
        "algorithm": {"name": cfg.algo, "description": algo.description, "private": algo.private},
        "n": engine.n, "sample_rate": engine.sample_rate, "batch_size": engine.expected_batch_size,
        "steps": engine.steps_taken, "planned_steps": engine.total_steps,
        "noise_multiplier": engine.noise_multiplier,
        "target_epsilon": cfg.epsilon if algo.private else math.inf,
        "epsilon": final.epsilon, "delta": final.delta, "accountant": final.accountant,
        "basis": final.basis, "certified": final.certified, "caveats": list(final.caveats),
        "secret_randomness": ("derived from a seed: see caveats" if engine.key.reproducible else
                              "ChaCha20 under a 256-bit key from the OS CSPRNG (kept only in the private checkpoint)"),
        "outside_guarantee": head["outside_guarantee"],
        "privacy_note": privacy_note(cfg, final, algo.private, run.splits.info),
        **({"ef_ratio_r": head["ef_ratio_r"]} if "ef_ratio_r" in head else {}),
        "delta_warning": head["warning"],
        "test_accuracy": history[-1]["test_accuracy"] if history else None,
        "val_accuracy": history[-1].get("val_accuracy") if history else None,
        "train_loss": history[-1]["train_loss"] if history else None,
        "history": history,
        "wall_time_s": wall,
        "wall_time_per_epoch_s": sum(epoch_times) / len(epoch_times) if epoch_times else None,
        "resumed": resumed, "world_size": engine.world_size,
        "gradients": engine.grad_path_note, "grad_path_fallback": engine.grad_path_fallback,
        **({"ema": cfg.ema, "ema_test_accuracy": history[-1].get("ema_test_accuracy") if history else None,
            "ema_val_accuracy": history[-1].get("ema_val_accuracy") if history else None} if cfg.ema is not None else {}),
    }


def mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, s


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per label: mean/std test (and val) accuracy over seeds, epsilon, certified, z, time."""
    rows = []
    for label, rs in runs.items():
        acc_m, acc_s = mean_std([r["test_accuracy"] for r in rs])
        eps = [r["epsilon"] for r in rs]
        row = {"label": label, "algo": rs[0]["config"]["algo"], "seeds": [r["config"]["seed"] for r in rs],
               "test_accuracy_mean": acc_m, "test_accuracy_std": acc_s,
               "test_accuracies": [r["test_accuracy"] for r in rs],
               "epsilon": max(eps), "epsilon_per_seed": eps, "delta": rs[0]["delta"],
               "accountant": rs[0]["accountant"], "certified": all(r["certified"] for r in rs),
               "caveats": sorted({c for r in rs for c in r.get("caveats", [])}),
               "basis": rs[0]["basis"], "noise_multiplier": rs[0]["noise_multiplier"],
               "dice_accounting": rs[0]["config"]["dice_accounting"] if rs[0]["basis"].startswith("DiceSGD") else None,
               "ef_clip": rs[0]["config"]["ef_clip"], "lr": rs[0]["config"]["lr"],
               "wall_time_per_epoch_s": mean_std([r["wall_time_per_epoch_s"] for r in rs])[0],
               "wall_time_s": sum(r["wall_time_s"] for r in rs)}
        if rs[0].get("val_accuracy") is not None:
            row["val_accuracy_mean"], row["val_accuracy_std"] = mean_std([r["val_accuracy"] for r in rs])
        if rs[0].get("ema_test_accuracy") is not None:  # --ema: the averaged weights' accuracy
            row["ema"] = rs[0]["ema"]
            row["ema_test_accuracy_mean"], row["ema_test_accuracy_std"] = mean_std([r["ema_test_accuracy"] for r in rs])
        rows.append(row)
    return rows
