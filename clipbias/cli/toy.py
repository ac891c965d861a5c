"""``clipbias toy``: the papers' small problems, through the real engine, in seconds.

Prints the final iterate of ``--algo``, the optimum and their distance, and writes a figure of
distance-to-optimum vs iteration for every applicable algorithm. See ``docs/toy.md``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from ..errors import ConfigError, require
from ._choices import current
from ..files import new_run_dir
from ._common import emit
from ._flags import speak
from .train import add_method_flags, method_settings

DEFAULT_BUDGET_S = 120.0  # per algorithm, default comparison only (explicit --compare runs everything)


def _parse_extra(items: list[str] | None) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--extra takes KEY=VALUE, got {item!r}")
        k, v = item.split("=", 1)
        k, v = k.strip(), v.strip()
        if not k:
            raise ConfigError(f"--extra takes KEY=VALUE, got {item!r}")
        low = v.lower()
        if low in ("true", "false"):
            out[k] = low == "true"
            continue
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                out[k] = v
    return out


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, list):
        return "[" + ", ".join(f"{x:.4g}" for x in v) + "]"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.6g}"
    return str(v)


def _run(args: argparse.Namespace) -> int:
    from .. import algorithms
    from ..analysis import toy
    from ..run.checkpoint import check_out_dir
    problem = toy.get_problem(args.problem)
    if not args.no_figure:  # a missing matplotlib or a file in the figure's way is refused now, not after the runs
        require("matplotlib", "drawing the figure of clipbias toy (--no-figure skips it)")
        check_out_dir(Path(args.figure).parent if args.figure else Path(args.out or "runs"))
        given = Path(args.figure) if args.figure else Path(args.out) / f"toy-{args.problem}.png" if args.out else None
        if given is not None and given.exists() and not args.overwrite:
            raise ConfigError(f"{given} exists (an earlier figure); pass --overwrite to replace it, or another "
                              f"{'--figure' if args.figure else '--out'}")
    algorithms.get(args.algo)  # a clear error for an unknown name
    extra = method_settings(args)
    extra.update(_parse_extra(args.extra))
    s = toy.settings_for(args.problem, lr=args.lr, steps=args.steps, clip=args.clip, ef_clip=args.ef_clip,
                         gamma=args.gamma, noise_multiplier=args.noise_multiplier, batch_size=args.batch_size,
                         x0=args.x0, seed=args.seed, delta=args.delta, dice_accounting=args.dice_accounting,
                         momentum=args.momentum, optimizer=args.optimizer, extra=extra or None)
    if s.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {s.steps}")
    inst = problem.build(s)
    main = toy.run(args.problem, args.algo, s, inst)  # raises NotApplicable / ConfigError for this algo

    results, skipped, figure = {args.algo: main}, {}, None
    if not args.no_figure:
        figure, others, skipped = _comparison(args, problem, s, inst, main)
        results.update(others)

    out = main.to_dict()
    out["figure"] = figure
    out["comparison"] = {name: {"x_final": r.to_dict()["x_final"], "distance": r.distance,
                                "distance_tail_mean": r.distance_tail_mean,
                                "mean_distance_second_half": r.mean_distance_second_half,
                                "predicted_fixed_point": r.to_dict()["predicted_fixed_point"],
                                "epsilon": r.privacy.get("epsilon")}
                         for name, r in results.items() if name != args.algo}
    out["skipped"] = skipped
    if args.json:
        emit(out, True)
        return 0
    rows = {"problem": f"{args.problem}: {problem.title}", "algo": args.algo,
            "x_final": _fmt(out["x_final"]), "x_opt": _fmt(out["x_opt"]), "distance": _fmt(out["distance"]),
            "tail mean": f"{_fmt(out['x_tail_mean'])} (mean of the last 10% of iterates; distance "
                         f"{_fmt(out['distance_tail_mean'])})",
            "mean distance": f"{_fmt(out['mean_distance_second_half'])} (mean of ||x_t - x*|| over the "
                             f"second half of the run)",
            "predicted": _fmt(out["predicted_fixed_point"]) + ("" if out["predicted_fixed_point"] is None
                                                               else " (the papers' fixed point)"),
            "epsilon": _fmt(main.privacy.get("epsilon")) + (f" (delta {s.delta:g}, {main.privacy.get('accountant')})"
                                                            if main.settings["private"] else " (non-private)"),
            "settings": f"lr {s.lr:g}, steps {s.steps}, C {s.clip:g}, "
                        f"{'full batch' if s.batch_size is None else f'B {s.batch_size:g}'}, "
                        f"z {main.settings['noise_multiplier']:g}, seed {s.seed}"}
    if "error" in main.privacy:
        rows["accounting"] = main.privacy["error"]
    if main.privacy.get("note"):
        rows["accounting note"] = main.privacy["note"]
    if figure:
        rows["figure"] = figure
    emit(rows, False)
    if results and len(results) > 1:
        print("\nall algorithms (same settings):")
        w = max(len(n) for n in results)
        print(f"  {'algo':<{w}}  {'distance':>10}  {'tail dist':>10}  {'mean dist 2nd half':>18}  x_final")
        for name, r in results.items():
            print(f"  {name:<{w}}  {r.distance:>10.4g}  {r.distance_tail_mean:>10.4g}  "
                  f"{r.mean_distance_second_half:>18.4g}  {_fmt(r.to_dict()['x_final'])}")
    sys.stdout.flush()
    for name, why in skipped.items():
        print(f"  skipped {name}: {speak(why)}", file=sys.stderr)
    return 0


def _comparison(args: argparse.Namespace, problem, s, inst, main) -> tuple[str, dict, dict]:
    """Run the comparison algorithms and draw distance-to-optimum vs iteration: (figure, results, skipped)."""
    import torch

    from .. import algorithms
    from ..analysis import diagnostics_plots as plots
    from ..analysis import toy
    names = ([a.strip() for a in args.compare.split(",") if a.strip()] if args.compare
             else list(problem.compare or algorithms.ALGORITHMS))
    for name in names:
        algorithms.get(name)
    budget = None if args.compare else DEFAULT_BUDGET_S
    others, skipped = toy.run_all(args.problem, s, [a for a in names if a != args.algo], inst, budget)
    results = {args.algo: main, **others}
    curves = {name: results[name].distances for name in names if name in results}
    if args.algo not in curves:
        curves = {args.algo: main.distances, **curves}
    pred = {}
    for name, r in results.items():
        if r.predicted_fixed_point is not None:
            d = float((torch.tensor(r.predicted_fixed_point) - torch.tensor(r.x_opt)).norm())
            if d > 0:
                pred.setdefault(f"{d:.6g}", []).append(name)
    pred_lines = {"/".join(v): float(k) for k, v in pred.items()}
    if not args.figure:  # without --out a new directory for every run: figures never replace earlier ones
        figure = str((Path(args.out) if args.out else new_run_dir(f"toy-{args.problem}")) / f"toy-{args.problem}.png")
    else:
        figure = args.figure
    title = (f"{problem.title}\nlr {s.lr:g}, C {s.clip:g}, "
             f"{'full batch' if s.batch_size is None else f'B = {s.batch_size:g}'}, "
             f"noise multiplier {s.noise_multiplier:g} (private algorithms only), seed {s.seed}")
    private = [n for n in curves if results[n].settings["private"]]
    figure = plots.toy_distances(curves, figure, title, pred_lines, private,
                                 {n: results[n].smoothed for n in curves}, toy.smoothing_window(s.steps))
    return figure, others, skipped


def register(sub: argparse._SubParsersAction) -> None:
    problems = current()["toy_problems"]
    names = ", ".join(problems)
    p = sub.add_parser(
        "toy", help="the papers' toy problems (clipping bias and its removal), through the engine",
        description="Run one algorithm on one of the papers' small problems (deterministic, seconds) and "
                    "print the final iterate, the optimum and their distance; also draw distance-to-"
                    f"optimum vs iteration for every applicable algorithm. Problems: {names}. "
                    "Full batch unless --batch-size is given. Unset settings take the problem's defaults "
                    "(see docs/toy.md).")
    p.add_argument("--problem", required=True, choices=problems, metavar="NAME",
                   help=f"one of {names}")
    p.add_argument("--algo", required=True, metavar="NAME",
                   help="algorithm, as in `clipbias train` (sgd, clip-sgd, ef-sgd, dpsgd, dice, perturb, ...)")
    p.add_argument("--clip", type=float, default=None, metavar="C",
                   help="per-example clip C (dice-b1: also sets C' = ceil(C) + 1); default 1")
    p.add_argument("--ef-clip", type=float, default=None, metavar="C2", help="DiceSGD feedback clip (default C)")
    p.add_argument("--lr", type=float, default=None, help="step size (default: the problem's)")
    p.add_argument("--steps", type=int, default=None, help="iterations (default: the problem's)")
    p.add_argument("--gamma", type=float, default=None,
                   help="normalisation constant g/(||g|| + gamma) (default 0.01; xiao-two-sample 1e-6, "
                        "close to the paper's exact normalisation)")
    p.add_argument("--noise-multiplier", type=float, default=None, metavar="Z",
                   help="noise multiplier of the private algorithms (noise std z*C/B on the mean update); "
                        "the epsilon reported is the engine's accounting of it")
    p.add_argument("--batch-size", type=float, default=None, metavar="B",
                   help="expected Poisson batch size (default: full batch, q = 1)")
    p.add_argument("--x0", type=float, default=None, help="start, on every coordinate (default: the problem's)")
    p.add_argument("--seed", type=int, default=None, help="seed of sampling, noise and (chen-mixture) data")
    p.add_argument("--delta", type=float, default=None, help="delta of the reported epsilon (default 1e-5)")
    p.add_argument("--dice-accounting", choices=current()["dice_accounting"], default=None,
                   help="DiceSGD basis (default sound; paper and authors are refuted, reproduction only)")
    p.add_argument("--momentum", type=float, default=None,
                   help="heavy-ball momentum of the base SGD optimizer (default: the problem's, usually 0)")
    p.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default=None,
                   help="base optimizer (default: the algorithm's own)")
    m = p.add_argument_group("method-specific (as in `clipbias train`)")
    add_method_flags(m)
    m.add_argument("--extra", action="append", metavar="KEY=VALUE",
                   help="any other AlgoConfig.extra setting (repeatable), e.g. --extra gamma_m=0.2")
    o = p.add_argument_group("output")
    o.add_argument("--compare", default=None, metavar="LIST",
                   help="algorithms drawn in the figure (default: every registered one that applies and "
                        f"runs in under {DEFAULT_BUDGET_S:g} s here; chen-mixture: sgd, clip-sgd, ef-sgd, "
                        f"dpsgd, dice)")
    o.add_argument("--out", default=None, metavar="DIR",
                   help="figure directory (default: a new runs/toy-PROBLEM-<date>-<time> for every run)")
    o.add_argument("--figure", default=None, metavar="PATH", help="figure file (default DIR/toy-PROBLEM.png)")
    o.add_argument("--overwrite", action="store_true", help="replace an existing figure at --out / --figure")
    o.add_argument("--no-figure", action="store_true", help="run --algo only, no figure")
    o.add_argument("--json", action="store_true",
                   help="print JSON: x_final, x_opt, distance, the settings, privacy, comparison")
    p.set_defaults(func=_run)
