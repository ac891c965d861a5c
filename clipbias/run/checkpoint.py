"""Run directories and PRIVATE checkpoints: refuse what cannot work before any work, save and
load atomically, resume only with unchanged settings, export the releasable weights only.

``checkpoint.pt`` (mode 600) holds the model weights, ``engine.state_dict()`` (the DiceSGD
error-feedback buffer and the secret key), the history and the config; the top-level key
``PRIVATE`` says so. ``clipbias export`` turns it into a releasable weights-only file.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..engine.migrate import CHECKPOINT_FORMAT, migrate_checkpoint  # noqa: F401  (CHECKPOINT_FORMAT: what _save writes)
from ..errors import ConfigError, ResumeMismatchError
from ..files import atomic_write
from .config import RESUME_FREE, TrainConfig
from .report import COMPARE, CURVES, RESULTS, jsonable

CHECKPOINT = "checkpoint.pt"
PRIVATE_NOTE = "contains the DiceSGD error-feedback buffer and the secret key; never release"


def open_run_dir(out: Path | None, cfg: TrainConfig) -> dict | None:
    """The checkpoint to resume (``--resume``), or None for a fresh run; refuses to overwrite a run
    without ``--overwrite`` and a resume whose settings changed."""
    if out is None:
        if cfg.resume:
            raise ConfigError("`resume=True` needs `out` DIR (the run directory to continue)")
        return None
    ck_path = out / CHECKPOINT
    if cfg.resume:
        if not ck_path.is_file():
            raise ConfigError(f"`resume=True`: no checkpoint at {ck_path}; start the run without `resume=True`")
        ckpt = load_checkpoint(ck_path)
        resume_check(ckpt["config"], cfg)
        return ckpt
    if ck_path.exists() and not cfg.overwrite:
        raise ConfigError(f"`out='{out}'` already holds a checkpoint; continue it with `resume=True`, "
                          f"or replace it with `overwrite=True`")
    if (out / RESULTS).exists() and not cfg.overwrite:
        raise ConfigError(f"`out='{out}'` already holds a finished run's {RESULTS} (no checkpoint to resume); "
                          f"choose another `out`, or replace it with `overwrite=True`")
    if (out / COMPARE).exists() and not cfg.overwrite:
        raise ConfigError(f"`out='{out}'` holds a compare ({COMPARE}, {CURVES}); choose another `out`, or "
                          f"replace it with `overwrite=True`")
    return None


PREVIOUS = ".previous"  # an overwritten run's files, until the new run has finished


def set_aside(out: Path, names: tuple[str, ...] = (CHECKPOINT, RESULTS, CURVES, COMPARE)) -> None:
    """``--overwrite``: move the old run's files (``names``, files or directories) into
    ``out/.previous`` before the new run writes anything, so an interrupted overwrite never leaves old
    and new files mixed (the old run stays whole in ``.previous``); ``finish_overwrite`` removes it
    when the new run is complete."""
    old = [out / f for f in names if (out / f).exists()]
    if not old:
        return
    prev = out / PREVIOUS
    shutil.rmtree(prev, ignore_errors=True)
    prev.mkdir(mode=0o700)
    for f in old:
        os.replace(f, prev / f.name)


def finish_overwrite(out: Path) -> None:
    shutil.rmtree(out / PREVIOUS, ignore_errors=True)


def check_out_dir(out: Path) -> None:
    """Refuse, before any work, an ``--out`` that cannot become a run directory; remove the temporary
    files of checkpoint writes whose process died (they hold private state)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"`out='{out}'` is a file, not a directory; choose a directory path")
    for tmp in out.glob(".*.tmp*") if out.is_dir() else ():
        pid = tmp.name.rpartition(".tmp")[2]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)
    anc = out
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise ConfigError(f"`out='{out}'` lies under the file {anc}; choose a directory path")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise ConfigError(f"`out='{out}'`: {anc} is not writable; choose a directory you can write to")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def save_private(obj: Any, path: Path) -> None:
    """Write a PRIVATE file atomically, readable by its owner only (mode 600)."""
    atomic_write(path, lambda fh: torch.save(obj, fh), mode=0o600)
    os.chmod(path, 0o600)


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Load a PRIVATE checkpoint written by :func:`train` (a directory or the file itself), in the current
    format (``engine.migrate.migrate_checkpoint``; its ``"engine"`` entry is migrated when an engine loads it)."""
    p = Path(path)
    if p.is_dir():
        p = p / CHECKPOINT
    if not p.is_file():
        raise ConfigError(f"no checkpoint at {p} (train with `out` DIR first)")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling problem is a bad file
        detail = str(exc).strip().split(". ")[0][:160]  # torch appends a paragraph of advice
        raise ConfigError(f"{p} is truncated or corrupted, or not a clipbias checkpoint ({type(exc).__name__}: "
                          f"{detail}); it cannot be resumed or exported: start the run again with `overwrite=True`") from exc
    if not isinstance(ckpt, dict) or "model" not in ckpt or "engine" not in ckpt:
        raise ConfigError(f"{p} is not a clipbias checkpoint (no model/engine state)")
    return migrate_checkpoint(ckpt)


def export_weights(run_dir: str | os.PathLike, file: str | os.PathLike) -> dict:
    """Write the releasable artefact of a run: the model weights only (plus public metadata).

    Never the engine state: the DiceSGD error-feedback buffer ``e``, the optimizer state and RNG
    states stay in the private checkpoint. Returns what was written (minus the tensors).
    """
    ckpt = load_checkpoint(run_dir)
    cfg, last = ckpt["config"], ckpt["history"][-1]
    weights = {k: v.detach().cpu().clone() for k, v in ckpt["model"].items()}
    meta = {"model": cfg.get("model"), "data": cfg.get("data"), "algo": cfg.get("algo"),
            "input_shape": ckpt["input_shape"], "num_classes": ckpt["num_classes"],
            "epochs_trained": ckpt["epoch"], "steps": last.get("steps"),
            "epsilon": last.get("epsilon"), "delta": cfg.get("delta"),
            "accountant": last.get("accountant"), "certified": last.get("certified"),
            "caveats": last["caveats"], "basis": last.get("basis")}
    out = {"state_dict": weights, "meta": jsonable(meta)}
    if ckpt.get("ema_model") is not None:  # --ema: the averaged weights too (post-processing of the same run)
        out["ema_state_dict"] = {k: v.detach().cpu().clone() for k, v in ckpt["ema_model"].items()}
        meta.update(ema=ckpt["ema"]["decay"], ema_test_accuracy=last.get("ema_test_accuracy"))
        out["meta"] = jsonable(meta)
    file = Path(file)
    atomic_write(file, lambda fh: torch.save(out, fh))
    return {"file": str(file), "tensors": len(weights), **out["meta"]}


def resume_check(saved: dict, cfg: TrainConfig) -> None:
    """Refuse a resume whose settings changed (``RESUME_FREE`` ones may), naming the flag. More
    ``--epochs`` extend a run whose noise multiplier was given (the accounting simply covers more
    steps at the same noise); a calibrated run cannot be extended at its noise within its target."""
    now = cfg.to_dict()
    for key, value in now.items():
        if key in RESUME_FREE or (key == "epochs" and _extends(saved, cfg)):
            continue
        old = saved.get(key)
        if old != value and not (isinstance(old, (int, float)) and isinstance(value, (int, float))
                                 and math.isclose(old, value, rel_tol=1e-12)):
            if key == "extra":
                keys = {*(old or {}), *(value or {})}
                flag = "method settings (" + ", ".join(sorted(f"`AlgoConfig.extra[{k!r}]`" for k in keys)) + ")"
            else:
                flag = f"`{key}`"
            raise ResumeMismatchError(
                f"cannot resume: {flag} changed (checkpoint {old!r}, now {value!r}). Resume with the "
                f"original setting, or start a new run (another `out`, or `overwrite=True`).")


def _extends(saved: dict, cfg: TrainConfig) -> bool:
    """Whether ``cfg`` asks for more epochs than the checkpoint's run, and may have them."""
    old = saved.get("epochs")
    if not (isinstance(old, int) and cfg.epochs > old):
        return False
    if saved.get("noise_multiplier") is None and saved.get("epsilon") is not None:
        raise ResumeMismatchError(
            f"cannot extend this run from {old} to {cfg.epochs} epochs: its noise multiplier was calibrated so that "
            f"{old} epochs spend exactly `epsilon={saved['epsilon']:g}`; more steps at that noise would exceed it. "
            f"Start a new run with `epochs={cfg.epochs}` (the noise is calibrated for all of them), or, to spend "
            f"more than the original budget, start runs with `noise_multiplier` Z, which can be extended")
    return True


def to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    return obj
