"""``tune``: private random search over hyperparameters (Papernot & Steinke, ICLR 2022).

The training data are split once, by a secret keyed draw per example, into a training part and a
validation part. Then K trials run, K ~ a truncated negative binomial of mean ``trials`` drawn from
the tuning's secret key; each samples ``lr`` and ``clip`` log-uniformly from their ranges, trains
with the same noise multiplier z on the training part, and scores the validation part with a
Gaussian-noised count of correct predictions. Only the best trial is released: its hyperparameters,
weights, noisy validation accuracy and test accuracy (the test split is public and plays no part in
the selection). z is calibrated so that the whole tuning, not one trial, meets the target epsilon
(``clipbias.privacy.tuning``). Nothing about the other trials, not even their number, is output: nor the
search's wall time, which grows with the number of trials (the result, tune.json and the summary omit it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .. import algorithms
from ..algorithms.bands import check_strategy
from ..errors import ClipbiasError, ConfigError
from .. import privacy
from ..privacy import tuning
from ..privacy.report import check_epsilon, check_positive
from ..randomness import Purpose, SecretKey, poisson_indices, snapped_gaussian, stream, uint64s
from ..engine import run_steps
from ..sampling.poisson import check_bands
from .build import build_run
from .config import TrainConfig
from .splits import Splits, prepare_splits


@dataclass(frozen=True)
class TuneConfig:
    """A tuning of ``base`` (its data, model, algorithm, epochs, batch size, delta; ``base.epsilon`` is
    the budget of the whole tuning). ``lr_range``/``clip_range``: log-uniform search ranges;
    ``trials``: the mean number of trials; ``shape``: of their truncated negative binomial (0:
    logarithmic, 1: geometric); ``validation``: the fraction of the training data scored;
    ``score_noise``: std of the validation count's noise (default: 1 % of the validation part, at least 10);
    ``bands_choices``/``strategy_choices``: numbers of noise bands and coefficient strategies each trial draws
    one of, uniformly (empty: ``base.bands`` and ``base.bands_strategy`` for every trial)."""

    base: TrainConfig
    lr_range: tuple[float, float]
    clip_range: tuple[float, float]
    trials: float = 10.0
    shape: float = 1.0
    validation: float = 0.1
    score_noise: float | None = None
    bands_choices: tuple[int, ...] = ()
    strategy_choices: tuple[str, ...] = ()

    def __post_init__(self) -> None:  # valid by construction
        if self.base.epsilon is None:
            raise ConfigError("tune needs `epsilon`: the budget of the whole tuning (the trials' noise is calibrated "
                              "to it)")
        check_epsilon(self.base.epsilon)
        algo = algorithms.get(self.base.algo)
        def gaussian(a: algorithms.Algorithm) -> bool:  # accounted as the subsampled Gaussian
            return isinstance(privacy.MECHANISMS.lookup(a.accounting), privacy.SubsampledGaussian)
        if not algo.private or not gaussian(algo):
            covered = ", ".join(n for n, a in algorithms.ALGORITHMS.items() if a.private and gaussian(a))
            raise ConfigError(f"tune accounts the trials with Renyi DP, which covers the Gaussian-accounted "
                              f"algorithms ({covered}); `algo='{self.base.algo}'` "
                              f"is {'not private' if not algo.private else 'accounted by the DiceSGD mixture'}")
        for name, (lo, hi) in (("lr_range", self.lr_range), ("clip_range", self.clip_range)):
            if not (check_positive(lo, name) <= check_positive(hi, name)):
                raise ConfigError(f"`{name}` must be LO HI with 0 < LO <= HI, got {lo!r} {hi!r}")
        if not (isinstance(self.trials, (int, float)) and self.trials >= 1):
            raise ConfigError(f"`trials` (the mean number of trials) must be >= 1, got {self.trials!r}")
        if not (isinstance(self.shape, (int, float)) and self.shape >= 0 and math.isfinite(self.shape)):
            raise ConfigError(f"`shape` must be a finite number >= 0, got {self.shape!r}")
        if not 0 < self.validation < 1:
            raise ConfigError(f"`TuneConfig.validation` must lie in (0, 1), got {self.validation!r}")
        if self.score_noise is not None:
            check_positive(self.score_noise, "score_noise")
        for b in self.bands_choices:
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise ConfigError(f"`bands_choices` must hold whole numbers >= 1, got {self.bands_choices!r}")
            algo.check_bands(b)
        if any(check_strategy(s).accounted_by_shape for s in (*self.strategy_choices, self.base.bands_strategy)):
            raise ConfigError("tune searches banded noise (`bands_strategy` taylor or optimized), not BLT noise: a BLT "
                              "trial's noise multiplier depends on its strategy, which the tuning's one calibration "
                              "does not cover")
        if len(set(self.bands_choices)) != len(self.bands_choices) or \
                len(set(self.strategy_choices)) != len(self.strategy_choices):
            raise ConfigError("`bands_choices` and `strategy_choices` must not repeat a value (each is drawn uniformly)")

    @property
    def bands(self) -> tuple[int, ...]:
        """The numbers of bands a trial draws from."""
        return self.bands_choices or (self.base.bands,)

    @property
    def strategies(self) -> tuple[str, ...]:
        """The coefficient strategies a trial draws from."""
        return self.strategy_choices or (self.base.bands_strategy,)


def split(splits: Splits, fraction: float, key: SecretKey) -> tuple[Splits, torch.Tensor, torch.Tensor]:
    """(the training part as ``Splits``, validation inputs, labels): each training example joins the
    validation part independently with probability ``fraction``, by a keyed draw (the coupling that
    keeps every other example in its part when one is added or removed)."""
    val = torch.zeros(splits.n, dtype=torch.bool)
    val[poisson_indices(key, Purpose.TUNE_SPLIT, 0, splits.n, fraction)] = True
    val = val.to(splits.y_train.device)
    if not 0 < int(val.sum()) < splits.n:
        raise ConfigError("the validation part is empty or holds every example: use more data or another "
                          "`TuneConfig.validation`")
    # the trials' q, steps and noise come from the part's public expected size, not its realised one
    expected = splits.info.get("n_expected", splits.n) * (1 - fraction)
    part = dataclasses.replace(splits, x_train=splits.x_train[~val], y_train=splits.y_train[~val], x_val=None,
                               y_val=None, info={**splits.info, "n": int((~val).sum()), "n_expected": expected})
    return part, splits.x_train[val], splits.y_train[val]


def _uniform(key: SecretKey, purpose: int, step: int, index: int) -> float:
    return (int(uint64s(key, purpose, step, index, 1)[0]) + 0.5) / 2.0 ** 64


def _trial_config(tc: TuneConfig, key: SecretKey, trial: int, z: float | dict[int, float]) -> TrainConfig:
    """The trial's hyperparameters, drawn from the tuning's key at the trial's own addresses (index 2 is
    its training key; 3 and 4 its bands and strategy): lr and clip log-uniform, bands and strategy uniform."""
    u_lr, u_clip = _uniform(key, Purpose.TUNE, 1 + trial, 0), _uniform(key, Purpose.TUNE, 1 + trial, 1)
    (lr0, lr1), (c0, c1) = tc.lr_range, tc.clip_range
    bands = tc.bands[int(_uniform(key, Purpose.TUNE, 1 + trial, 3) * len(tc.bands))]
    strategy = tc.strategies[int(_uniform(key, Purpose.TUNE, 1 + trial, 4) * len(tc.strategies))]
    z = z[bands] if isinstance(z, dict) else z  # the noise multiplier of the trial's bands
    return dataclasses.replace(tc.base, epsilon=None, noise_multiplier=z, out=None, validation=0,
                               lr=lr0 * (lr1 / lr0) ** u_lr, clip=c0 * (c1 / c0) ** u_clip, bands=bands,
                               bands_strategy=strategy)


def tune(tc: TuneConfig, key: SecretKey | None = None, splits: Splits | None = None) -> dict:
    """Run the private random search; returns the best trial (config, weights, accuracies) and the
    tuning's privacy statement. ``key``: the tuning's secret key (default: 256 OS bits)."""
    key = key or SecretKey.generate()
    base = dataclasses.replace(tc.base, validation=0, out=None)
    part, x_val, y_val = split(splits or prepare_splits(base, key=key), tc.validation, key)
    score_std = tc.score_noise if tc.score_noise is not None else max(10.0, 0.01 * len(y_val))
    s, event_of, noise_of = _calibrate(tc, base, part, score_std)
    z = noise_of(s)
    trials = tuning.trial_count(_uniform(key, Purpose.TUNE, 0, 0), tc.trials, tc.shape)
    best = None
    for trial in range(trials):
        cfg = _trial_config(tc, key, trial, z)
        trial_key = SecretKey(stream(key, Purpose.TUNE, 1 + trial, 2, 32).tobytes(), key.reproducible)
        run = build_run(cfg, part, trial_key)
        try:
            run_steps(run.engine, part.x_train, part.y_train)
        except ClipbiasError as err:  # a data-dependent refusal: its message would name positions in the secret split
            raise ConfigError(f"clipbias tune stopped: a trial's step was refused ({type(err).__name__}); the "
                              f"examples it names are not shown, since their positions in the secret training "
                              f"part would reveal the split and that a trial ran. Find them with `clipbias "
                              f"train` on the same data (outside the search), fix the data, and tune again. "
                              f"A refusal is outside the guarantee (docs/privacy.md)") from None
        acc, _ = run.evaluate(x_val, y_val)
        count = torch.tensor([round(acc * len(y_val))], dtype=torch.float64)
        score = float(snapped_gaussian(count, score_std, key, trial, Purpose.TUNE_SCORE)) / len(y_val)
        if best is None or score > best[0]:
            best = (score, cfg, {name: t.detach().cpu().clone() for name, t in run.model.state_dict().items()},
                    run.evaluate(part.x_test, part.y_test)[0])
    score, cfg, weights, test_acc = best
    eps = tuning.tuned_epsilon(event_of(s), score_std, base.delta, tc.trials, tc.shape)
    return {"best": {"lr": cfg.lr, "clip": cfg.clip, "bands": cfg.bands, "bands_strategy": cfg.bands_strategy,
                     "config": cfg.to_dict(), "validation_accuracy": score, "test_accuracy": test_acc},
            "weights": weights, "noise_multiplier": cfg.noise_multiplier, "epsilon": eps, "delta": base.delta,
            **({"noise_multipliers": {str(b): zb for b, zb in z.items()}} if len(z) > 1 else {}),
            "accountant": "rdp", "certified": not key.reproducible,
            "caveats": (["the tuning's key derives from a seed: the guarantee holds only while it stays secret"]
                        if key.reproducible else []),
            "basis": tuning.BASIS.format(shape=tc.shape, mean=tc.trials, score_std=score_std) + (
                f"; each trial draws its noise bands among {', '.join(map(str, tc.bands))}: accounted at the largest "
                f"of their Renyi curves (joint quasi-convexity)" if len(tc.bands) > 1 else ""),
            "secret": ("the number of trials and every other trial's result are not output; the run's duration "
                       "grows with the number of trials, so keep it from the adversary (else account K revealed)"),
            "n_train": part.n, "n_validation": len(y_val),  # no wall time: it grows with K (module docstring)
            "outside_guarantee": [OUTSIDE_SIZES]}


OUTSIDE_SIZES = ("n_train, n_validation: the realised sizes of the keyed validation split are private, since they "
                 "depend on which examples fell where, and are released exactly; the trials' sampling rate, steps "
                 "and noise multiplier come from the public expected size N (1 - validation fraction), and the "
                 "size N of the data as given is declared public")


def _calibrate(tc: TuneConfig, base: TrainConfig, part: Splits, score_std: float):
    """(s, the trials' training events as a function of s, the noise multiplier of each number of bands as a
    function of s) with s calibrated for the tuning's target epsilon. One number of bands: s is the trials'
    noise multiplier. Several: bands b trains at ``s * k_b``, where ``k_b`` is the ratio of the noise
    multiplier a search over b alone would take to that of the first choice (so that no choice is held to
    another's noise), and the search is accounted at the largest of their Renyi curves
    (``tuning.tuned_epsilon``)."""
    algo = algorithms.get(base.algo)
    cfg = base.algo_config()
    expected = part.info["n_expected"]  # public (``split``): the trials' engines use the same q and steps
    q = base.batch_size / expected
    steps = base.epochs * max(1, round(1 / q))
    for b in tc.bands:  # cyclic participation needs b q <= 1 at the trials' rate
        check_bands(b, q)

    def alone(b: int):  # a trial's own accounting with b bands, as a function of its noise multiplier
        return lambda z: algo.spec(cfg, q, z, base.batch_size, b).dp_event(steps)
    calib = {b: tuning.calibrate(alone(b), base.epsilon, base.delta, tc.trials, tc.shape, score_std)
             for b in tc.bands} if len(tc.bands) > 1 else {tc.bands[0]: 1.0}
    ratio = {b: calib[b] / calib[tc.bands[0]] for b in tc.bands}

    def noise_of(s: float) -> dict[int, float]:
        return {b: s * ratio[b] for b in tc.bands}

    def event_of(s: float):  # one event per number of bands (one: the event itself)
        events = [alone(b)(z) for b, z in noise_of(s).items()]
        return events[0] if len(events) == 1 else events
    return tuning.calibrate(event_of, base.epsilon, base.delta, tc.trials, tc.shape, score_std), event_of, noise_of
