"""``clipbias train``: one private (or non-private) training run with checkpoints and a report."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from pathlib import Path

from typing import TYPE_CHECKING

from ..errors import ConfigError
from ._choices import current
from ._common import emit, exit_code, tune_allocator, warn

if TYPE_CHECKING:
    from ..run.training import TrainConfig

REFUTED = "false  (NOT a guarantee: a DiceSGD bound refuted by a canary attack; reproduction only)"
PREPROCESSING = {"public": "public constants or fixed transforms only",
                 "none": "none (arrays used as given; what made them is outside the guarantee)",
                 "private-statistics": "statistics of the private training split: NOT covered by the guarantee"}


def add_training_flags(p: argparse.ArgumentParser, *, algo: bool = True, defaults: dict | None = None) -> None:
    """The flags shared by ``train`` and ``compare`` (``compare`` takes ``--algos`` instead)."""
    choices = current()
    DATASET_NAMES, MODEL_NAMES = choices["datasets"], choices["models"]
    d = {"data": None, "model": None, "epsilon": None, "delta": None, "epochs": None,
         "batch_size": None, "lr": None, "clip": 1.0, **(defaults or {})}
    req = {k: d[k] is None for k in d}
    p.add_argument("--data", choices=DATASET_NAMES, default=d["data"], required=req["data"],
                   help="data set: Fashion-MNIST from the Debian package, a scikit-learn set, cifar10 (from "
                        "--data-dir) or npz (your own arrays, --data-path)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="where the data live: cifar10 reads DIR/cifar-10-batches-py/ (the python version, "
                        "extracted; nothing is downloaded); fashion-mnist overrides the Debian package's folder")
    p.add_argument("--data-path", default=None, metavar="FILE",
                   help="--data npz: a .npz file with arrays x_train, y_train, x_test, y_test (integer labels "
                        "0..K-1; optional num_classes), used as given")
    p.add_argument("--model", choices=MODEL_NAMES, default=d["model"], required=req["model"],
                   metavar="NAME", help=f"model: {', '.join(MODEL_NAMES)}")
    if algo:
        names = choices["algorithms"]
        p.add_argument("--algo", choices=names, required=True, metavar="NAME",
                       help=f"algorithm: {', '.join(names)}")
        p.add_argument("--kalman", action="store_true",
                       help="add DiSK's Kalman filter (Zhang et al. 2025; --kappa, --disk-gamma) to --algo: "
                            "runs NAME+disk, with NAME's accounting; --algo disk is dpsgd with it")
    _add_privacy_flags(p, d)
    _add_training_group(p, d, req)


def _add_privacy_flags(p: argparse.ArgumentParser, d: dict) -> None:
    c = current()
    ACCOUNTANTS, DICE_ACCOUNTING, DEFAULT_DICE_ACCOUNTING = c["accountants"], c["dice_accounting"], \
        c["default_dice_accounting"]
    g = p.add_argument_group("privacy")
    g.add_argument("--epsilon", type=float, default=d["epsilon"], metavar="E",
                   help="target epsilon; the noise multiplier is calibrated to reach at most E after "
                        "all steps (ignored by non-private algorithms, which report epsilon = inf)")
    g.add_argument("--noise-multiplier", type=float, default=None, metavar="Z",
                   help="use this noise multiplier instead of calibrating one from --epsilon")
    g.add_argument("--delta", type=float, default=d["delta"] if d["delta"] is not None else 1e-5,
                   metavar="D", help="target delta (default 1e-5; keep it well below 1/N)")
    g.add_argument("--accountant", choices=ACCOUNTANTS, default="pld",
                   help=f"{', '.join(ACCOUNTANTS)} (default: pld, the tightest)")
    g.add_argument("--dice-accounting", choices=DICE_ACCOUNTING, default=DEFAULT_DICE_ACCOUNTING,
                   help="DiceSGD (error feedback) basis: sound (default; proven, docs/privacy.md), "
                        "conservative (proven, looser), paper (the paper's Thm 3.8) and authors (the "
                        "authors' protocol): both REFUTED by a canary attack, certified = false, for "
                        "reproducing the paper only")
    g.add_argument("--bands", type=int, default=1, metavar="b",
                   help="banded correlated noise (Choquette-Choo et al. 2023): each example joins only one step in "
                        "b (its class, drawn once), with probability b*q, and the noise of an update is correlated "
                        "with the b-1 before it so that accumulated updates carry less of it; accounted as the "
                        "subsampled Gaussian at rate b*q for ceil(T/b) steps (docs/privacy.md). Needs b*q <= 1; "
                        f"{', '.join(c['bandable'])} (and each with --kalman). Default 1: independent noise")
    g.add_argument("--bands-strategy", choices=c["bands_strategies"], default=c["default_bands_strategy"],
                   help="the coefficients of --bands: taylor (default; the truncated square root of the momentum "
                        "workload) or optimized (the banded Toeplitz strategy of least total squared error of the "
                        "iterates for this run's steps and momentum, computed in well under a second and cached; "
                        "docs/privacy.md, \"Banded noise\"), with the same privacy guarantee; or blt: buffered "
                        "linear Toeplitz noise whose correlation spans the whole run, with --bands b participation "
                        "classes (use b = floor(1/q): every example in one step per epoch) and no amplification by "
                        "sampling (the Gaussian mechanism at the strategy's sensitivity over the run; docs/privacy.md, "
                        "\"BLT noise\")")
    g.add_argument("--reproducible-noise", nargs="?", const=True, default=False, type=noise_seed, metavar="SEED",
                   help="derive the secret key of the Poisson batches, the Gaussian noise and the keyed draws from "
                        "SEED (an integer below 2^256, decimal or 0x-hex; all its bits are used), or from --seed "
                        "when SEED is omitted: reproducible runs for tests and benchmarks. Such a run is reported "
                        "certified: false (its guarantee holds only while the seed stays secret and unguessable). "
                        "Default: a 256-bit key from the OS CSPRNG, kept only in the private checkpoint")


def _add_training_group(p: argparse.ArgumentParser, d: dict, req: dict) -> None:
    DEFAULT_EF_RATIO = current()["default_ef_ratio"]
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=int, default=d["epochs"], required=req["epochs"], metavar="K",
                   help="passes over the data: K * round(N/B) Poisson steps, all accounted"
                        + (f" (default {d['epochs']})" if d["epochs"] is not None else ""))
    t.add_argument("--batch-size", type=float, default=d["batch_size"], required=req["batch_size"],
                   metavar="B", help="expected Poisson batch size B (sampling rate q = B/N)")
    t.add_argument("--lr", type=float, default=d["lr"], required=req["lr"], metavar="LR",
                   help="learning rate of the base optimizer" + (f" (default {d['lr']:g})" if d["lr"] is not None else ""))
    t.add_argument("--clip", type=float, default=d["clip"], metavar="C1",
                   help="per-example clipping norm C1 (default 1)")
    t.add_argument("--ef-clip", type=float, default=None, metavar="C2",
                   help=f"DiceSGD feedback clip C2 on the average-gradient scale (default "
                        f"{DEFAULT_EF_RATIO:g} * C1 / B, i.e. feedback ratio r = B*C2/C1 = {DEFAULT_EF_RATIO:g}: "
                        f"the sound privacy cost of feedback grows with r)")
    t.add_argument("--grad-bound", type=float, default=None, metavar="GMAX",
                   help="outer clip of every per-example gradient (DiceSGD: G' = GMAX - C1)")
    t.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default=None,
                   help="base optimizer (default: the algorithm's own)")
    t.add_argument("--momentum", type=float, default=0.0, metavar="M",
                   help="heavy-ball momentum of the base SGD optimizer, applied to the noisy update "
                        "(post-processing: no privacy cost; default 0)")
    t.add_argument("--weight-decay", type=float, default=0.0, metavar="WD",
                   help="weight decay of the base optimizer (default 0)")
    t.add_argument("--gamma", type=float, default=0.01,
                   help="normalisation stability constant gamma of the normalising algorithms (e.g. normalized, "
                        "dice-auto)")
    t.add_argument("--max-physical-batch", type=int, default=512, metavar="M",
                   help="micro-batch size for per-example gradients (memory only; math unchanged)")
    t.add_argument("--ema", type=float, default=None, metavar="DECAY",
                   help="also keep an exponential moving average of the weights, a = DECAY a + (1 - DECAY) w after "
                        "every step (De et al. 2022; post-processing: no privacy cost), evaluated, reported and "
                        "exported beside the raw weights (e.g. 0.9 for about 100 steps)")
    t.add_argument("--validation", type=int, default=0, metavar="K",
                   help="carve a validation part out of the training split and report val accuracy (tune on it, "
                        "never on the test set): each training example joins it with probability K/N by a keyed "
                        "draw under the run's secret key, so K is the expected size; the realised sizes are private "
                        "(listed outside the guarantee). Not stratified")
    t.add_argument("--subset", type=int, default=None, metavar="K",
                   help="the private data set is the first K training examples (quick runs): it defines the data, "
                        "so K is public and the accounting uses N = K")
    t.add_argument("--grad-path", choices=("rows", "fast", "auto"), default="auto",
                   help="rows: per-example gradients by torch.func, every algorithm; fast: per-layer norms and "
                        "book-keeping sums, no [B, d] matrix (norm-scaling algorithms, e.g. dpsgd, normalized, the "
                        "dice family; Linear, Conv1d/2d, Embedding, GroupNorm, LayerNorm), refused where it does not "
                        "apply; auto (default): fast where it applies and one micro-batch of rows would exceed "
                        "1 GiB, else rows (faster on CPU for small models). The fast path's per-example "
                        "sensitivity rests on run-time checks of the model's structure (docs/results.md), not on "
                        "a proof; the header says which path ran")
    t.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where the model, data and per-example gradients live (default cpu; cuda refused with a "
                        "clear error when no GPU is visible)")
    t.add_argument("--threads", type=int, default=None, metavar="N",
                   help="CPU threads for torch (default: the cores this process may use; 0 = torch's "
                        "default)")
    m = p.add_argument_group("method-specific (AlgoConfig.extra, set only when given; see docs/methods.md)")
    add_method_flags(m)
    m.add_argument("--public-source", choices=("test", "holdout"), default="test",
                   help=f"{', '.join(current()['public'])}: public features from the test split (removed from evaluation; "
                        "default) or held out of the training split (about --public-size examples by keyed draws; "
                        "N shrinks; they are private data the guarantee does not protect: the run is reported "
                        "NOT certified)")


def add_method_flags(group) -> None:
    """One flag per method ``Setting`` of the registered algorithms (a new method's settings appear
    here without a line of CLI code); each defaults to None, i.e. the method's own default."""
    for s in current()["settings"]:
        if not s["cli"]:
            continue
        default = "unset" if s["default"] is None else repr(s["default"])
        text = f"{s['help']} (--algo {', '.join(s['users'])}; default {default})"
        if s["switch"]:
            group.add_argument(s["flag"].split("/")[0], dest=s["dest"], action=argparse.BooleanOptionalAction,
                               default=None, help=text)
        else:
            group.add_argument(s["flag"], dest=s["dest"], type=float if s["type"] == "float" else int, default=None,
                               metavar=s["dest"].upper(), help=text)


def method_settings(args: argparse.Namespace) -> dict:
    """``AlgoConfig.extra`` from the method flags given (canonical setting keys)."""
    return {s["key"]: getattr(args, s["dest"]) for s in current()["settings"]
            if s["cli"] and getattr(args, s["dest"], None) is not None}


def config_from_args(args: argparse.Namespace, **overrides) -> TrainConfig:
    from ..run.training import TrainConfig
    extra = method_settings(args)
    algo = getattr(args, "algo", "dpsgd")
    if getattr(args, "kalman", False):
        from .. import algorithms
        algo = algorithms.kalman_name(algo)
    kw = dict(data=args.data, model=args.model, algo=algo, epsilon=args.epsilon,
              delta=args.delta, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, clip=args.clip,
              ef_clip=args.ef_clip, grad_bound=args.grad_bound, accountant=args.accountant,
              dice_accounting=args.dice_accounting, noise_multiplier=args.noise_multiplier,
              seed=getattr(args, "seed", 0), reproducible_noise=getattr(args, "reproducible_noise", False) is not False,
              noise_seed=_given_seed(getattr(args, "reproducible_noise", False)),
              device=args.device, optimizer=args.optimizer,
              momentum=args.momentum, weight_decay=args.weight_decay, gamma=args.gamma,
              max_physical_batch=args.max_physical_batch, grad_path=args.grad_path, validation=args.validation,
              subset=args.subset, data_dir=args.data_dir, data_path=args.data_path,
              public_source=args.public_source, extra=extra, ema=getattr(args, "ema", None),
              bands=getattr(args, "bands", 1), bands_strategy=getattr(args, "bands_strategy", TrainConfig.bands_strategy))
    kw.update(overrides)
    return TrainConfig(**kw)


def _given_seed(flag: bool | int) -> int | None:
    """The SEED of ``--reproducible-noise SEED`` (None: the flag alone, or absent)."""
    return None if isinstance(flag, bool) else flag


def fmt_eps(eps: float) -> str:
    return "inf" if math.isinf(eps) else f"{eps:.4g}"


def noise_seed(text: str) -> int:
    """``--reproducible-noise SEED``: an integer in [0, 2^256), decimal or 0x-hex."""
    from ..randomness.key import check_seed
    try:
        return check_seed(int(text, 0))
    except (ValueError, ConfigError):
        raise argparse.ArgumentTypeError(f"SEED must be an integer in [0, 2^256) (decimal or 0x-hex), got {text!r}")


def fmt_certified(certified: bool, private: bool, caveats: list[str] | tuple = ()) -> str:
    if certified:
        return "true"
    if not private:
        return "false  (non-private: no DP guarantee)"
    if caveats:
        return "false  (" + "; ".join(caveats) + ")"
    return REFUTED


def print_header(h: dict, stream=None) -> None:
    stream = stream or sys.stdout
    private = h["private"]
    if h.get("warning"):
        warn(h["warning"])
    warn(h.get("noise_floor"))
    rows = {
        "dataset": f"{h['dataset']} (N={h['N']}, preprocessing: {PREPROCESSING[h['preprocessing']]})",
        "model": f"{h['model']} ({h['params']:,} parameters)",
        "algo": h["algo"],
        "N": h["N"] if h.get("N_given", h["N"]) == h["N"] else
        f"{h['N']} (the training part of the {h['N_given']} given, by keyed draws: its size is private)",
        "q": f"{h['q']:.6g}",
        "B": f"{h['B']:g} (expected Poisson batch size)",
        "steps": f"{h['steps']} ({h['epochs']} epochs x {h['steps_per_epoch']})",
        "noise multiplier": f"{h['noise_multiplier']:.6g}" if private else "0 (non-private)",
        "target epsilon": ("inf (non-private)" if not private else
                           "none (noise multiplier given)" if h["target_epsilon"] is None
                           else fmt_eps(h["target_epsilon"])),
        "delta": f"{h['delta']:g}",
        "epsilon at end": fmt_eps(h["epsilon_at_end"]),
        "accountant": h["accountant"],
        "basis": h["basis"],
        "certified": fmt_certified(h["certified"], private, h.get("caveats", ())),
    }
    if private:
        rows["batches and noise"] = ("ChaCha20 under a key derived from a seed (--reproducible-noise): not certified"
                                     if h.get("reproducible_noise") else
                                     "ChaCha20 under a 256-bit key from the OS CSPRNG, kept only in the private checkpoint")
        rows["outside the guarantee"] = "; ".join(h.get("outside_guarantee", [])) or "nothing"
    if h.get("ef_ratio_r") is not None:
        r = h["ef_ratio_r"]
        rows["feedback ratio r"] = (f"{r:.4g} (r = B*C2/C1 with C2 = {h['ef_clip']:.4g}; the sound noise "
                                    f"grows with r: each step pays for a 2r shift, sampled or not)")
    if h.get("gradients"):
        rows["gradients"] = h["gradients"]
    if h.get("world_size", 1) > 1:
        rows["processes"] = (f"{h['world_size']} (torch.distributed: one global Poisson sample per step, each "
                             f"process its share, one all-reduce, the noise added once; same accounting)")
    if h.get("resumed_at_epoch") is not None:
        rows["resumed"] = f"from the checkpoint after epoch {h['resumed_at_epoch']}"
    emit(rows, False, stream)
    stream.flush()


def set_threads(n: int | None) -> None:
    """``--threads`` (None: the cores this process may use, divided among the processes torchrun
    started on this machine; 0: torch's default) and the allocator tuning of ``tune_allocator``."""
    if n is None:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n = max(1, n // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))
    if n < 0:
        raise ConfigError(f"--threads must be >= 0 (0 = torch's default), got {n}")
    import torch
    if n > 0:
        torch.set_num_threads(n)
    tune_allocator()


def _run(args: argparse.Namespace) -> int:
    """``clipbias train``; under torchrun (``WORLD_SIZE`` > 1) inside a process group it sets up
    itself (gloo on the CPU, nccl on CUDA), where rank 0 alone prints and writes."""
    from .. import distributed
    from ..files import remove_if_empty
    from ..run.training import default_out
    set_threads(args.threads)
    cfg = config_from_args(args, resume=args.resume, overwrite=args.overwrite)
    if args.resume and not args.out:
        raise ConfigError("--resume needs --out DIR: the run directory to continue (without --out every run "
                          "gets a new directory, printed at its start and end)")
    own_group, finished = distributed.init_from_env(cfg.device), False
    try:
        cfg = dataclasses.replace(cfg, out=args.out or distributed.from_rank0(lambda: default_out(cfg)))  # one new directory, every rank
        if distributed.context()[0] == 0:
            print(f"run directory: {cfg.out}", file=sys.stderr if args.json else sys.stdout, flush=True)
        try:
            code = _train_and_report(args, cfg)
            finished = code == 0  # not an interrupted run (whose ranks may stop at different points)
            return code
        finally:
            if not args.out and distributed.context()[0] == 0:
                remove_if_empty(cfg.out)  # a refused run leaves no empty directory behind
    finally:
        if own_group:
            import torch.distributed as dist
            if finished:  # leave together: a rank tearing gloo down while another still uses it can abort
                dist.barrier()
            dist.destroy_process_group()


def _train_and_report(args: argparse.Namespace, cfg: TrainConfig) -> int:
    from .. import distributed
    from ..run.training import CHECKPOINT, CURVES, RESULTS, train
    out_stream = sys.stderr if args.json else sys.stdout
    try:
        res = train(cfg, progress=not args.quiet, on_start=lambda h: print_header(h, out_stream),
                    on_engine=lambda engine: tune_allocator(engine.fast is None))  # rows path: keep memory
    except KeyboardInterrupt as e:
        what = "terminated (SIGTERM)" if exit_code(e) == 143 else "interrupted"
        if (Path(cfg.out) / CHECKPOINT).is_file():
            print(f"{what}; the last epoch-end checkpoint is in {cfg.out}/{CHECKPOINT}. Continue with "
                  f"the same command plus {'' if args.out else f'--out {cfg.out} '}--resume.", file=sys.stderr)
        else:
            print(f"{what} before the first epoch ended: no checkpoint was written in {cfg.out}; start the run "
                  f"again (nothing to resume).", file=sys.stderr)
        return exit_code(e)
    if distributed.context()[0] != 0:  # rank 0 reports
        return 0
    if args.json:
        emit(res, True)
        return 0
    private = res["algorithm"]["private"]
    summary = {
        "test accuracy": f"{res['test_accuracy']:.4f}",
        **({"val accuracy": f"{res['val_accuracy']:.4f}"} if res.get("val_accuracy") is not None else {}),
        **({f"EMA test accuracy (decay {res['ema']:g})": f"{res['ema_test_accuracy']:.4f}"}
           if res.get("ema_test_accuracy") is not None else {}),
        "epsilon": fmt_eps(res["epsilon"]),
        "delta": f"{res['delta']:g}",
        "accountant": res["accountant"],
        "certified": fmt_certified(res["certified"], private, res.get("caveats", ())),
        "noise multiplier": f"{res['noise_multiplier']:.6g}",
        "wall time": f"{res['wall_time_s']:.1f} s ({res['wall_time_per_epoch_s']:.1f} s/epoch training)",
        "results": ", ".join(f"{cfg.out}/{f}" for f in (RESULTS, CURVES) if (Path(cfg.out) / f).exists()),
        "checkpoint": f"{cfg.out}/{CHECKPOINT} (PRIVATE; release only `clipbias export`)",
    }
    print()
    emit(summary, False)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train one model privately, with checkpoints and a results report",
        description="Train one model with one algorithm. The noise multiplier is calibrated from "
                    "--epsilon for all --epochs; results.json, curves.png and a PRIVATE checkpoint go to "
                    "--out (default: a new directory runs/<data>-<model>-<algo>-eps<E>-s<seed>-<date>-<time> "
                    "for every run, printed at its start and end).")
    add_training_flags(p)
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the model initialisation (public); with --reproducible-noise also of the Poisson "
                        "batches, the noise and the methods' keyed draws, which otherwise come from the OS CSPRNG "
                        "(default 0)")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="run directory (default: a new one per run under runs/); an existing run in it is "
                        "refused unless --resume or --overwrite")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true",
                   help="print results.json on stdout (header and progress go to stderr)")
    p.set_defaults(func=_run)
