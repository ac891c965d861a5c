"""``clipbias diagnose``: watch the clipping bias along a training run (NOT differentially private).

Trains with the engine exactly as ``clipbias train`` would (same flags, or a saved run's
``results.json`` config via ``--run DIR``) and, at the chosen steps, records the instruments of
``clipbias.analysis.diagnostics`` from the raw per-example gradients of a fixed sample of training examples.
Writes ``DIR/diagnostics.json`` and one PNG per instrument. See ``docs/diagnostics.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError, require
from ._common import emit, jsonable

if TYPE_CHECKING:
    import torch

    from ..analysis import diagnostics

# Defaults of a diagnose run: small enough for < 1 minute on one CPU core.
DIAGNOSE_DEFAULTS = {"data": "fashion-mnist", "model": "cnn", "epochs": 2, "batch_size": 256.0,
                     "lr": 1.0, "clip": 1.0, "delta": 1e-5, "subset": 4000, "algo": "dpsgd", "seed": 0}
DEFAULT_EPSILON = 8.0  # for a private --algo when neither --epsilon nor --noise-multiplier is given

FIGURES = {"norms": "norms.png", "sampling_noise": "sampling_noise.png", "clipping_bias": "clipping_bias.png",
           "cosine_histogram": "cosine_histogram.png", "projections": "projections.png",
           "symmetry": "symmetry.png", "noise_correlation": "noise_correlation.png",
           "p_averaging": "p_averaging.png"}


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ConfigError(f"{flag} must be a comma-separated list of integers, got {text!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise ConfigError(f"{flag} must list integers >= 1, got {text!r}")
    return vals


def parse_steps_at(text: str | None, total: int) -> list[int]:
    """``"0,10,end"`` -> [0, 10, total]; default: 0, T/4, T/2, T."""
    if text is None:
        return sorted({0, total // 4, total // 2, total})
    out = []
    for tok in text.split(","):
        tok = tok.strip()
        if not tok:
            continue
        if tok == "end":
            out.append(total)
            continue
        try:
            v = int(tok)
        except ValueError:
            raise ConfigError(f"--steps-at takes step numbers and 'end', e.g. 0,10,end; got {tok!r}") from None
        if not 0 <= v <= total:
            raise ConfigError(f"--steps-at: step {v} is outside the run's 0..{total} steps")
        out.append(v)
    if not out:
        raise ConfigError("--steps-at is empty")
    return sorted(set(out))


def _explicit_defaults(p: argparse.ArgumentParser, first: int) -> dict:
    """Move the defaults of the actions added after index ``first`` into a table (the parser then
    defaults them to None), so that explicit flags, a saved run's config and the defaults can be
    merged in that order of precedence."""
    table = {}
    for a in p._actions[first:]:
        if a.dest in ("help",) or a.default is argparse.SUPPRESS:
            continue
        table[a.dest] = a.default
        a.default = None
    return table


def _read_run_config(run: str) -> dict:
    path = Path(run) / "results.json"
    if not path.is_file():
        raise ConfigError(f"--run {run}: no results.json there (give a directory written by "
                          f"`clipbias train --out DIR`)")
    try:
        res = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--run {run}: results.json is not readable JSON: {exc}") from exc
    cfg = res.get("config")
    if not isinstance(cfg, dict):
        raise ConfigError(f"--run {run}: results.json has no 'config' object")
    return cfg


def _merge(args: argparse.Namespace, defaults: dict) -> None:
    """Explicit flag > the saved run's config (``--run``) > the diagnose defaults."""
    from .. import algorithms
    run_cfg = _read_run_config(args.run) if args.run else {}
    extra = run_cfg.get("extra") or {}
    spellings = {s.dest: (s.key, *s.aliases, s.dest) for s in algorithms.all_settings().values()}
    for dest, default in defaults.items():
        if getattr(args, dest, None) is not None:
            continue
        saved = [k for k in spellings.get(dest, ()) if k in extra]
        if dest in run_cfg:  # the run's value, even None (e.g. no --subset: the whole training set)
            setattr(args, dest, run_cfg[dest])
        elif saved:  # a method setting of the run, under any spelling it accepts
            setattr(args, dest, extra[saved[0]])
        else:
            setattr(args, dest, default)
    for dest in ("algo", "seed"):
        if getattr(args, dest) is None:
            setattr(args, dest, run_cfg.get(dest, DIAGNOSE_DEFAULTS[dest]))


def _subset(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    import torch
    return torch.arange(n) if k >= n else torch.randperm(n, generator=gen)[:k].sort().values


def _run(args: argparse.Namespace) -> int:
    from .. import algorithms
    from ..analysis import diagnostics
    from ..files import new_run_dir, remove_if_empty
    from ..run.checkpoint import check_out_dir
    from .train import config_from_args

    t0 = time.perf_counter()
    _merge(args, args._defaults)
    if algorithms.get(args.algo).private and args.epsilon is None and args.noise_multiplier is None:
        args.epsilon = DEFAULT_EPSILON
    # diagnostics are not private: reproducible batches and noise, from --seed
    cfg = config_from_args(args, reproducible_noise=True)
    sizes = _check_sizes(args)
    if not args.no_figures:  # refused now, not after the recording
        require("matplotlib", "drawing the figures of clipbias diagnose (--no-figures skips them)")
    if args.out or args.run:
        out = Path(args.out or args.run)
        check_out_dir(out)  # a file in the way is refused now, not after the recording; created at the first write
        if (out / "diagnostics.json").exists() and not args.overwrite:
            raise ConfigError(f"{out / 'diagnostics.json'} exists (an earlier diagnose); pass --overwrite to replace "
                              f"it and its figures, or another --out")
    else:
        out = new_run_dir("diagnose")  # a new directory for every run
    print(f"clipbias diagnose: {diagnostics.PRIVACY_WARNING}", file=sys.stderr)
    print(f"output directory: {out}", file=sys.stderr, flush=True)
    try:
        return _diagnose(args, cfg, sizes, out, t0)
    finally:
        if not (args.out or args.run):
            remove_if_empty(out)


def _diagnose(args: argparse.Namespace, cfg, sizes: tuple[list[int], list[int]], out: Path, t0: float) -> int:
    from ..analysis import diagnostics
    from ..run.build import build_run
    from ..run.report import write_json
    from ..run.splits import splits_for
    from ..randomness import SecretKey
    key = SecretKey.of(cfg.key_seed)  # the data's splits and the engine under one key, as `clipbias train`
    run = build_run(cfg, splits_for(cfg, key=key), key)  # exactly what `clipbias train` builds
    recorder, picked = _recorder(cfg, run, args, *sizes)
    steps_at, privacy = _record(args, run, recorder)
    records = recorder.records
    corr = recorder.tracker.result() if recorder.tracker.steps else None
    figures = {} if args.no_figures else _figures(records, corr, out, cfg)
    result = {
        "privacy_warning": diagnostics.PRIVACY_WARNING,
        "config": {k: v for k, v in cfg.to_dict().items() if k not in ("out", "resume", "overwrite")},
        "from_run": args.run, "at_checkpoint": bool(args.at_checkpoint),
        "data": run.splits.info, "training_privacy": privacy,
        "diagnostics": {**picked, "projections": args.projections, "ps": sizes[0], "windows": sizes[1],
                        "steps_at": steps_at, "total_steps": run.engine.total_steps},
        "records": [diagnostics.strip_arrays(r) for r in records],
        "noise_correlation": corr,
        "figures": figures,
        "wall_time_s": time.perf_counter() - t0,
    }
    path = out / "diagnostics.json"
    write_json(result, path)
    result["file"] = str(path)
    if args.json:
        print(json.dumps(jsonable(result), indent=2))
        return 0
    _print_summary(result, sys.stdout)
    return 0


def _check_sizes(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """The instrument sizes, checked; returns (--ps, --windows)."""
    for flag, v in (("--record-size", args.record_size), ("--reference-size", args.reference_size),
                    ("--projections", args.projections)):
        if v < 1:
            raise ConfigError(f"{flag} must be >= 1, got {v}")
    if args.track_size < 0 or args.track_reference_size < 0:
        raise ConfigError("--track-size and --track-reference-size must be >= 0")
    return _ints(args.ps, "--ps"), _ints(args.windows, "--windows")


def _recorder(cfg, run, args: argparse.Namespace, ps: list[int],
              windows: list[int]) -> tuple[diagnostics.Recorder, dict]:
    """The recorder on fixed random samples of the training set, and what was sampled."""
    import torch

    from ..analysis import diagnostics
    x, y, n = run.splits.x_train, run.splits.y_train, run.splits.n
    gen = torch.Generator().manual_seed(cfg.seed + 7919)
    rec_idx = _subset(n, args.record_size, gen)
    ref_idx = _subset(n, args.reference_size, gen)
    tref_idx = _subset(n, args.track_reference_size, gen) if args.track_reference_size else None
    track_idx = rec_idx[:args.track_size] if args.track_size else None
    pick = (lambda t, idx: None if idx is None else t[idx])
    recorder = diagnostics.Recorder(
        run.model, cfg.clip, x[rec_idx], y[rec_idx], x[ref_idx], y[ref_idx], pick(x, track_idx),
        pick(y, track_idx), pick(x, tref_idx), pick(y, tref_idx),
        projections=args.projections, ps=ps, windows=windows, seed=cfg.seed,
        rows=(lambda xs, ys: run.engine.rows.probe(xs, ys)) if run.algo.needs_public else None)
    picked = {"record_size": len(rec_idx), "reference_size": len(ref_idx),
              "reference": ("full training set" if len(ref_idx) == n else
                            f"mean gradient of {len(ref_idx)} random training examples"),
              "track_size": 0 if track_idx is None else len(track_idx),
              "track_reference_size": 0 if tref_idx is None else len(tref_idx)}
    return recorder, picked


def _record(args: argparse.Namespace, run, recorder: diagnostics.Recorder) -> tuple[list[int], dict]:
    """Record at the saved checkpoint (``--at-checkpoint``) or along a training run."""
    from ..analysis import diagnostics
    from ..run.training import load_checkpoint
    engine = run.engine
    if args.at_checkpoint:
        if not args.run:
            raise ConfigError("--at-checkpoint needs --run DIR (the run whose checkpoint to read)")
        ckpt = load_checkpoint(args.run)
        run.model.load_state_dict(ckpt["model"])
        step = int(ckpt.get("engine", {}).get("steps_taken", 0))
        recorder.record(step, checkpoint=str(Path(args.run) / "checkpoint.pt"))
        return [step], {"note": "recorded at the saved checkpoint; no training here (see the run's results.json)"}
    steps_at = parse_steps_at(args.steps_at, engine.total_steps)
    bar = None
    if not args.quiet:
        from tqdm import tqdm
        bar = tqdm(total=engine.total_steps, desc="diagnose", file=sys.stderr, leave=False)
    diagnostics.record_training(engine, run.splits.x_train, run.splits.y_train, recorder, steps_at,
                                progress=(lambda t, T: bar.update(1)) if bar else None)
    if bar:
        bar.close()
    return steps_at, engine.privacy().to_dict()


def _figures(records: list[dict], corr: dict | None, out: Path, cfg) -> dict:
    from ..analysis import diagnostics_plots as plots
    title = f"{cfg.data} / {cfg.model} / {cfg.algo}, C = {cfg.clip:g}"
    figures = {
        "norms": plots.norms(records, out / FIGURES["norms"], f"Gradient norms: {title}"),
        "sampling_noise": plots.sampling_noise(records, out / FIGURES["sampling_noise"],
                                               f"Sampling noise (Xiao Def. 2.5): {title}"),
        "clipping_bias": plots.clipping_bias(records, out / FIGURES["clipping_bias"], f"Clipping bias: {title}"),
        "cosine_histogram": plots.cosine_histograms(
            records, out / FIGURES["cosine_histogram"], f"cos(g_i, full gradient) (cf. Chen Fig. 3): {title}"),
        "projections": plots.projections(records, out / FIGURES["projections"]),
        "symmetry": plots.symmetry(records, out / FIGURES["symmetry"], f"Symmetry score: {title}"),
    }
    if corr and len(corr["windows"]) > 1:
        figures["noise_correlation"] = plots.noise_correlation(corr, out / FIGURES["noise_correlation"])
    figures["p_averaging"] = plots.p_averaging(records, out / FIGURES["p_averaging"],
                                               f"p-averaged clipping (cf. Xiao Fig. 7): {title}")
    return figures


def _print_summary(res: dict, stream) -> None:
    cols = ["step", "q50 ||g||", "clipped", "||mean g||", "noise", "noise clip", "||b||", "cos(b,g)",
            "cos mean", "sym", "sym null", "cos p=1", "cos p=max", "cos no clip"]
    rows = []
    for r in res["records"]:
        pa = list(r["p_averaging"].values())
        rows.append([r["step"], r["norms"]["q50"], r["norms"]["fraction_clipped"], r["norms"]["mean_grad_norm"],
                     r["sampling_noise"]["before"], r["sampling_noise"]["after"], r["clipping_bias"]["norm"],
                     r["clipping_bias"]["cos_true"], r["cosine_histogram"]["mean"], r["symmetry"]["mean_score"],
                     r["symmetry"]["null"], pa[0], pa[-1], r["p_averaging_ceiling"]])
    fmt = [lambda v: str(v)] + [lambda v: f"{v:.4g}"] * (len(cols) - 1)
    cells = [[f(v) for f, v in zip(fmt, row)] for row in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)), file=stream)
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)), file=stream)
    corr = res.get("noise_correlation")
    info = {}
    if corr:
        info["noise window K0"] = ", ".join(f"{k}: {v:.3f}" for k, v in zip(corr["windows"], corr["ratio_to_k1"]))
        info["lag-1 correlation"] = f"{corr['lag1_correlation']:.3f} over {corr['iterations']} iterations"
    tp = res["training_privacy"]
    info["training epsilon"] = tp.get("epsilon", "n/a")
    info["diagnostics"] = "NOT differentially private (raw per-example gradients)"
    info["written"] = res["file"] + (f" and {len(res['figures'])} PNG figures" if res["figures"] else "")
    print(file=stream)
    emit(info, False, stream)


def register(sub: argparse._SubParsersAction) -> None:
    try:
        from .train import add_training_flags
    except ImportError as exc:  # never break the whole CLI over one command
        def unavailable(args: argparse.Namespace, _exc=exc) -> int:
            raise ConfigError(f"clipbias diagnose needs the train command's flags, which failed to "
                              f"import: {_exc}")
        sub.add_parser("diagnose", help="(unavailable: clipbias train failed to import)").set_defaults(
            func=unavailable)
        return

    p = sub.add_parser(
        "diagnose", help="record clipping-bias diagnostics along a training run (NOT private)",
        description="Train as `clipbias train` would (same flags, or --run DIR to reuse a saved run's "
                    "config) and record, at --steps-at, per-example gradient diagnostics: norm "
                    "quantiles and fraction clipped, sampling noise before/after clipping, the clipping "
                    "bias vector, cos(g_i, full gradient) histograms, random 2-D projections with a "
                    "symmetry score, sampling-noise correlation across iterations, and p-averaged "
                    "clipping. Writes DIR/diagnostics.json and PNG figures. The diagnostics read raw "
                    "per-example gradients: they are NOT differentially private; use them for your own "
                    "analysis or on public data only. Defaults: a small, < 1 minute run "
                    "(fashion-mnist, cnn, dpsgd at epsilon 8, --subset 4000, 2 epochs of B = 256).")
    first = len(p._actions)
    add_training_flags(p, algo=False, defaults={k: v for k, v in DIAGNOSE_DEFAULTS.items()
                                                if k not in ("algo", "seed", "subset")})
    p.add_argument("--algo", metavar="NAME", default=None,
                   help=f"algorithm, as in train (default {DIAGNOSE_DEFAULTS['algo']}, or the --run's)")
    p.add_argument("--seed", type=int, default=None, help="seed of the model init, sampling, noise and samples")
    defaults = _explicit_defaults(p, first)
    defaults["subset"] = DIAGNOSE_DEFAULTS["subset"]
    d = p.add_argument_group("diagnostics")
    d.add_argument("--run", metavar="DIR", default=None,
                   help="reuse the config of a saved run (DIR/results.json); explicit flags win")
    d.add_argument("--at-checkpoint", action="store_true",
                   help="with --run: record once at the run's saved checkpoint instead of training")
    d.add_argument("--steps-at", default=None, metavar="LIST",
                   help="steps at which to record, e.g. 0,10,end (default: 0, T/4, T/2, end)")
    d.add_argument("--record-size", type=int, default=256, metavar="N",
                   help="random training examples whose per-example gradients are recorded (default 256)")
    d.add_argument("--reference-size", type=int, default=4000, metavar="N",
                   help="examples of the 'full-batch' reference gradient (default 4000; the whole training "
                        "set when N >= its size)")
    d.add_argument("--track-size", type=int, default=32, metavar="N",
                   help="examples whose sampling noise is tracked at every step (noise-correlation "
                        "instrument; 0 turns it off; default 32)")
    d.add_argument("--track-reference-size", type=int, default=256, metavar="N",
                   help="examples of the true-gradient estimate for the tracked noise (default 256)")
    d.add_argument("--projections", type=int, default=8, metavar="K", help="random 2-D projections per step")
    d.add_argument("--ps", default="1,2,4,10", metavar="LIST", help="group sizes p for p-averaging")
    d.add_argument("--windows", default="1,2,4,8", metavar="LIST", help="sliding windows K0 (iterations)")
    d.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default: the --run DIR, else a new runs/diagnose-<date>-<time> "
                        "for every run)")
    d.add_argument("--overwrite", action="store_true",
                   help="replace the diagnostics.json (and figures) of an earlier diagnose in the output directory")
    d.add_argument("--no-figures", action="store_true", help="write diagnostics.json only")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    d.add_argument("--json", action="store_true", help="print diagnostics.json on stdout")
    p.set_defaults(func=_run, _defaults=defaults)
