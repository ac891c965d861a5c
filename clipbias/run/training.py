"""The library-level training loop: ``train(config) -> results dict``.

One run = its data (``run.splits``), the model and engine (``run.build_run``), then per epoch:
Poisson steps (``engine.run_steps``), test (and validation) accuracy, the epsilon spent so far
(``engine.privacy()``) and a PRIVATE checkpoint (``run.checkpoint``). Reused by ``clipbias train``,
``clipbias compare`` and ``benchmarks/``; ``clipbias.run`` exports ``train`` and ``run_many``.

Files written under ``config.out`` (when given): ``checkpoint.pt`` (mode 600, PRIVATE: the
DiceSGD error-feedback buffer and the secret key; ``clipbias export`` makes the releasable file),
``results.json`` (config, per-epoch history, final accuracy, the privacy statement, wall times) and
``curves.png`` (accuracy and loss per epoch).

Example::

    from clipbias.run import TrainConfig, train
    res = train(TrainConfig(data="digits", model="mlp", algo="dice", epsilon=3, delta=1e-5,
                            epochs=3, batch_size=64, lr=0.5, clip=1.0))
    res["test_accuracy"], res["epsilon"], res["certified"]
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .. import algorithms, distributed
from ..data.catalog import Dataset
from ..engine.core import run_steps
from ..errors import ConfigError, ResumeMismatchError, TrainingDivergedError
from ..files import run_lock
from .build import Run, build_run, evaluate
from ..randomness.key import SecretKey, derive_seed
from .checkpoint import (CHECKPOINT, CHECKPOINT_FORMAT, PRIVATE_NOTE, check_out_dir, export_weights, finish_overwrite,
                         load_checkpoint, open_run_dir, save_private, set_aside, to_cpu)
from .config import TrainConfig, check_int, default_out
from .report import (CURVES, RESULTS, diverged, eps_label, header, jsonable, mean_std, privacy_note, results,
                     statement, summarize, write_json)
from .splits import Splits, prepare_splits, splits_for

__all__ = ["TrainConfig", "Splits", "prepare_splits", "train", "evaluate", "load_checkpoint",
           "export_weights", "run_many", "summarize", "PRIVATE_NOTE", "CHECKPOINT", "RESULTS", "CURVES",
           "default_out", "write_json", "jsonable", "privacy_note", "mean_std"]


def train(config: TrainConfig, **kwargs: Any) -> dict:
    """Run one training configuration; returns the results dict (also written to ``out``).

    Keyword arguments: ``splits`` (from :func:`prepare_splits`) or ``dataset`` avoid reloading the
    data. ``on_start`` gets the header dict (dataset, N, q, B, steps, noise multiplier, privacy basis,
    ...) before the first step (rank 0), ``on_engine`` the built ``DPEngine`` (every rank);
    ``on_epoch_end`` gets each epoch's record after the checkpoint is written (raising from it interrupts the run, which ``resume=True`` continues). ``progress`` shows
    a tqdm bar; ``checkpoint`` and ``plot`` (default True) write ``checkpoint.pt`` and ``curves.png``.
    ``out`` is locked for the run: a second run on the same directory is refused.

    Inside an initialised torch.distributed process group every rank calls ``train`` with the same
    config: each steps on its share of every global Poisson batch (``clipbias.distributed``), and
    rank 0 alone touches ``out`` (lock, checkpoint, results) and broadcasts what the others need.
    """
    if not config.out:
        return _train(config, open_run_dir(None, config), **kwargs)  # refuses --resume without --out
    with contextlib.ExitStack() as held:
        ckpt = distributed.from_rank0(lambda: _open(config, held))
        return _train(config, ckpt, **kwargs)


def _open(config: TrainConfig, held: contextlib.ExitStack) -> dict | None:
    """Check and lock the run directory (held until ``held`` closes); the checkpoint to resume, or None."""
    out = Path(config.out)
    check_out_dir(out)
    held.enter_context(run_lock(out))
    return open_run_dir(out, config)


def _train(config: TrainConfig, ckpt: dict | None, *, dataset: Dataset | None = None, splits: Splits | None = None,
           progress: bool = False, on_start: Callable[[dict], None] | None = None,
           on_epoch_end: Callable[[dict], None] | None = None, checkpoint: bool = True,
           plot: bool = True, on_engine: Callable[[Any], None] | None = None) -> dict:
    t_start = time.perf_counter()
    cfg = config
    out = Path(cfg.out) if cfg.out else None
    key = run_key(cfg, ckpt)
    run = build_run(cfg, splits_for(cfg, splits, dataset, key), key)
    if on_engine is not None:
        on_engine(run.engine)
    history, start_epoch, prior_time = _restore(run, ckpt)
    lead = distributed.context()[0] == 0  # rank 0 writes the files; every rank trains
    if out is not None and ckpt is None and lead:  # --overwrite: the old run is set aside only now, once built
        set_aside(out)
    head = header(run, cfg, start_epoch if ckpt is not None else None)
    if on_start is not None and lead:
        on_start(head)
    bar = _Progress(run, cfg, history) if progress and lead else None
    try:
        for epoch in range(start_epoch, cfg.epochs):
            rec = _epoch(run, epoch, bar)
            history.append(rec)
            _refuse_diverged(run, rec, history, out)
            if out is not None and checkpoint:
                _save(run, out, epoch, history, prior_time + time.perf_counter() - t_start)
            if on_epoch_end is not None:
                on_epoch_end(rec)
    finally:
        if bar is not None:
            bar.close()
    res = results(run, cfg, head, history, prior_time + time.perf_counter() - t_start, ckpt is not None)
    if out is not None and lead:
        write_json(res, out / RESULTS)
        if plot:
            from .plots import plot_curves_or_notice
            plot_curves_or_notice({cfg.algo: [history]}, out / CURVES, title=f"{cfg.data} / {cfg.model} / {eps_label(res)}")
        finish_overwrite(out)
    return res


def run_key(cfg: TrainConfig, ckpt: dict | None) -> SecretKey:
    """The run's secret key, made before its data are split (the validation and held-out parts are keyed
    draws under it): the checkpoint's on resume (the same split again), the seed's with
    ``--reproducible-noise``, else 256 fresh OS bits; in a process group, rank 0's on every rank."""
    state = (ckpt or {}).get("engine", {}).get("secret_key")
    key = SecretKey.from_state(state) if state is not None else SecretKey.of(cfg.key_seed)
    return distributed.broadcast_key(key)


def _restore(run: Run, ckpt: dict | None) -> tuple[list[dict], int, float]:
    """Continue from a checkpoint: (history, the epoch to start at, the wall time already spent)."""
    if ckpt is None:
        return [], 0, 0.0
    rank, world = distributed.context()
    if ckpt["world_size"] != world:
        raise ResumeMismatchError(
            f"cannot resume: the checkpoint was written by a run on {ckpt['world_size']} process(es), this "
            f"one has {world}. Resume at the same world size (torchrun --nproc-per-node / --nnodes as before, or "
            f"plain `clipbias train` for 1): each process's share of the batches and its random state continue "
            f"exactly only there; changing it is refused rather than approximated")
    run.engine.load_state_dict(ckpt["engine"])  # ResumeMismatchError if privacy settings changed
    run.model.load_state_dict(ckpt["model"])
    torch.set_rng_state(ckpt["torch_rng_ranks"][rank])
    if run.device.type == "cuda" and ckpt["cuda_rng"] is not None:
        torch.cuda.set_rng_state(ckpt["cuda_rng"], run.device)
    if run.ema is not None:
        run.ema.load_state_dict(ckpt["ema"])
    return list(ckpt["history"]), int(ckpt["epoch"]), float(ckpt["wall_time_s"])


def _epoch(run: Run, epoch: int, bar: "_Progress | None") -> dict:
    """One epoch of steps, then the test (and validation) accuracy and the epsilon spent so far."""
    engine, splits = run.engine, run.splits
    t0 = time.perf_counter()
    total, count = run_steps(engine, splits.x_train, splits.y_train, len(engine.sampler), after=_after(run, epoch, bar))
    train_time, t1 = time.perf_counter() - t0, time.perf_counter()
    acc, test_loss = run.evaluate(splits.x_test, splits.y_test)
    rec = {"epoch": epoch + 1, "steps": engine.steps_taken, "train_loss": total / max(count, 1),
           "test_accuracy": acc, "test_loss": test_loss}
    if splits.x_val is not None:
        rec["val_accuracy"], rec["val_loss"] = run.evaluate(splits.x_val, splits.y_val)
    if run.ema is not None:  # the averaged weights, evaluated on the same splits
        with run.ema.applied():
            rec["ema_test_accuracy"], rec["ema_test_loss"] = run.evaluate(splits.x_test, splits.y_test)
            if splits.x_val is not None:
                rec["ema_val_accuracy"], rec["ema_val_loss"] = run.evaluate(splits.x_val, splits.y_val)
    rep = statement(run)
    rec.update(epsilon=rep.epsilon, accountant=rep.accountant, certified=rep.certified, basis=rep.basis,
               caveats=list(rep.caveats))
    rec["epoch_time_s"], rec["eval_time_s"] = train_time, time.perf_counter() - t1
    if bar is not None:
        bar.epoch_end(rec)
    return rec


def _after(run: Run, epoch: int, bar: "_Progress | None"):
    """What runs after every step: the weight average's update, the progress bar."""
    if run.ema is None and bar is None:
        return None

    def after(engine, losses: torch.Tensor) -> None:
        if run.ema is not None:
            run.ema.update()
        if bar is not None:
            bar.step(epoch, losses)
    return after


def _refuse_diverged(run: Run, rec: dict, history: list[dict], out: Path | None) -> None:
    """Fail loudly: never report the accuracy of a broken model (results.json records the failure)."""
    if not diverged(rec, run.engine.params):
        return
    cfg, rep = run.cfg, statement(run)
    if out is not None and distributed.context()[0] == 0:
        write_json({"config": cfg.to_dict(), "diverged": True, "history": history, "epsilon": rep.epsilon,
                    "delta": rep.delta, "basis": rep.basis, "certified": rep.certified,
                    "steps": run.engine.steps_taken}, out / RESULTS)
    raise TrainingDivergedError(
        f"training diverged in epoch {rec['epoch']} (training loss {rec['train_loss']:.3g}, test loss "
        f"{rec['test_loss']}): the model is unusable. Lower `lr` (now {cfg.lr:g}) and start again"
        + (f" with `overwrite=True`; {out / RESULTS} records the diverged run" if out is not None else ""))


def _save(run: Run, out: Path, epoch: int, history: list[dict], wall: float) -> None:
    """The PRIVATE checkpoint, written atomically by rank 0; every rank calls it (the per-rank torch
    RNG states are gathered: public randomness outside the private step; its dropout masks are keyed,
    ``clipbias.randomness.forward``)."""
    dev, info = run.device, run.splits.info
    rngs = distributed.gather_objects(torch.get_rng_state())
    engine_state = to_cpu(run.engine.state_dict())  # a collective for per-example state (dpgd-momentum)
    if distributed.context()[0] != 0:
        return
    save_private({
        "PRIVATE": PRIVATE_NOTE, "format": CHECKPOINT_FORMAT, "epoch": epoch + 1,
        "model": {k: v.detach().cpu() for k, v in run.model.state_dict().items()},
        "engine": engine_state, "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None,
        "history": history, "config": run.cfg.to_dict(), "input_shape": list(info["input_shape"]),
        "num_classes": info["num_classes"], "wall_time_s": wall,
        "world_size": len(rngs), "torch_rng_ranks": rngs,
        **({"ema": run.ema.state_dict(), "ema_model": run.ema.averaged_state_dict()} if run.ema is not None else {}),
    }, out / CHECKPOINT)


class _Progress:
    """The tqdm bar of ``train(progress=True)``: steps, epoch, last loss, test accuracy, epsilon."""

    def __init__(self, run: Run, cfg: TrainConfig, history: list[dict]) -> None:
        from tqdm.auto import tqdm
        self.epochs = cfg.epochs
        self.bar = tqdm(total=run.engine.total_steps, initial=run.engine.steps_taken, unit="step",
                        mininterval=1.0, desc=f"{cfg.algo}", dynamic_ncols=True, leave=True)
        self.acc = history[-1]["test_accuracy"] if history else None
        self.eps = history[-1]["epsilon"] if history else None

    def step(self, epoch: int, losses: torch.Tensor) -> None:
        self.bar.update(1)
        post = {"ep": f"{epoch + 1}/{self.epochs}", "loss": f"{float(losses.mean()):.3f}" if len(losses) else "-"}
        if self.acc is not None:
            post["test_acc"] = f"{self.acc:.4f}"
        if self.eps is not None:
            post["eps"] = _fmt_eps(self.eps)
        self.bar.set_postfix(post, refresh=False)

    def epoch_end(self, rec: dict) -> None:
        self.acc, self.eps = rec["test_accuracy"], rec["epsilon"]
        self.bar.set_postfix({"ep": f"{rec['epoch']}/{self.epochs}", "loss": f"{rec['train_loss']:.3f}",
                              "test_acc": f"{self.acc:.4f}", "eps": _fmt_eps(self.eps)})

    def close(self) -> None:
        self.bar.close()


def _fmt_eps(eps: float) -> str:
    return "inf" if math.isinf(eps) else f"{eps:.3f}"


# ----------------------------------------------------------------------------- several runs

def run_many(base: TrainConfig, variants: list[tuple[str, dict]], seeds: list[int], *,
             out: str | os.PathLike | None = None, splits: Splits | None = None, progress: bool = False,
             on_run: Callable[[str, int, dict], None] | None = None,
             on_start: Callable[[str, int, dict], None] | None = None) -> dict:
    """Run each ``(label, overrides)`` variant of ``base`` for every seed on the same data.

    The data are loaded (and scattering features computed) once. Each run's ``results.json`` goes to
    ``out/<label>-s<seed>/`` (no checkpoint). Returns ``{"runs": {label: [results per seed]},
    "summary": [row per label]}`` (see :func:`summarize`).
    """
    if not variants:
        raise ConfigError("give at least one algorithm to run")
    if not seeds:
        raise ConfigError("`seeds`: give at least one seed")
    for s in seeds:
        check_int(s, "seeds", 0)
    labels = [label for label, _ in variants]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"`variants`: each algorithm may appear once, got {' '.join(labels)}")
    cfgs = {label: dataclasses.replace(base, **ov, resume=False) for label, ov in variants}
    if splits is None:
        splits = prepare_splits(next(iter(cfgs.values())))
    for cfg in cfgs.values():  # each variant's checks that need the data size, before any run trains
        algo = algorithms.get(cfg.algo)
        if algo.validate is not None:
            ac = cfg.algo_config_without_public() if algo.needs_public else cfg.algo_config()
            algo.validate(ac, algo.settings(ac), min(1.0, cfg.batch_size / splits.n), cfg.batch_size)
    runs: dict[str, list[dict]] = {}
    for label, cfg in cfgs.items():
        runs[label] = []
        for seed in seeds:
            run_out = None if out is None else str(Path(out) / f"{safe_name(label)}-s{seed}")
            c = dataclasses.replace(cfg, seed=seed, out=run_out, overwrite=True, noise_seed=None if cfg.noise_seed is None
                                    else derive_seed(cfg.noise_seed, seed))  # one key per run, never shared
            res = train(c, splits=splits, progress=progress, checkpoint=False, plot=False,
                        on_start=(lambda h, lab=label, s=seed: on_start(lab, s, h)) if on_start else None)
            res["label"] = label
            runs[label].append(res)
            if on_run is not None:
                on_run(label, seed, res)
    return {"runs": runs, "summary": summarize(runs)}


def safe_name(label: str) -> str:
    """A run label as a directory name (``dice:paper`` -> ``dice_paper``): compare's per-run directories."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)
