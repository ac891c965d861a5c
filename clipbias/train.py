"""The library-level training loop: ``train(config) -> results dict``.

One run = load data (or take it from the caller), build the model, build a ``DPEngine`` (which
calibrates the noise for the target epsilon), then per epoch: Poisson steps, test (and validation)
accuracy in batches under ``torch.no_grad()``, the epsilon spent so far (``engine.privacy()``) and a
PRIVATE checkpoint. Reused by ``clipbias train``, ``clipbias compare`` and ``benchmarks/``.

Files written under ``config.out`` (when given):

* ``checkpoint.pt`` (mode 600): model weights, ``engine.state_dict()`` (the DiceSGD error-feedback
  buffer and the RNG states: secret), history, config. Top-level key ``PRIVATE`` says so.
  ``clipbias export`` turns it into a releasable weights-only file.
* ``results.json``: config, per-epoch history, final accuracy, the privacy statement, wall times.
* ``curves.png``: accuracy and loss per epoch.

Example::

    from clipbias.train import TrainConfig, train
    res = train(TrainConfig(data="digits", model="mlp", algo="dice", epsilon=3, delta=1e-5,
                            epochs=3, batch_size=64, lr=0.5, clip=1.0))
    res["test_accuracy"], res["epsilon"], res["certified"]
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from . import algorithms, privacy
from .config import AlgoConfig
from .data import DATASET_NAMES, Dataset, load_dataset
from .engine import DPEngine
from .errors import ClipbiasError, ConfigError, ResumeMismatchError, TrainingDivergedError
from .files import atomic_write, run_lock
from .privacy.report import check_delta, check_epsilon, check_nonnegative, check_positive

__all__ = ["TrainConfig", "Splits", "prepare_splits", "train", "evaluate", "load_checkpoint",
           "export_weights", "run_many", "summarize", "PRIVATE_NOTE", "CHECKPOINT", "RESULTS", "CURVES",
           "default_out", "write_json", "jsonable"]

CHECKPOINT, RESULTS, CURVES = "checkpoint.pt", "results.json", "curves.png"
PRIVATE_NOTE = "contains the DiceSGD error-feedback buffer and RNG states; never release"
CHECKPOINT_FORMAT = 1

# Method-specific hyper-parameters (``AlgoConfig.extra``): config field -> CLI flag.
# The keys are those clipbias.methods reads (canonical names or their accepted aliases).
EXTRA_FLAGS = {"perturb_k": "--perturb-k", "p": "--p", "augmentations": "--augmentations",
               "k0": "--k0", "gamma0": "--gamma0", "gamma1": "--gamma1",
               "public_size": "--public-size", "pad": "--aug-pad", "flip": "--aug-flip",
               "draws": "--vote-draws", "gamma_m": "--gamma-m", "normalize": "--normalize-momentum",
               "max_memory_gb": "--max-memory-gb"}

# Settings that may differ on --resume (they do not change the math or the privacy statement).
_RESUME_FREE = {"out", "resume", "overwrite", "max_physical_batch", "eval_batch_size", "data_dir"}


@dataclass
class TrainConfig:
    """Everything one run depends on. Field names are the CLI flags with ``-`` -> ``_``.

    ``batch_size`` is the *expected* Poisson batch size B (q = B / N). Private algorithms need
    ``epsilon`` (the engine calibrates the noise multiplier) or ``noise_multiplier``; non-private
    ones ignore both and report epsilon = inf. ``subset`` trains on the first N training examples
    (then N is what the accounting uses). ``validation`` carves a validation split out of the
    training data (fixed split seed ``split_seed``, the same for every training seed, so runs
    with different seeds are compared on the same split). ``extra`` holds method-specific
    hyper-parameters (keys of ``EXTRA_FLAGS``: ``perturb_k``, ``p``, ``augmentations``, ``k0``,
    ``gamma0``, ``gamma1``, ``public_size``, ...), only those given; ``clipbias.methods`` validates
    them. ``batch-clip`` takes ``public_size`` public features from the test split (removed from
    evaluation; ``public_source="test"``) or held out of the training split (``"holdout"``, N shrinks).
    """

    data: str = "fashion-mnist"
    model: str = "cnn"
    algo: str = "dpsgd"
    epsilon: float | None = None
    delta: float = 1e-5
    epochs: int = 1
    batch_size: float = 256.0
    lr: float = 0.1
    clip: float = 1.0
    ef_clip: float | None = None
    grad_bound: float | None = None
    accountant: str = "pld"
    dice_accounting: str = privacy.DEFAULT_DICE_ACCOUNTING
    noise_multiplier: float | None = None
    seed: int = 0
    reproducible_noise: bool = False
    device: str = "cpu"
    optimizer: str | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    gamma: float = 0.01
    max_physical_batch: int = 512
    validation: int = 0
    subset: int | None = None
    split_seed: int = 0
    public_source: str = "test"
    extra: dict = field(default_factory=dict)
    out: str | None = None
    resume: bool = False
    overwrite: bool = False
    eval_batch_size: int = 1024
    data_dir: str | None = None

    @property
    def private(self) -> bool:
        return algorithms.get(self.algo).private

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def algo_config(self) -> AlgoConfig:
        return AlgoConfig(lr=self.lr, clip=self.clip, ef_clip=self.ef_clip, grad_bound=self.grad_bound,
                          gamma=self.gamma, optimizer=self.optimizer, momentum=self.momentum,
                          weight_decay=self.weight_decay, extra=dict(self.extra))

    def validate(self) -> "TrainConfig":
        """Checks that need no data; each error names the flag. Returns self."""
        if self.data not in DATASET_NAMES:
            raise ConfigError(f"--data must be one of {', '.join(DATASET_NAMES)}, got {self.data!r}")
        from .models import MODEL_NAMES
        if self.model not in MODEL_NAMES:
            raise ConfigError(f"--model must be one of {', '.join(MODEL_NAMES)}, got {self.model!r}")
        algo = algorithms.get(self.algo)
        if self.epsilon is not None:
            check_epsilon(self.epsilon, "--epsilon")
        if self.noise_multiplier is not None:
            check_positive(self.noise_multiplier, "--noise-multiplier")
        check_delta(self.delta, "--delta")
        if algo.private:
            if self.epsilon is None and self.noise_multiplier is None:
                raise ConfigError(f"--epsilon is required for the private --algo {self.algo} "
                                  f"(or give --noise-multiplier)")
            if self.epsilon is not None and self.noise_multiplier is not None:
                raise ConfigError("give either --epsilon or --noise-multiplier, not both")
        _check_int(self.epochs, "--epochs", 1)
        check_positive(self.batch_size, "--batch-size")
        if self.batch_size < 1:
            raise ConfigError(f"--batch-size is the expected Poisson batch size B and must be >= 1, got "
                              f"{self.batch_size!r} (B < 1 would mean more steps per epoch than examples)")
        check_positive(self.lr, "--lr")
        check_positive(self.clip, "--clip")
        if self.ef_clip is not None:
            check_positive(self.ef_clip, "--ef-clip")
            if not algo.reads_ef_clip:  # it would be recorded but change nothing
                raise ConfigError(f"--ef-clip applies to the clipped error-feedback algorithms (dice, dice-adam, "
                                  f"dice-perturb, dice-self-aug, ef-sgd); --algo {self.algo} has no clipped "
                                  f"feedback buffer: drop --ef-clip")
        if self.grad_bound is not None:
            check_positive(self.grad_bound, "--grad-bound")
        check_positive(self.gamma, "--gamma")
        if not (math.isfinite(self.momentum) and 0 <= self.momentum < 1):
            raise ConfigError(f"--momentum must lie in [0, 1), got {self.momentum!r}")
        check_nonnegative(self.weight_decay, "--weight-decay")
        if self.optimizer is not None and self.optimizer not in ("sgd", "adam", "adamw"):
            raise ConfigError(f"--optimizer must be one of sgd, adam, adamw, got {self.optimizer!r}")
        if self.accountant not in privacy.ACCOUNTANTS:
            raise ConfigError(f"--accountant must be one of {', '.join(privacy.ACCOUNTANTS)}, "
                              f"got {self.accountant!r}")
        privacy.dice.check_basis(self.dice_accounting)
        _check_int(self.seed, "--seed", 0)
        _check_int(self.split_seed, "split_seed", 0)
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"--device must be cpu or cuda, got {self.device!r}")
        _check_int(self.max_physical_batch, "--max-physical-batch", 1)
        _check_int(self.eval_batch_size, "eval_batch_size", 1)
        _check_int(self.validation, "--validation", 0)
        if self.subset is not None:
            _check_int(self.subset, "--subset", 1)
        given = {k: v for k, v in self.extra.items() if v is not None}
        if given and not algo.schema:  # core algorithms read no method setting
            flags = ", ".join(EXTRA_FLAGS.get(k, k) for k in given)
            raise ConfigError(f"{flags} {'does' if len(given) == 1 else 'do'} not apply to --algo {self.algo}; the method flags are for "
                              f"the paper methods (perturb, p-avg, inner-outer, ...)")
        if "public_size" in given:
            _check_int(given["public_size"], "--public-size", 1)
        if self.public_source not in ("test", "holdout"):
            raise ConfigError(f"--public-source must be test or holdout, got {self.public_source!r}")
        if given:  # the method's own checks (each message names the flag)
            algo.settings(self.algo_config_without_public() if algo.needs_public else self.algo_config())
        return self

    def algo_config_without_public(self) -> AlgoConfig:
        """For validation before the public features exist: a placeholder tensor."""
        return dataclasses.replace(self.algo_config(), extra={**self.extra, "public": torch.zeros(1, 1)})


def _check_int(v: Any, flag: str, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ConfigError(f"{flag} must be an integer >= {minimum}, got {v!r}")
    return v


def tune_allocator() -> bool:
    """Keep freed memory inside the process (glibc ``mallopt``); returns whether it applied.

    Every step allocates per-example gradient matrices of hundreds of MB (B x d floats). With glibc's
    defaults each such block is a fresh ``mmap`` whose pages all fault on first touch and go back to
    the kernel on free: on Fashion-MNIST (scatter-linear, cnn; B = 2048) that kernel time was as
    large as the computation itself. Raising the mmap and trim thresholds removes it (measured: sys
    time per step 0.8 s -> 0.002 s). Process-wide, so only the commands call it, not the library.
    """
    import ctypes
    import sys
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        ok = libc.mallopt(m_mmap_threshold, 1 << 30) == 1
        libc.mallopt(m_trim_threshold, (1 << 31) - 1)
        libc.mallopt(m_top_pad, 256 << 20)
        return ok
    except (OSError, AttributeError):  # not glibc
        return False


def default_out(cfg: TrainConfig) -> str:
    """``runs/<data>-<model>-<algo>-eps<E>-s<seed>`` (``epsinf`` for non-private algorithms)."""
    eps = f"{cfg.epsilon:g}" if (cfg.private and cfg.epsilon is not None) else (
        f"z{cfg.noise_multiplier:g}" if cfg.private else "inf")
    return os.path.join("runs", f"{cfg.data}-{cfg.model}-{cfg.algo}-eps{eps}-s{cfg.seed}")


# ----------------------------------------------------------------------------- data

@dataclass
class Splits:
    """Tensors ready for the model (scattering features for scatter models), on ``device``.

    Build once per command with :func:`prepare_splits` and pass to every :func:`train` call.
    """

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    x_val: Tensor | None
    y_val: Tensor | None
    info: dict  # dataset name, n, shapes, notes, preprocessing_private, features
    public_x: Tensor | None = None

    @property
    def n(self) -> int:
        return int(self.y_train.shape[0])


def _device(name: str) -> torch.device:
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: CUDA is not available on this machine "
                              "(torch.cuda.is_available() is False); use --device cpu")
        return torch.device("cuda")
    if name != "cpu":
        raise ConfigError(f"--device must be cpu or cuda, got {name!r}")
    return torch.device("cpu")


def _build_model(cfg: TrainConfig, ds_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    from .models import build_model
    try:
        return build_model(cfg.model, ds_shape, num_classes)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(f"--model {cfg.model} does not fit --data {cfg.data} (per-example input "
                          f"shape {tuple(ds_shape)}): {exc}") from exc


def prepare_splits(cfg: TrainConfig, dataset: Dataset | None = None) -> Splits:
    """Load the data once (unless given), apply ``--validation``/``--subset``/``--public-size``,
    and turn images into scattering features for scatter models (once per split, cached on disk)."""
    if dataset is None:
        try:
            dataset = load_dataset(cfg.data, data_dir=cfg.data_dir, validation=cfg.validation,
                                   seed=cfg.split_seed)
        except ClipbiasError:
            raise
        except ValueError as exc:  # e.g. a validation split larger than the training set
            if cfg.validation:
                raise ConfigError(f"--validation {cfg.validation} must be smaller than the training "
                                  f"split of {cfg.data} ({exc})") from exc
            raise ConfigError(f"--data {cfg.data}: {exc}") from exc
    elif cfg.validation and (dataset.x_val is None or len(dataset.y_val) != cfg.validation):
        raise ConfigError(f"--validation {cfg.validation}: the given dataset has no validation split "
                          f"of that size")
    public_x = None
    public_size = cfg.extra.get("public_size")
    if public_size is None and algorithms.get(cfg.algo).needs_public:
        raise ConfigError(f"--algo {cfg.algo} needs public features: give --public-size N (taken from "
                          f"the test split, or from the training split with --public-source holdout)")
    if public_size is not None:
        from .algorithms import public_split
        limit = dataset.num_train if cfg.public_source == "holdout" else len(dataset.y_test)
        if public_size >= limit:
            raise ConfigError(f"--public-size must be < the {limit} {cfg.public_source} examples, "
                              f"got {public_size}")
        public_x, dataset = public_split(dataset, public_size, cfg.public_source, seed=cfg.split_seed)
    x_tr, y_tr = dataset.x_train, dataset.y_train
    if cfg.subset is not None:
        if cfg.subset > len(y_tr):
            raise ConfigError(f"--subset must be <= the {len(y_tr)} training examples, got {cfg.subset}")
        x_tr, y_tr = x_tr[:cfg.subset], y_tr[:cfg.subset]
    x_te, y_te, x_va, y_va = dataset.x_test, dataset.y_test, dataset.x_val, dataset.y_val

    probe = _build_model(cfg, dataset.input_shape, dataset.num_classes)
    features = "raw"
    if hasattr(probe, "preprocess"):
        features = f"{type(probe).__name__}.preprocess (scattering, computed once per split)"
        tag = dataset.name + (f"-sub{cfg.subset}" if cfg.subset else "") + (
            f"-val{cfg.validation}" if cfg.validation else "") + (f"-pub{public_size}" if public_size else "")
        x_tr = probe.preprocess(x_tr, cache_key=f"{tag}-train")
        x_te = probe.preprocess(x_te, cache_key=f"{dataset.name}-test" + (
            f"-pub{public_size}" if public_size and cfg.public_source == "test" else ""))
        if x_va is not None:
            x_va = probe.preprocess(x_va, cache_key=f"{tag}-val")
        if public_x is not None:
            public_x = probe.preprocess(public_x, cache_key=f"{tag}-public")
    dev = _device(cfg.device)
    move = (lambda t: None if t is None else t.to(dev))
    info = {"name": dataset.name, "n": int(len(y_tr)), "num_test": int(len(y_te)),
            "num_val": 0 if y_va is None else int(len(y_va)), "input_shape": list(dataset.input_shape),
            "num_classes": dataset.num_classes, "notes": dataset.notes,
            "preprocessing_private": dataset.preprocessing_private, "features": features,
            "subset": cfg.subset, "validation": cfg.validation, "public_size": public_size,
            "public_source": cfg.public_source if public_size else None,
            "model_key": _model_key(cfg.model)}
    return Splits(move(x_tr), move(y_tr), move(x_te), move(y_te), move(x_va), move(y_va), info,
                  move(public_x))


def _model_key(model: str) -> str:
    return "scatter" if model.startswith("scatter") else "raw"


# ----------------------------------------------------------------------------- evaluation

@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 1024,
             predict: Callable[[nn.Module, Tensor], Tensor] | None = None) -> tuple[float, float | None]:
    """(accuracy, mean cross-entropy) over ``(x, y)``, in batches, in eval mode, without grad.

    ``predict(model, x) -> labels`` replaces the plain forward pass (BatchClipping's majority vote);
    the loss is then None.
    """
    was_training = model.training
    model.eval()
    correct, loss = 0, 0.0
    try:
        if predict is not None:
            for i in range(0, len(y), batch_size):
                correct += int((predict(model, x[i:i + batch_size]).to(y.device) == y[i:i + batch_size]).sum())
            return correct / max(len(y), 1), None
        for i in range(0, len(y), batch_size):
            out = model(x[i:i + batch_size])
            yb = y[i:i + batch_size]
            loss += float(nn.functional.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(1) == yb).sum())
    finally:
        model.train(was_training)
    n = max(len(y), 1)
    return correct / n, loss / n


# ----------------------------------------------------------------------------- checkpoints

def check_out_dir(out: Path) -> None:
    """Refuse, before any work, an ``--out`` that cannot become a run directory; remove the temporary
    files of checkpoint writes whose process died (they hold private state)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory; choose a directory path")
    for tmp in out.glob(".*.tmp*") if out.is_dir() else ():
        pid = tmp.name.rpartition(".tmp")[2]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)
    anc = out
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise ConfigError(f"--out {out} lies under the file {anc}; choose a directory path")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out}: {anc} is not writable; choose a directory you can write to")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _atomic_private_save(obj: Any, path: Path) -> None:
    atomic_write(path, lambda fh: torch.save(obj, fh), mode=0o600)
    os.chmod(path, 0o600)


def load_checkpoint(path: str | os.PathLike) -> dict:
    """Load a PRIVATE checkpoint written by :func:`train` (a directory or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / CHECKPOINT
    if not p.is_file():
        raise ConfigError(f"no checkpoint at {p} (train with --out DIR first)")
    try:
        ckpt = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unpickling problem is a bad file
        raise ConfigError(f"{p} is truncated or corrupted, or not a clipbias checkpoint ({type(exc).__name__}: "
                          f"{exc}); it cannot be resumed or exported: start the run again with --overwrite") from exc
    if not isinstance(ckpt, dict) or "model" not in ckpt or "engine" not in ckpt:
        raise ConfigError(f"{p} is not a clipbias checkpoint (no model/engine state)")
    return ckpt


def export_weights(run_dir: str | os.PathLike, file: str | os.PathLike) -> dict:
    """Write the releasable artefact of a run: the model weights only (plus public metadata).

    Never the engine state: the DiceSGD error-feedback buffer ``e``, the optimizer state and RNG
    states stay in the private checkpoint. Returns what was written (minus the tensors).
    """
    ckpt = load_checkpoint(run_dir)
    cfg = ckpt.get("config", {})
    last = (ckpt.get("history") or [{}])[-1]
    weights = {k: v.detach().cpu().clone() for k, v in ckpt["model"].items()}
    meta = {"model": cfg.get("model"), "data": cfg.get("data"), "algo": cfg.get("algo"),
            "input_shape": ckpt.get("input_shape"), "num_classes": ckpt.get("num_classes"),
            "epochs_trained": ckpt.get("epoch"), "steps": last.get("steps"),
            "epsilon": last.get("epsilon"), "delta": cfg.get("delta"),
            "accountant": last.get("accountant"), "certified": last.get("certified"),
            "basis": last.get("basis")}
    if cfg.get("dice_accounting") in privacy.dice.RENAMED and cfg.get("algo") in algorithms.ALGORITHMS and \
            algorithms.get(cfg["algo"]).accounting == "dice":
        # a run from before the refutation: its "certified" DiceSGD epsilon is the paper's bound
        meta.update(certified=False, basis=f"{meta['basis']}; {privacy.dice.REFUTED.format(basis='paper')}")
    out = {"state_dict": weights, "meta": jsonable(meta)}
    file = Path(file)
    atomic_write(file, lambda fh: torch.save(out, fh))
    return {"file": str(file), "tensors": len(weights), **out["meta"]}



# ----------------------------------------------------------------------------- JSON helpers

def jsonable(obj: Any) -> Any:
    """inf/nan -> strings (JSON has no infinity; epsilon = inf must never read as a number)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf" if obj > 0 else ("-inf" if obj < 0 else "nan")
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_json(data: dict, path: str | os.PathLike) -> None:
    text = (json.dumps(jsonable(data), indent=2) + "\n").encode()
    atomic_write(Path(path), lambda fh: fh.write(text))


# ----------------------------------------------------------------------------- the loop

def _resume_check(saved: dict, cfg: TrainConfig) -> None:
    now = cfg.to_dict()
    for key, value in now.items():
        if key in _RESUME_FREE:
            continue
        old = saved.get(key)
        if old != value and not (isinstance(old, (int, float)) and isinstance(value, (int, float))
                                 and math.isclose(old, value, rel_tol=1e-12)):
            if key == "extra":
                keys = {*(old or {}), *(value or {})}
                flag = "method flags (" + ", ".join(sorted(EXTRA_FLAGS.get(k, k) for k in keys)) + ")"
            else:
                flag = "--" + key.replace("_", "-")
            raise ResumeMismatchError(
                f"cannot resume: {flag} changed (checkpoint {old!r}, now {value!r}). Resume with the "
                f"original setting, or start a new run (another --out, or --overwrite).")


def train(config: TrainConfig, **kwargs: Any) -> dict:
    """Run one training configuration; returns the results dict (also written to ``out``).

    Keyword arguments: ``splits`` (from :func:`prepare_splits`) or ``dataset`` avoid reloading the
    data. ``on_start`` gets the header dict (dataset, N, q, B, steps, noise multiplier, privacy basis,
    ...) before the first step; ``on_epoch_end`` gets each epoch's record after the checkpoint is
    written (raising from it interrupts the run, which ``resume=True`` continues). ``progress`` shows
    a tqdm bar; ``checkpoint`` and ``plot`` (default True) write ``checkpoint.pt`` and ``curves.png``.
    ``out`` is locked for the run: a second run on the same directory is refused.
    """
    config.validate()
    if not config.out:
        return _train(config, **kwargs)
    check_out_dir(Path(config.out))
    with run_lock(Path(config.out)):
        return _train(config, **kwargs)


def _train(config: TrainConfig, *, dataset: Dataset | None = None, splits: Splits | None = None,
           progress: bool = False, on_start: Callable[[dict], None] | None = None,
           on_epoch_end: Callable[[dict], None] | None = None, checkpoint: bool = True,
           plot: bool = True) -> dict:
    t_start = time.perf_counter()
    cfg = config.validate()
    out = Path(cfg.out) if cfg.out else None
    ckpt = None
    if out is not None:
        ck_path = out / CHECKPOINT
        if cfg.resume:
            if not ck_path.is_file():
                raise ConfigError(f"--resume: no checkpoint at {ck_path}; start the run without --resume")
            ckpt = load_checkpoint(ck_path)
            _resume_check(ckpt.get("config", {}), cfg)
        elif ck_path.exists() and not cfg.overwrite:
            raise ConfigError(f"--out {out} already holds a checkpoint; continue it with --resume, "
                              f"or replace it with --overwrite")
        elif (out / RESULTS).exists() and not cfg.overwrite:
            raise ConfigError(f"--out {out} already holds a finished run's {RESULTS} (no checkpoint to resume); "
                              f"choose another --out, or replace it with --overwrite")
    elif cfg.resume:
        raise ConfigError("--resume needs --out DIR (the run directory to continue)")

    if splits is None:
        splits = prepare_splits(cfg, dataset)
    else:
        if splits.info.get("model_key") != _model_key(cfg.model):
            raise ConfigError(f"the prepared data are for {splits.info.get('model_key')} models, not "
                              f"--model {cfg.model}; prepare them with prepare_splits for this model")
        for key in ("subset", "validation", "public_size"):
            want = cfg.extra.get(key) if key == "public_size" else getattr(cfg, key)
            if splits.info.get(key) != (want or (0 if key == "validation" else None)):
                raise ConfigError(f"the prepared data have {key}={splits.info.get(key)!r} but the run asks "
                                  f"for --{key.replace('_', '-')} {want!r}; prepare them for this config")
    dev = _device(cfg.device)
    n = splits.n
    if cfg.batch_size > n:
        raise ConfigError(f"--batch-size must lie in (0, N={n}], got {cfg.batch_size:g}")
    if cfg.validation and splits.x_val is None:
        raise ConfigError("--validation: the prepared data hold no validation split")

    torch.manual_seed(cfg.seed)
    model = _build_model(cfg, tuple(splits.info["input_shape"]), splits.info["num_classes"]).to(dev)
    algo = algorithms.get(cfg.algo)
    algo_cfg = cfg.algo_config()
    predict = None
    if algo.needs_public:  # BatchClipping (Xiao et al. Alg. 3): BatchNorm net, public features
        from .algorithms import batchclip_predict, batchnorm_variant
        if splits.public_x is None:
            raise ConfigError(f"--algo {cfg.algo} needs --public-size (public features)")
        model = batchnorm_variant(model)
        algo_cfg = dataclasses.replace(algo_cfg, extra={**cfg.extra, "public": splits.public_x})
        st = algo.settings(algo_cfg)

        def predict(m: nn.Module, x: Tensor) -> Tensor:  # majority vote over public draws (App. E)
            return batchclip_predict(m, x, splits.public_x, st["p"], st["draws"], seed=cfg.seed)
    engine = DPEngine(model, cfg.algo, n=n, batch_size=cfg.batch_size, epochs=cfg.epochs,
                      epsilon=cfg.epsilon if algo.private else None,
                      noise_multiplier=cfg.noise_multiplier if algo.private else None,
                      delta=cfg.delta, accountant=cfg.accountant, dice_accounting=cfg.dice_accounting,
                      config=algo_cfg, max_physical_batch=cfg.max_physical_batch,
                      noise_seed=cfg.seed if cfg.reproducible_noise else None)
    steps_per_epoch = len(engine.sampler)

    history: list[dict] = []
    start_epoch, prior_time = 0, 0.0
    if ckpt is not None:
        engine.load_state_dict(ckpt["engine"])  # ResumeMismatchError if privacy settings changed
        model.load_state_dict(ckpt["model"])
        torch.set_rng_state(ckpt["torch_rng"])
        if dev.type == "cuda" and ckpt.get("cuda_rng") is not None:
            torch.cuda.set_rng_state(ckpt["cuda_rng"], dev)
        history = list(ckpt["history"])
        start_epoch = int(ckpt["epoch"])
        prior_time = float(ckpt.get("wall_time_s", 0.0))

    projected = engine.privacy(engine.total_steps)
    header = {
        "dataset": splits.info["name"], "N": n, "q": engine.sample_rate, "B": engine.expected_batch_size,
        "steps": engine.total_steps, "steps_per_epoch": steps_per_epoch, "epochs": cfg.epochs,
        "model": cfg.model, "params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "algo": cfg.algo, "private": algo.private, "noise_multiplier": engine.noise_multiplier,
        "target_epsilon": cfg.epsilon if algo.private else math.inf, "delta": cfg.delta,
        "epsilon_at_end": projected.epsilon, "accountant": projected.accountant,
        "basis": projected.basis, "certified": projected.certified,
        "warning": privacy.delta_warning(cfg.delta, n) if algo.private else None,
        "preprocessing_private": splits.info["preprocessing_private"],
        "reproducible_noise": cfg.reproducible_noise,
        "resumed_at_epoch": start_epoch if ckpt is not None else None, "device": str(dev),
    }
    if algo.accounting == "dice" and engine.spec.dice is not None:
        header["ef_ratio_r"] = engine.spec.dice.ratio
        header["ef_clip"] = engine.spec.dice.ef_clip
    if on_start is not None:
        on_start(header)

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=engine.total_steps, initial=engine.steps_taken, unit="step", mininterval=1.0,
                   desc=f"{cfg.algo}", dynamic_ncols=True, leave=True)
    last_acc = history[-1]["test_accuracy"] if history else None
    last_eps = history[-1]["epsilon"] if history else None
    try:
        for epoch in range(start_epoch, cfg.epochs):
            t0 = time.perf_counter()
            total, count = 0.0, 0
            for _ in range(steps_per_epoch):
                if engine.steps_taken >= engine.total_steps:
                    break
                idx = engine.sampler.sample()
                idx_dev = idx.to(dev) if dev.type != "cpu" else idx
                losses = engine.step(splits.x_train[idx_dev], splits.y_train[idx_dev], idx)
                total, count = total + float(losses.sum()), count + len(losses)
                if bar is not None:
                    bar.update(1)
                    post = {"ep": f"{epoch + 1}/{cfg.epochs}",
                            "loss": f"{float(losses.mean()):.3f}" if len(losses) else "-"}
                    if last_acc is not None:
                        post["test_acc"] = f"{last_acc:.4f}"
                    if last_eps is not None:
                        post["eps"] = "inf" if math.isinf(last_eps) else f"{last_eps:.3f}"
                    bar.set_postfix(post, refresh=False)
            train_time = time.perf_counter() - t0
            t1 = time.perf_counter()
            acc, test_loss = evaluate(model, splits.x_test, splits.y_test, cfg.eval_batch_size, predict)
            rec = {"epoch": epoch + 1, "steps": engine.steps_taken,
                   "train_loss": total / max(count, 1), "test_accuracy": acc, "test_loss": test_loss}
            if splits.x_val is not None:
                rec["val_accuracy"], rec["val_loss"] = evaluate(model, splits.x_val, splits.y_val,
                                                                cfg.eval_batch_size, predict)
            rep = engine.privacy()
            rec.update(epsilon=rep.epsilon, accountant=rep.accountant, certified=rep.certified,
                       basis=rep.basis)
            rec["epoch_time_s"], rec["eval_time_s"] = train_time, time.perf_counter() - t1
            history.append(rec)
            if _diverged(rec, engine.params):  # fail loudly: never report an accuracy of a broken model
                if out is not None:
                    write_json({"config": cfg.to_dict(), "diverged": True, "history": history,
                                "epsilon": rep.epsilon, "delta": rep.delta, "basis": rep.basis,
                                "certified": rep.certified, "steps": engine.steps_taken}, out / RESULTS)
                raise TrainingDivergedError(
                    f"training diverged in epoch {epoch + 1} (training loss {rec['train_loss']:.3g}, test loss "
                    f"{rec['test_loss']}): the model is unusable. Lower --lr (now {cfg.lr:g}) and start again"
                    + (f" with --overwrite; {out / RESULTS} records the diverged run" if out is not None else ""))
            last_acc, last_eps = acc, rep.epsilon
            if bar is not None:
                bar.set_postfix({"ep": f"{epoch + 1}/{cfg.epochs}", "loss": f"{rec['train_loss']:.3f}",
                                 "test_acc": f"{acc:.4f}",
                                 "eps": "inf" if math.isinf(rep.epsilon) else f"{rep.epsilon:.3f}"})
            if out is not None and checkpoint:
                _atomic_private_save({
                    "PRIVATE": PRIVATE_NOTE, "format": CHECKPOINT_FORMAT, "epoch": epoch + 1,
                    "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                    "engine": _to_cpu(engine.state_dict()), "torch_rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None,
                    "history": history, "config": cfg.to_dict(),
                    "input_shape": list(splits.info["input_shape"]),
                    "num_classes": splits.info["num_classes"],
                    "wall_time_s": prior_time + time.perf_counter() - t_start,
                }, out / CHECKPOINT)
            if on_epoch_end is not None:
                on_epoch_end(rec)
    finally:
        if bar is not None:
            bar.close()

    final = engine.privacy()
    wall = prior_time + time.perf_counter() - t_start
    epoch_times = [h["epoch_time_s"] for h in history]
    results = {
        "config": cfg.to_dict(),
        "dataset": splits.info,
        "model": {"name": cfg.model, "params": header["params"]},
        "algorithm": {"name": cfg.algo, "description": algo.description, "private": algo.private},
        "n": n, "sample_rate": engine.sample_rate, "batch_size": engine.expected_batch_size,
        "steps": engine.steps_taken, "planned_steps": engine.total_steps,
        "noise_multiplier": engine.noise_multiplier,
        "target_epsilon": cfg.epsilon if algo.private else math.inf,
        "epsilon": final.epsilon, "delta": final.delta, "accountant": final.accountant,
        "basis": final.basis, "certified": final.certified,
        "privacy_note": privacy_note(cfg, final.certified, algo.private, splits.info),
        **({"ef_ratio_r": header["ef_ratio_r"]} if "ef_ratio_r" in header else {}),
        "delta_warning": header["warning"],
        "test_accuracy": history[-1]["test_accuracy"] if history else None,
        "val_accuracy": history[-1].get("val_accuracy") if history else None,
        "train_loss": history[-1]["train_loss"] if history else None,
        "history": history,
        "wall_time_s": wall,
        "wall_time_per_epoch_s": sum(epoch_times) / len(epoch_times) if epoch_times else None,
        "resumed": ckpt is not None,
    }
    if out is not None:
        write_json(results, out / RESULTS)
        if plot:
            from .plots import plot_curves
            plot_curves({cfg.algo: [history]}, out / CURVES,
                        title=f"{cfg.data} / {cfg.model} / {_eps_label(results)}")
    return results


def _diverged(rec: dict, params: list[Tensor]) -> bool:
    """An infinite/NaN training or test loss, or a non-finite weight."""
    losses = [rec["train_loss"], rec.get("test_loss")]
    if any(v is not None and not math.isfinite(v) for v in losses):
        return True
    return not all(bool(torch.isfinite(p).all()) for p in params)


def _eps_label(res: dict) -> str:
    eps = res["epsilon"]
    return "non-private" if math.isinf(eps) else f"epsilon={eps:.3g}, delta={res['delta']:g}"


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------- several runs

def privacy_note(cfg: TrainConfig, certified: bool, private: bool, info: dict) -> str | None:
    """What the guarantee does not cover, in words (``None`` when nothing needs saying)."""
    notes = []
    if not private:
        notes.append("non-private: no DP guarantee")
    elif not certified:
        notes.append(f"NOT a guarantee: DiceSGD's '{cfg.dice_accounting}' bound is refuted by a canary attack "
                     f"(docs/privacy.md); for reproducing the paper only")
    if private and cfg.reproducible_noise:
        notes.append(f"reproducible noise: batches and noise are derived from --seed {cfg.seed}, which this "
                     "file records; the guarantee holds only while the seed is secret (do not publish this "
                     "file with the model)")
    if private and info.get("preprocessing_private") is False:
        notes.append("data standardised with statistics of the private training split (not accounted)")
    return "; ".join(notes) or None


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
        raise ConfigError("--seeds: give at least one seed")
    for s in seeds:
        _check_int(s, "--seeds", 0)
    labels = [label for label, _ in variants]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"--algos: each algorithm may appear once, got {' '.join(labels)}")
    cfgs = {label: dataclasses.replace(base, **ov, resume=False).validate() for label, ov in variants}
    if splits is None:
        splits = prepare_splits(next(iter(cfgs.values())))
    runs: dict[str, list[dict]] = {}
    for label, cfg in cfgs.items():
        runs[label] = []
        for seed in seeds:
            run_out = None if out is None else str(Path(out) / f"{_safe(label)}-s{seed}")
            c = dataclasses.replace(cfg, seed=seed, out=run_out, overwrite=True)
            res = train(c, splits=splits, progress=progress, checkpoint=False, plot=False,
                        on_start=(lambda h, lab=label, s=seed: on_start(lab, s, h)) if on_start else None)
            res["label"] = label
            runs[label].append(res)
            if on_run is not None:
                on_run(label, seed, res)
    return {"runs": runs, "summary": summarize(runs)}


def _safe(label: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)


def _mean_std(xs: list[float]) -> tuple[float, float]:
    m = sum(xs) / len(xs)
    s = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1)) if len(xs) > 1 else 0.0
    return m, s


def summarize(runs: dict[str, list[dict]]) -> list[dict]:
    """One row per label: mean/std test (and val) accuracy over seeds, epsilon, certified, z, time."""
    rows = []
    for label, rs in runs.items():
        acc_m, acc_s = _mean_std([r["test_accuracy"] for r in rs])
        eps = [r["epsilon"] for r in rs]
        row = {"label": label, "algo": rs[0]["config"]["algo"], "seeds": [r["config"]["seed"] for r in rs],
               "test_accuracy_mean": acc_m, "test_accuracy_std": acc_s,
               "test_accuracies": [r["test_accuracy"] for r in rs],
               "epsilon": max(eps), "epsilon_per_seed": eps, "delta": rs[0]["delta"],
               "accountant": rs[0]["accountant"], "certified": all(r["certified"] for r in rs),
               "basis": rs[0]["basis"], "noise_multiplier": rs[0]["noise_multiplier"],
               "dice_accounting": rs[0]["config"]["dice_accounting"] if rs[0]["basis"].startswith("DiceSGD") else None,
               "ef_clip": rs[0]["config"]["ef_clip"], "lr": rs[0]["config"]["lr"],
               "wall_time_per_epoch_s": _mean_std([r["wall_time_per_epoch_s"] for r in rs])[0],
               "wall_time_s": sum(r["wall_time_s"] for r in rs)}
        if rs[0].get("val_accuracy") is not None:
            row["val_accuracy_mean"], row["val_accuracy_std"] = _mean_std([r["val_accuracy"] for r in rs])
        rows.append(row)
    return rows
