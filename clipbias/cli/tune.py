"""``clipbias tune``: private random search over the learning rate and the clip norm (Papernot &
Steinke 2022): only the best trial is output, and ``--epsilon`` is the budget of the whole search."""

from __future__ import annotations

import argparse

from ._common import emit


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from ..errors import ConfigError
    from ..files import atomic_write
    from ..randomness import SecretKey
    from ..run.report import write_json
    from ..run.tuning import TuneConfig, tune
    from .train import config_from_args, fmt_certified, set_threads

    set_threads(args.threads)
    given = [f for f, v in (("--lr", args.lr), ("--clip", args.clip)) if v is not None]
    if given:
        raise ConfigError(f"tune draws every trial's learning rate and clip from --lr-range and --clip-range: "
                          f"drop {' and '.join(given)}")
    # the base configuration's lr and clip are placeholders (every trial draws its own): the ranges'
    # geometric midpoints, so that the configuration is valid whenever the ranges are
    mid = [(lo * hi) ** 0.5 if lo > 0 and hi > 0 else 1.0 for lo, hi in (args.lr_range, args.clip_range)]
    base = config_from_args(args, lr=mid[0], clip=mid[1])
    tc = TuneConfig(base, tuple(args.lr_range), tuple(args.clip_range), trials=args.trials, shape=args.shape,
                    validation=args.validation_fraction, score_noise=args.score_noise,
                    bands_choices=tuple(args.bands_choices), strategy_choices=tuple(args.strategy_choices))
    out = Path(args.out) if args.out else None
    if out is not None and (out / "tune.json").exists() and not args.overwrite:
        raise ConfigError(f"--out {out} holds a tuning already (tune.json); pass --overwrite or another --out")
    key = SecretKey.from_seed(base.key_seed) if base.key_seed is not None else None
    res = tune(tc, key)
    weights = res.pop("weights")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_json(res, out / "tune.json")
        meta = {"epsilon": res["epsilon"], "delta": res["delta"], "certified": res["certified"],
                "caveats": res["caveats"], "basis": res["basis"], "config": res["best"]["config"]}
        atomic_write(out / "model.pt", lambda fh: torch.save({"state_dict": weights, "meta": meta}, fh))
    if args.json:
        emit(res, True)
        return 0
    searched = ({"best bands": f"{res['best']['bands']} ({res['best']['bands_strategy']} coefficients)"}
                if tc.bands_choices or tc.strategy_choices else {})
    emit({"best lr": f"{res['best']['lr']:.4g}", "best clip": f"{res['best']['clip']:.4g}", **searched,
          "validation accuracy": f"{res['best']['validation_accuracy']:.4f} (noisy: the released score)",
          "test accuracy": f"{res['best']['test_accuracy']:.4f} (the public test split; not used to select)",
          "noise multiplier": (f"{res['noise_multiplier']:.4g} (every trial)" if "noise_multipliers" not in res else
                               f"{res['noise_multiplier']:.4g} (the best trial's; by bands: " + ", ".join(
                                   f"{b}: {z:.4g}" for b, z in res["noise_multipliers"].items()) + ")"),
          "epsilon": f"{res['epsilon']:.4g} (the whole search; delta {res['delta']:g})",
          "certified": fmt_certified(res["certified"], True, res["caveats"]), "basis": res["basis"],
          "not output": res["secret"],
          "files": f"{out}/tune.json, {out}/model.pt (the best weights: releasable)" if out else "none (no --out)"}, False)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from .train import add_training_flags
    p = sub.add_parser("tune", help="private random search over lr and clip (the search itself is accounted)",
                       description="Random search over --lr-range and --clip-range with a random number of trials "
                                   "(mean --trials), each trained on the training data minus a keyed validation part "
                                   "and scored there with a noisy count; only the best trial is output. --epsilon is "
                                   "the budget of the whole search (Papernot & Steinke 2022; docs/privacy.md).")
    add_training_flags(p)
    for action in p._actions:  # every trial draws lr and clip from the ranges below
        if action.dest in ("lr", "clip"):
            action.required, action.default, action.help = False, None, argparse.SUPPRESS
    p.add_argument("--lr-range", nargs=2, type=float, default=None, metavar=("LO", "HI"), required=True,
                   help="log-uniform learning-rate range")
    p.add_argument("--clip-range", nargs=2, type=float, default=None, metavar=("LO", "HI"), required=True,
                   help="log-uniform clip-norm range")
    p.add_argument("--trials", type=float, default=10.0, help="mean number of trials (default 10)")
    p.add_argument("--shape", type=float, default=1.0,
                   help="shape of the trials' truncated negative binomial: 0 logarithmic, 1 geometric (default)")
    p.add_argument("--validation-fraction", type=float, default=0.1, metavar="F",
                   help="fraction of the training data scored (default 0.1)")
    p.add_argument("--score-noise", type=float, default=None, metavar="S",
                   help="std of the noisy validation count (default 1 %% of the validation part, at least 10)")
    p.add_argument("--bands-choices", nargs="+", type=int, default=(), metavar="b",
                   help="numbers of noise bands each trial draws one of, uniformly (default: --bands for every trial); "
                        "one calibration covers them all (the largest of their Renyi DP curves)")
    p.add_argument("--strategy-choices", nargs="+", default=(), metavar="S",
                   help="band coefficient strategies (taylor, optimized) each trial draws one of, uniformly "
                        "(default: --bands-strategy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model initialisation (public)")
    p.add_argument("--out", default=None, metavar="DIR", help="write tune.json and model.pt (best weights) here")
    p.add_argument("--overwrite", action="store_true", help="replace a tuning in --out")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_run)
