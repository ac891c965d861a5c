"""``clipbias audit``: an experiment that can refute a privacy claim (docs/privacy.md, "Audits")."""

from __future__ import annotations

import argparse

from ..errors import ConfigError
from ._choices import current
from ._common import emit


def _canary(args: argparse.Namespace) -> dict:
    from .. import audit
    from ..algorithms.bands import noise_strategy
    if noise_strategy(args.bands_strategy).accounted_by_shape and args.mode == "canary":
        from ..audit.blt import BLTAudit, blt_audit
        if args.algo != "dpsgd":
            raise ConfigError("--bands-strategy blt in the canary mode audits the noise stage through dpsgd's engine "
                              "(every bandable algorithm releases through the same stage): use --algo dpsgd")
        return blt_audit(BLTAudit(classes=args.bands, steps=args.steps, noise_multiplier=args.noise_multiplier,
                                  band_class=args.band_class or 0, runs=args.trials, momentum=args.momentum,
                                  delta=args.delta, confidence=args.confidence, seed=args.seed))
    a = audit.CanaryAudit(
        algo=args.algo, noise_multiplier=args.noise_multiplier, sample_rate=args.sample_rate,
        steps=args.steps, batch_size=args.batch_size, clip=args.clip, ef_clip=args.ef_clip,
        grad_bound=args.grad_bound, gamma=args.gamma, dice_accounting=args.dice_accounting,
        delta=args.delta, claim_noise_multiplier=args.claim_noise_multiplier, canary_norm=args.canary_norm,
        trials=args.trials, confidence=args.confidence, seed=args.seed, statistic=args.statistic,
        schedule=args.schedule, anti_norm=args.anti_canary, bands=args.bands, band_class=args.band_class,
        band_momentum=args.momentum if args.bands > 1 else 0.0, bands_strategy=args.bands_strategy)
    if args.mode == "one-run-ideal":
        from ..audit.white_box import white_box_one_run
        return white_box_one_run(a, args.canaries)
    return audit.canary_audit(a, progress=not args.quiet)


def _run(args: argparse.Namespace) -> int:
    if args.band_class is not None and args.mode != "canary":
        raise ConfigError(f"--band-class fixes the canary's class in the canary mode; in --mode {args.mode} the "
                          f"engine's sampler draws every canary's class (leave --band-class out)")
    from ..algorithms.bands import noise_strategy
    strategy = noise_strategy(args.bands_strategy)
    if strategy.optimised and args.mode == "one-run":
        raise ConfigError(f"--bands-strategy {strategy.name}: audit it with --mode canary (blt) or one-run-ideal")
    if strategy.optimised and not strategy.accounted_by_shape:
        raise ConfigError(f"--bands-strategy {strategy.name} has the Taylor coefficients' accounting: audit --bands "
                          f"with the default strategy")
    if args.mode in ("canary", "one-run-ideal"):
        if args.batch_size is None and not (strategy.accounted_by_shape and args.mode == "canary"):
            raise ConfigError("--batch-size B (the expected batch size, the update's normaliser) is required")
        res = _canary(args)
    else:
        from ..audit.one_run import run_from_args
        res = run_from_args(args)
    if args.json:
        emit(res, True)
        return 0
    verdict = ("REFUTED: the attack's lower bound exceeds the claim" if res["refuted"] else
               "not refuted (an audit can only refute; a passing audit is not a proof)")
    emit({"algo": args.algo, "method": res["method"],
          "epsilon lower bound": f"{res['epsilon_lower_bound']:.4g} (at {res['confidence']:.0%} confidence, "
                                 f"delta {res['delta']:g})",
          **({"epsilon lower bound, f-DP": f"{res['epsilon_lower_bound_fdp']:.4g} (Gaussian trade-off curve with "
                                           f"the claim's (eps, delta); does not decide the verdict)"}
             if "epsilon_lower_bound_fdp" in res else {}),
          **({"epsilon lower bound, GDP": f"{res['epsilon_lower_bound_gdp']:.4g} (mu >= {res['mu_lower_bound']:.4g}: "
                                          f"Gaussian trade-off curve; does not decide the verdict)"}
             if "epsilon_lower_bound_gdp" in res else {}),
          "epsilon claimed": f"{res['epsilon_claimed']:.4g}",
          "certified": str(res["certified"]).lower(), "basis": res["basis"],
          "verdict": verdict,
          **({"trials": f"{res['trials']} per world"} if "trials" in res else {"canaries": res["canaries"]})},
         False)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "audit", help="empirical privacy audit: a lower bound on epsilon that can refute a claim",
        description="Run a distinguishing attack against an algorithm and compare its epsilon lower bound "
                    "(Clopper-Pearson, Bonferroni-corrected) with the epsilon the library claims. "
                    "canary (default): white-box Monte-Carlo test, D = {} vs D' = {canary}, the "
                    "algorithm's own pipeline stages over --trials independent runs per world. "
                    "one-run: Steinke, Nasr & Jagielski (2023), m canaries in one training run, also reporting the "
                    "f-DP bound of Mahloujifar, Melis & Chaudhuri (2024).")
    p.add_argument("--algo", required=True, metavar="NAME", help="the algorithm to audit (e.g. dpsgd, dice)")
    p.add_argument("--mode", choices=("canary", "one-run", "one-run-ideal"), default="canary",
                   help="canary (default): thousands of runs per world through the algorithm's own stages; "
                        "one-run: canaries inside one real training run; one-run-ideal: one white-box training "
                        "run of the algorithm's own engine on --canaries Dirac canaries (their own coordinates, "
                        "no other data, B = q x the included canaries), every update seen, scored by --statistic")
    p.add_argument("--noise-multiplier", type=float, required=True, metavar="Z",
                   help="the noise multiplier the mechanism runs at")
    p.add_argument("--claim-noise-multiplier", type=float, default=None, metavar="Z2",
                   help="compute the claimed epsilon at Z2 while the mechanism runs at Z (catches an "
                        "implementation that adds less noise than it claims)")
    p.add_argument("--sample-rate", type=float, required=True, metavar="Q", help="Poisson sampling rate q")
    p.add_argument("--steps", type=int, required=True, metavar="T", help="number of steps T")
    p.add_argument("--batch-size", type=float, default=None, metavar="B",
                   help="expected batch size B (canary mode: the normaliser of the update)")
    p.add_argument("--clip", type=float, default=1.0, metavar="C1", help="per-example clipping norm C1 (default 1)")
    p.add_argument("--ef-clip", type=float, default=None, metavar="C2",
                   help="DiceSGD feedback clip (default 0.01 C1 / B, as in training)")
    p.add_argument("--grad-bound", type=float, default=None, metavar="G",
                   help="outer clip of every per-example gradient (also the canary's norm by default)")
    p.add_argument("--gamma", type=float, default=0.01, help="normalisation constant (normalized, dice-auto)")
    p.add_argument("--dice-accounting", choices=current()["dice_accounting"], default=current()["default_dice_accounting"],
                   help="the DiceSGD basis whose claim is tested (default sound)")
    p.add_argument("--delta", type=float, default=1e-5, help="delta of the claim and the bound (default 1e-5)")
    p.add_argument("--trials", type=int, default=4000, metavar="N",
                   help="canary mode: independent runs per world (default 4000)")
    p.add_argument("--canary-norm", type=float, default=None, metavar="G",
                   help="canary mode: the canary gradient's norm (default --grad-bound, else 1e4 C1)")
    p.add_argument("--statistic", choices=current()["audit_statistics"], default="sum",
                   help="canary mode: the test statistic over the released updates: sum (the summed projection, "
                        "optimal for a persistent shift such as a feedback buffer) or lr (the per-step likelihood "
                        "ratio of the subsampled Gaussian, optimal for DPSGD's canary)")
    p.add_argument("--schedule", choices=current()["audit_schedules"], default="constant",
                   help="canary mode: the canary's crafted gradient per step: constant, or charge-drain (+g in the "
                        "first half of the steps, -g in the second)")
    p.add_argument("--anti-canary", type=float, default=None, metavar="NORM",
                   help="canary mode: add to both worlds an example whose gradient opposes the canary's, of this "
                        "norm (it drives a clipped feedback buffer the other way under D)")
    p.add_argument("--canaries", type=int, default=1000, metavar="M",
                   help="one-run mode: number of canaries, each included with probability 1/2")
    p.add_argument("--canary-type", choices=("gradient", "input"), default="gradient",
                   help="one-run mode: white-box Dirac gradient canaries or black-box input canaries")
    p.add_argument("--data", default="fashion-mnist", help="one-run mode: data set")
    p.add_argument("--model", default="cnn", help="one-run mode: model")
    p.add_argument("--lr", type=float, default=None, help="one-run mode: learning rate (default 4)")
    p.add_argument("--momentum", type=float, default=0.9,
                   help="one-run mode: SGD momentum of the base optimizer (default 0.9; inner-outer needs 0); "
                        "with --bands, every mode: the momentum the band coefficients are shaped for")
    p.add_argument("--subset", type=int, default=None, metavar="N",
                   help="one-run mode: train on the first N training examples (plus the included canaries)")
    p.add_argument("--grad-path", choices=("rows", "fast", "auto"), default="auto",
                   help="one-run mode: how the per-example norms are computed, as in `clipbias train` (audit the "
                        "fast path with --grad-path fast --canary-type input)")
    p.add_argument("--bands", type=int, default=1, metavar="b",
                   help="banded correlated noise with b bands and cyclic Poisson participation, as in `clipbias "
                        "train --bands` (default 1: independent noise); the coefficients are shaped for --momentum; "
                        "the adversary scores the releases y = C u recovered from the updates")
    p.add_argument("--bands-strategy", choices=current()["bands_strategies"], default=current()["default_bands_strategy"],
                   help="with --bands: blt audits BLT noise in b classes (train --bands-strategy blt): canary mode, "
                        "the noise stage with the canary at every step of its class (--band-class, default 0; "
                        "--trials runs per world); one-run-ideal, the engine with the canaries' classes unknown "
                        "to the adversary")
    p.add_argument("--band-class", type=int, default=None, metavar="L",
                   help="canary mode with --bands: the canary's participation class, fixed and known to the "
                        "adversary (default: drawn per run, unknown, as the sampler draws it)")
    p.add_argument("--confidence", type=float, default=0.95,
                   help="confidence of the lower bound (default 0.95; Bonferroni over every bound used)")
    p.add_argument("--seed", type=int, default=0, help="seed of the experiment (the audit's own randomness)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print JSON on stdout")
    p.set_defaults(func=_run)
