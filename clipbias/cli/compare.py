"""``clipbias compare``: several algorithms on the same data, model, epsilon and seeds; one table.

With no arguments it runs the default comparison: DPSGD-GC vs DiceSGD (sound accounting, r = 0.01)
on Fashion-MNIST at epsilon = 3, delta = 1e-5 (see ``DEFAULTS`` and docs/cli.md for why these
settings and its measured time).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

from ..errors import ConfigError
from ._choices import current
from ._common import emit, jsonable
from ..files import new_run_dir, remove_if_empty
from .train import add_training_flags, config_from_args, fmt_eps, set_threads

# The default comparison. scatter-linear trains ~13 s per epoch on the full 60k Fashion-MNIST on one
# idle core (cnn ~19 s), after a one-off ~70 s scattering pass (then cached on disk), and is the
# stronger model at small budgets. B = 2048 (Tramer & Boneh's Fashion-MNIST batch size for the cnn),
# momentum 0.9; lr 26 and clip 0.054 are what ``clipbias tune`` chose for dpsgd on this protocol
# (a private search at epsilon 3 for the whole search; docs/results.md, "Tuned defaults"). DiceSGD's feedback ratio r = B C2 / C1 defaults
# to DEFAULT_EF_RATIO (docs/algorithms/dicesgd.md, "Defaults"). See docs/cli.md for the measurements.
DEFAULTS = {"data": "fashion-mnist", "model": "scatter-linear", "epsilon": 3.0, "delta": 1e-5,
            "epochs": 3, "batch_size": 2048.0, "lr": 26.0, "clip": 0.054, "momentum": 0.9}
DEFAULT_ALGOS = ["dpsgd", "dice"]
DEFAULT_SEEDS = [0, 1, 2]


def parse_variant(spec: str) -> tuple[str, dict]:
    """``NAME``, ``NAME:ACCOUNTING`` (e.g. ``dice:authors``) or ``NAME:bands=B`` (banded noise, e.g.
    ``dpsgd:bands=4``; ``NAME:bands=B:optimized`` with the optimised coefficients, ``NAME:bands=K:blt`` BLT noise) -> (label, config
    overrides)."""
    from .. import algorithms
    from ..privacy.dice import check_basis
    name, _, acc = spec.partition(":")
    try:
        algo = algorithms.get(name)  # a registered name or BASE+disk
    except ConfigError as e:
        if name in algorithms.ALGORITHMS or "+" in name and name.rpartition("+")[0] in algorithms.ALGORITHMS:
            raise ConfigError(f"--algos {spec}: {e}") from None
        raise ConfigError(f"--algos: unknown algorithm {name!r}; choose from "
                          f"{', '.join(sorted(algorithms.ALGORITHMS))}, or BASE+disk (DiSK added to BASE)") from None
    over: dict = {"algo": name}
    if acc.startswith("bands="):
        count, _, strategy = acc[len("bands="):].partition(":")
        try:
            over["bands"] = int(count)
        except ValueError:
            raise ConfigError(f"--algos {spec}: bands=B takes a whole number, e.g. {name}:bands=4") from None
        if strategy:
            from ..algorithms.bands import NOISE_STRATEGIES
            if strategy not in NOISE_STRATEGIES:
                *first, last = NOISE_STRATEGIES
                raise ConfigError(f"--algos {spec}: bands=B:STRATEGY takes {', '.join(first)} or {last}, e.g. "
                                  f"{name}:bands=4:optimized")
            over["bands_strategy"] = strategy
    elif acc:
        from ..privacy import MECHANISMS
        if not MECHANISMS[algo.accounting].takes_basis:
            raise ConfigError(f"--algos {spec}: ':{acc}' (DiceSGD accounting) applies only to DiceSGD "
                              f"algorithms")
        try:
            over["dice_accounting"] = check_basis(acc)
        except ConfigError as e:
            raise ConfigError(f"--algos {spec}: {e}") from None
    return spec, over


def _table(rows: list[dict]) -> str:
    n = len(rows[0]["test_accuracies"]) if rows else 0  # every row ran the same seeds
    head = ["algo", "accounting", "test acc (1 seed)" if n == 1 else f"test acc (mean ± std, {n} seeds)",
            "epsilon", "certified", "noise mult.", "s/epoch"]
    body = []
    for r in rows:
        acct = r["dice_accounting"] or ("none" if math.isinf(r["epsilon"]) else r["accountant"])
        cert = ("true" if r["certified"] else "false (non-private)" if math.isinf(r["epsilon"]) else
                "false (see caveats)" if r.get("caveats") else "false (REFUTED bound)")
        body.append([r["label"], acct,
                     (f"{100 * r['test_accuracy_mean']:.2f} %" if n == 1 else
                      f"{100 * r['test_accuracy_mean']:.2f} ± {100 * r['test_accuracy_std']:.2f} %")
                     + (f"  (val {100 * r['val_accuracy_mean']:.2f})" if "val_accuracy_mean" in r else "")
                     + ((f"  (ema {100 * r['ema_test_accuracy_mean']:.2f})" if n == 1 else
                         f"  (ema {100 * r['ema_test_accuracy_mean']:.2f} ± {100 * r['ema_test_accuracy_std']:.2f})")
                        if "ema_test_accuracy_mean" in r else ""),
                     fmt_eps(r["epsilon"]), cert, f"{r['noise_multiplier']:.4g}",
                     f"{r['wall_time_per_epoch_s']:.1f}"])
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def _variants(args: argparse.Namespace, algos: list[str]) -> tuple[list[tuple[str, dict]], float]:
    """(label, config overrides) per --algos entry, and the feedback ratio r: C2 = r C1 / B goes to
    the algorithms that read it (the sound privacy cost of feedback grows with r) unless --ef-clip."""
    from .. import algorithms
    from ..privacy.dice import DEFAULT_EF_RATIO
    if args.ef_ratio is not None and args.ef_clip is not None:
        raise ConfigError("give --ef-clip or --ef-ratio, not both")
    ratio = DEFAULT_EF_RATIO if args.ef_ratio is None else args.ef_ratio
    if not (math.isfinite(ratio) and ratio > 0):
        raise ConfigError(f"--ef-ratio must be > 0, got {ratio!r}")
    from .train import method_settings
    given, used, variants = method_settings(args), set(), []
    for spec in algos:
        label, over = parse_variant(spec)
        algo = algorithms.get(over["algo"])
        if algo.reads_ef_clip:
            over["ef_clip"] = args.ef_clip if args.ef_clip is not None else ratio * args.clip / args.batch_size
        # each algorithm gets the method flags it reads (--kappa goes to disk, not to dpsgd beside it)
        keys = {k for s in algo.schema for k in (s.key, *s.aliases)}
        over["extra"] = {k: v for k, v in given.items() if k in keys}
        used |= over["extra"].keys()
        variants.append((label, over))
    if set(given) - used:
        flags = ", ".join(algorithms.setting_flag(k) for k in sorted(set(given) - used))
        raise ConfigError(f"{flags} applies to none of --algos {' '.join(algos)}: add an algorithm that reads it "
                          f"(`clipbias train --help` lists each method's flags) or drop it")
    return variants, ratio


def _taken(out: Path, labels: list[str], seeds: list[int]) -> list[str]:
    """What an earlier compare or train run left in ``out`` that this compare would replace."""
    from ..run.checkpoint import CHECKPOINT
    from ..run.report import COMPARE, RESULTS
    from ..run.training import CURVES, safe_name
    names = [COMPARE, RESULTS, CHECKPOINT, CURVES,
             *(f"{safe_name(label)}-s{seed}" for label in labels for seed in seeds)]
    return [f for f in names if (out / f).exists()]


def _run(args: argparse.Namespace) -> int:
    from ..files import run_lock
    from ..run.checkpoint import check_out_dir
    from ..run.config import check_int
    t0 = time.perf_counter()
    if args.epsilon is None and args.noise_multiplier is None:  # the default budget, unless z is given
        args.epsilon = DEFAULTS["epsilon"]
    set_threads(args.threads)
    algos = args.algos or DEFAULT_ALGOS
    seeds = args.seeds if args.seeds is not None else DEFAULT_SEEDS
    for s in seeds:
        check_int(s, "seeds", 0)
    base = config_from_args(args, algo="dpsgd", seed=seeds[0] if seeds else 0, ef_clip=None, extra={})
    variants, ratio = _variants(args, algos)
    for _, over in variants:
        dataclasses.replace(base, **over)  # refuses what the variant cannot run
    if args.out:
        out = Path(args.out)
        check_out_dir(out)
    else:  # a new directory for every run: a default compare never meets an earlier one
        out = new_run_dir(f"compare-{base.data}-{base.model}" + (f"-eps{base.epsilon:g}" if base.epsilon else ""))
    try:
        with run_lock(out):  # a second compare (or train) on the same --out is refused
            taken = _taken(out, [label for label, _ in variants], seeds)
            if taken and not args.overwrite:
                raise ConfigError(f"--out {out} already holds {', '.join(taken)} (an earlier compare or train "
                                  f"run); choose another --out, or replace it with --overwrite")
            return _compare(args, base, variants, seeds, out, taken, ratio, t0)
    finally:
        if not args.out:
            remove_if_empty(out)


def _compare(args: argparse.Namespace, base, variants: list[tuple[str, dict]], seeds: list[int], out: Path,
             taken: list[str], ratio: float, t0: float) -> int:
    """Run the comparison into the locked ``out``; an overwritten compare's files wait in
    ``out/.previous`` until the new one is complete (an interrupt never mixes old and new)."""
    from ..run.checkpoint import finish_overwrite, set_aside
    from ..run.report import COMPARE
    from ..run.training import CURVES, prepare_splits, run_many, write_json
    algos = [label for label, _ in variants]
    log = sys.stderr if args.json else sys.stdout
    print(f"compare: {', '.join(algos)} on {base.data} / {base.model}, epsilon={base.epsilon}, "
          f"delta={base.delta:g}, {base.epochs} epochs, B={base.batch_size:g}, lr={base.lr:g}, "
          f"clip={base.clip:g}, seeds {' '.join(map(str, seeds))} -> {out}", file=log, flush=True)
    splits = prepare_splits(dataclasses.replace(base, **variants[0][1]))
    set_aside(out, tuple(taken))

    def on_start(label: str, seed: int, h: dict) -> None:
        if h.get("warning") and label == variants[0][0] and seed == seeds[0]:
            print(h["warning"], file=sys.stderr)
        print(f"[{label} seed {seed}] N={h['N']} q={h['q']:.5g} B={h['B']:g} steps={h['steps']} "
              f"z={h['noise_multiplier']:.4g} epsilon at end={fmt_eps(h['epsilon_at_end'])} "
              f"certified={str(h['certified']).lower()}", file=log, flush=True)

    def on_run(label: str, seed: int, res: dict) -> None:
        ema = f" (ema {res['ema_test_accuracy']:.4f})" if res.get("ema_test_accuracy") is not None else ""
        print(f"[{label} seed {seed}] test accuracy {res['test_accuracy']:.4f}{ema}, epsilon "
              f"{fmt_eps(res['epsilon'])}, {res['wall_time_per_epoch_s']:.1f} s/epoch", file=log, flush=True)

    result = run_many(base, variants, seeds, out=out, splits=splits, progress=not args.quiet,
                      on_run=on_run, on_start=on_start)
    from ..run.plots import plot_curves_or_notice
    curves = plot_curves_or_notice(
        {label: [r["history"] for r in rs] for label, rs in result["runs"].items()}, out / CURVES,
        title=f"{base.data} / {base.model} / target epsilon={base.epsilon}, delta={base.delta:g} "
              f"(mean over {len(seeds)} seed{'s' if len(seeds) > 1 else ''})")
    summary = {"config": {**base.to_dict(), "algos": algos, "seeds": seeds, "ef_ratio": ratio
                          if args.ef_clip is None else None},
               "dataset": splits.info, "rows": result["summary"],
               "runs": {label: [{k: r[k] for k in ("test_accuracy", "val_accuracy", "epsilon", "certified",
                                                   "noise_multiplier", "history", "wall_time_s",
                                                   "wall_time_per_epoch_s", "config", "ema_test_accuracy")
                                 if k in r} for r in rs]
                        for label, rs in result["runs"].items()},
               "wall_time_s": time.perf_counter() - t0}
    best = best_sound(summary)
    summary["best_sound"] = None if best is None or best["label"] is None else \
        {k: best[k] for k in ("label", "command")}
    summary["tied_at_top"] = [] if best is None else best["tied"]
    write_json(summary, out / COMPARE)
    finish_overwrite(out)
    _print_summary(args, summary, result["summary"], out, t0, curves is not None)
    return 0


def _print_summary(args: argparse.Namespace, summary: dict, rows: list[dict], out: Path, t0: float,
                   curves: bool) -> None:
    from ..run.report import COMPARE
    from ..run.training import CURVES
    if args.json:
        emit(jsonable(summary), True)
        return
    print()
    print(_table(rows))
    print()
    for r in rows:
        print(f"{r['label']}: basis: {r['basis']}")
    if any(not r["certified"] and not math.isinf(r["epsilon"]) for r in rows):
        print("certified = false: a DiceSGD bound (paper / authors) that a canary attack refutes "
              "(docs/privacy.md): NOT a guarantee, shown only to reproduce the paper.")
    best = best_sound(summary)  # also in compare.json
    print("\n" + (best["line"] if best else "best sound configuration: none (no row is certified)"))
    print(f"\nwrote {out / COMPARE}{f' and {out / CURVES}' if curves else ''} ({time.perf_counter() - t0:.0f} s)")


def leaders(rows: list[dict]) -> tuple[dict | None, list[dict]]:
    """(the best row, the rows tied at the top) among the certified ``rows`` (summary rows: mean and
    sample standard deviation of the test accuracy over the same seeds).

    The rule: L, the row with the highest mean, is the best when, for every other row r, its lead
    ``mean_L - mean_r`` exceeds ``max(std_L, std_r)``, the larger of the two rows' seed standard
    deviations; otherwise there is no best, and the tie is L with every r whose lead does not exceed
    it. With one seed there is no spread to compare a lead with: every row ties. (A lead of one
    standard deviation is a screen, not a significance test.) No certified row: (None, [])."""
    rows = sorted((r for r in rows if r["certified"]), key=lambda r: -r["test_accuracy_mean"])
    if not rows:
        return None, []
    top = rows[0]
    if len(rows) == 1:  # nothing to lead
        return top, []
    if len(top["test_accuracies"]) < 2:
        return None, rows
    tied = [r for r in rows[1:] if top["test_accuracy_mean"] - r["test_accuracy_mean"]
            <= max(top["test_accuracy_std"], r["test_accuracy_std"])]
    return (None, [top, *tied]) if tied else (top, [])


def best_sound(summary: dict) -> dict | None:
    """The certified row that leads the others by more than the seeds' spread (``leaders``), its
    settings and the ``clipbias train`` line that runs it (one seed), or the rows tied at the top
    (``label`` None, ``tied`` their labels); None when no row is certified. Chosen on the test split,
    so it is advice for the next run, not a tuned result (``clipbias tune`` selects privately)."""
    r, tied = leaders(summary["rows"])
    if r is None and not tied:
        return None
    n = len(summary["runs"][(r or tied[0])["label"]])
    seeds = f"{n} seed{'s' if n > 1 else ''}"
    if r is None:
        rows = ", ".join(f"{t['label']} {100 * t['test_accuracy_mean']:.2f} ± {100 * t['test_accuracy_std']:.2f} %"
                         for t in tied)
        why = ("one seed measures no spread" if n < 2 else
               "each lead is within the larger of the two rows' seed standard deviations")
        line = f"best sound configuration: a tie ({seeds}: {rows}; {why}); more seeds may separate them"
        return {"label": None, "tied": [t["label"] for t in tied], "config": None, "command": None, "line": line}
    c = summary["runs"][r["label"]][0]["config"]
    cmd = train_command(c) if c.get("epsilon") is not None else None
    line = (f"best sound configuration: {r['label']} ({100 * r['test_accuracy_mean']:.2f} % mean of {seeds}, "
            f"ahead of every other row by more than their seed standard deviations, epsilon "
            f"{fmt_eps(r['epsilon'])}, certified) with lr {c['lr']:g}, clip {c['clip']:g}, momentum {c['momentum']:g}"
            + (f"\n  run it: {cmd}" if cmd else ""))
    return {"label": r["label"], "tied": [], "config": c, "command": cmd, "line": line}


def train_command(c: dict) -> str:
    """The ``clipbias train`` line of a run's config (``TrainConfig.to_dict``): every setting that
    differs from train's default, method settings through their own flags."""
    algo, kalman = (c["algo"][:-len("+disk")], True) if c["algo"].endswith("+disk") else (c["algo"], False)
    parts = ["clipbias train", f"--data {c['data']}", f"--model {c['model']}", f"--algo {algo}"]
    parts += ["--kalman"] if kalman else []
    for key, flag in (("epsilon", "--epsilon"), ("delta", "--delta"), ("epochs", "--epochs"),
                      ("batch_size", "--batch-size"), ("lr", "--lr"), ("clip", "--clip"), ("ef_clip", "--ef-clip"),
                      ("grad_bound", "--grad-bound"), ("momentum", "--momentum"), ("weight_decay", "--weight-decay"),
                      ("optimizer", "--optimizer"), ("gamma", "--gamma"), ("accountant", "--accountant"),
                      ("dice_accounting", "--dice-accounting"), ("subset", "--subset"), ("ema", "--ema"),
                      ("data_dir", "--data-dir"), ("data_path", "--data-path")):
        v = c.get(key)
        if v is not None and not (key in ("weight_decay",) and v == 0):
            parts.append(f"{flag} {v:g}" if isinstance(v, float) else f"{flag} {v}")
    if c.get("bands", 1) != 1:
        parts.append(f"--bands {c['bands']}")
        if c.get("bands_strategy", current()["default_bands_strategy"]) != current()["default_bands_strategy"]:
            parts.append(f"--bands-strategy {c['bands_strategy']}")
    flags = {st["key"]: st for st in current()["settings"]}
    for key, v in sorted((c.get("extra") or {}).items()):
        st = flags.get(key)
        if v is None or st is None:
            continue
        if st["switch"]:
            on, _, off = st["flag"].partition("/")
            parts.append(on if v else off)
        else:
            parts.append(f"{st['flag']} {v:g}" if isinstance(v, float) else f"{st['flag']} {v}")
    return " ".join(parts)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare", help="several algorithms, same data/model/epsilon/seeds, one table",
        description="Run each --algos value on the same data, model, privacy budget and seeds, and print "
                    "mean ± std test accuracy, epsilon, certified, noise multiplier and time per epoch. "
                    "With no arguments: DPSGD-GC vs DiceSGD (sound accounting, r = 0.01) on Fashion-MNIST, "
                    "epsilon = 3, delta = 1e-5, scatter-linear, 3 epochs, B = 2048, lr 26, momentum 0.9, "
                    "clip 0.054 (chosen by clipbias tune), seeds 0 1 2, all available cores. Measured on 2 shared AMD EPYC cores: 74 s "
                    "with the scattering features cached; the first run adds 60-70 s to compute and cache "
                    "them (docs/cli.md).")
    p.add_argument("--algos", nargs="+", default=None, metavar="NAME[:ACCOUNTING|:bands=B[:optimized|:blt]]",
                   help="algorithms (default: dpsgd dice); NAME:ACCOUNTING picks DiceSGD's accounting "
                        "per row, e.g. dice:sound dice:paper (paper and authors are refuted: reproduction only); "
                        "NAME:bands=B runs that row with banded noise (--bands), e.g. dpsgd:bands=4, and "
                        "NAME:bands=B:optimized with its optimised coefficients (--bands-strategy optimized), "
                        "NAME:bands=K:blt with BLT noise in K classes (--bands-strategy blt)")
    p.add_argument("--seeds", nargs="+", type=int, default=None, metavar="S",
                   help=f"seeds (default: {' '.join(map(str, DEFAULT_SEEDS))})")
    add_training_flags(p, algo=False, defaults=DEFAULTS)
    p.set_defaults(momentum=DEFAULTS["momentum"], epsilon=None)  # 3 unless --noise-multiplier is given
    p.add_argument("--ef-ratio", type=float, default=None, metavar="R",
                   help=f"DiceSGD feedback clip C2 = R * C1 / B (default R = {current()['default_ef_ratio']:g}) unless --ef-clip is given")
    p.add_argument("--out", default=None, metavar="DIR",
                   help="output directory (default: a new runs/compare-<data>-<model>-eps<E>-<date>-<time> for "
                        "every run); earlier results in it are refused unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the results of an earlier compare (or train run) in --out")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print compare.json on stdout")
    p.set_defaults(func=_run)
