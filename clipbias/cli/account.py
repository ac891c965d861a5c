"""``clipbias account`` and ``clipbias calibrate``: privacy accounting without training."""

from __future__ import annotations

import argparse

from typing import TYPE_CHECKING

from ..errors import ConfigError
from ._choices import current
from ._common import emit, warn

if TYPE_CHECKING:
    from ..privacy import AccountingSpec


def _add_common(p: argparse.ArgumentParser) -> None:
    c = current()
    ACCOUNTANTS, DICE_ACCOUNTING = c["accountants"], c["dice_accounting"]
    DEFAULT_DICE_ACCOUNTING, DEFAULT_EF_RATIO = c["default_dice_accounting"], c["default_ef_ratio"]
    p.add_argument("--algo", choices=["dpsgd", "dice"], default="dpsgd",
                   help="dpsgd: Poisson-subsampled Gaussian; dice: DiceSGD (default: dpsgd)")
    p.add_argument("--sample-rate", type=float, required=True, metavar="Q",
                   help="Poisson sampling rate q = B / N")
    p.add_argument("--steps", type=int, required=True, metavar="T", help="number of steps T")
    p.add_argument("--delta", type=float, required=True, metavar="D", help="target delta")
    p.add_argument("--accountant", choices=ACCOUNTANTS, default="pld",
                   help=f"{', '.join(ACCOUNTANTS)} (default: pld, the tightest)")
    p.add_argument("--bands", type=int, default=1, metavar="b",
                   help="dpsgd with b-banded noise (train --bands): the subsampled Gaussian at rate b*q for "
                        "ceil(T/b) steps (default 1)")
    p.add_argument("--bands-strategy", choices=c["bands_strategies"], default=c["default_bands_strategy"],
                   help="taylor and optimized (train --bands-strategy) share the banded accounting; blt: BLT noise "
                        "in b classes (train --bands b --bands-strategy blt), the Gaussian mechanism at the "
                        "strategy's sensitivity, normalised to 1 at these T steps (no amplification)")
    g = p.add_argument_group("DiceSGD (--algo dice)")
    g.add_argument("--clip", type=float, default=1.0, metavar="C1", help="per-example clip C1 (default 1)")
    g.add_argument("--ef-clip", type=float, default=None, metavar="C2",
                   help=f"feedback clip C2 on the average-gradient scale (default {DEFAULT_EF_RATIO:g} C1 / B, "
                        f"feedback ratio r = B C2 / C1 = {DEFAULT_EF_RATIO:g})")
    g.add_argument("--grad-bound", type=float, default=None, metavar="GMAX",
                   help="explicit outer clip of every per-example gradient (the paper basis uses G' = GMAX - C1)")
    g.add_argument("--batch-size", type=float, default=None, metavar="B",
                   help="expected batch size B = qN (needed for dice unless --dataset-size is given)")
    g.add_argument("--dice-accounting", choices=DICE_ACCOUNTING, default=DEFAULT_DICE_ACCOUNTING,
                   help="sound (default): our proof for hidden error feedback (docs/privacy.md); "
                        "conservative: the same without amplification (looser); paper: the paper's Thm 3.8 "
                        "and authors: the authors' protocol, both REFUTED by a canary attack "
                        "(certified = false, reproduction only)")
    p.add_argument("--dataset-size", type=int, default=None, metavar="N",
                   help="dataset size N (for the delta >= 1/N warning and B = qN)")
    p.add_argument("--json", action="store_true", help="print JSON on stdout")


def _spec(args: argparse.Namespace, z: float) -> AccountingSpec:
    from ..privacy import AccountingSpec, DiceParams, delta_warning
    from ..privacy.dice import default_ef_clip
    from ..privacy.report import check_delta, check_positive, check_rate, check_steps
    q = check_rate(args.sample_rate, "sample_rate")
    check_steps(args.steps, "steps")
    check_delta(args.delta, "delta")
    if args.dataset_size is not None and args.dataset_size < 1:
        raise ConfigError(f"--dataset-size must be >= 1, got {args.dataset_size}")
    warn(delta_warning(args.delta, args.dataset_size))
    if args.algo == "dpsgd":
        plain = AccountingSpec("gaussian", q, z, "per-example L2 sensitivity C (clip)")
        if args.bands == 1 and args.bands_strategy not in current()["shape_accounted_strategies"]:
            return plain  # banded_spec(plain, 1), and the accounting imports no torch (1.5 s of a 3 s calibration)
        from ..algorithms.bands import banded_spec, noise_strategy
        from ..sampling.poisson import check_bands
        strategy = noise_strategy(args.bands_strategy)
        check_bands(args.bands, q)
        # a strategy that its accounting reads (BLT) is normalised to sensitivity 1 at T steps: the epsilon after T
        # steps is the same for any momentum it is shaped for; the banded accounting reads only the bands
        shape = strategy.shape(args.bands, 0.0, args.steps) if strategy.accounted_by_shape else None
        return banded_spec(plain, args.bands, shape)
    if args.bands != 1 or args.bands_strategy != current()["default_bands_strategy"]:
        raise ConfigError("--bands and --bands-strategy apply to --algo dpsgd (banded and BLT noise are not "
                          "accounted for DiceSGD)")
    check_positive(args.clip, "clip")
    if args.ef_clip is not None:
        check_positive(args.ef_clip, "ef_clip")
    if args.grad_bound is not None:
        check_positive(args.grad_bound, "grad_bound")
    b = args.batch_size
    if b is None:
        if args.dataset_size is None:
            raise ConfigError("--batch-size B (or --dataset-size N, giving B = qN) is required for --algo dice")
        b = q * args.dataset_size
    check_positive(b, "batch_size")
    c2 = args.ef_clip if args.ef_clip is not None else default_ef_clip(args.clip, b)
    return AccountingSpec("dice", q, z, "DiceSGD", DiceParams(q, 1, args.clip, c2, b, args.grad_bound))


def _run_account(args: argparse.Namespace) -> int:
    from ..privacy import account
    z = args.noise_multiplier
    if not (z is not None and z > 0):
        raise ConfigError(f"--noise-multiplier must be > 0, got {z!r}")
    rep = account(_spec(args, z), args.steps, args.delta, args.accountant, args.dice_accounting)
    emit(rep.to_dict(), args.json)
    return 0


def _run_calibrate(args: argparse.Namespace) -> int:
    from ..privacy import account, calibrate
    from ..privacy.gaussian import floor_note
    eps = args.epsilon
    if not (eps is not None and eps > 0):
        raise ConfigError(f"--epsilon must be > 0, got {eps!r}")
    spec = _spec(args, 0.0)
    z = calibrate(spec, eps, args.delta, args.steps, args.accountant, args.dice_accounting)
    from dataclasses import replace
    rep = account(replace(spec, noise_multiplier=z), args.steps, args.delta, args.accountant,
                  args.dice_accounting)
    emit({"noise_multiplier": z, **rep.to_dict()}, args.json)
    warn(floor_note(eps, rep.epsilon, z, args.accountant))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("account", help="epsilon of a configuration (no training)",
                       description="Epsilon after T steps for a given noise multiplier.")
    p.add_argument("--noise-multiplier", type=float, required=True, metavar="Z",
                   help="noise std / per-example sensitivity")
    _add_common(p)
    p.set_defaults(func=_run_account)

    c = sub.add_parser("calibrate", help="noise multiplier for a target epsilon",
                       description="Smallest noise multiplier whose epsilon after T steps is at most the target.")
    c.add_argument("--epsilon", type=float, required=True, metavar="E", help="target epsilon")
    _add_common(c)
    c.set_defaults(func=_run_calibrate)
