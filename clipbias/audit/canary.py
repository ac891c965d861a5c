"""The canary audit: a white-box Monte-Carlo distinguishing test (docs/privacy.md, "Audits").


* datasets: D = {} and D' = {canary} (add/remove-one neighbours; the normaliser is the expected
  batch size B as in every run, and q the Poisson rate);
* the canary's per-example gradient is a fixed vector of norm ``canary_norm`` (a worst case for
  clipping; for error feedback it saturates the hidden buffer), the only gradient in the run;
* the mechanism is the algorithm's own ``Pipeline`` (the same stage objects a ``DPEngine`` step
  runs), driven with a leading axis of independent trials: Poisson inclusion of the canary,
  per-example stages, aggregation by B, error feedback, Gaussian noise;
* the adversary sees every released noisy update and thresholds a statistic fixed in advance
  (``_Statistic``): the summed projection ``S = sum_t s_t u_t / (sigma sqrt(T))`` (N(0, 1) under D for
  a noise-only run) or the per-step likelihood ratio of the subsampled Gaussian (``statistic="lr"``);
* crafted gradients (white-box): the canary's gradient sign per step follows ``schedule``
  (``gradient_signs``), and an anti-canary (``anti_norm``), an example of both worlds whose gradient
  opposes the canary's, drives hidden state (a clipped feedback buffer) the other way under D;
* epsilon lower bound: for thresholds on a grid fixed in advance, Clopper-Pearson bounds on the
  false-positive and true-positive rates in both directions, Bonferroni-corrected for every bound
  used, ``eps >= ln((TPR_lo - delta) / FPR_hi)``; the best threshold is reported
  (``clipbias.audit.stats.epsilon_lower_bound``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from .. import algorithms, privacy
from ..algorithms.bands import NoiseStrategy, coefficients, noise_strategy
from ..config import AlgoConfig
from ..errors import ConfigError
from ..privacy.report import check_delta, check_positive, check_rate, check_steps
from ..randomness import SecretKey
from ..sampling.poisson import band_rate, check_bands
from ..step import Pipeline, StepContext
from . import banded
from .stats import epsilon_lower_bound, gdp_epsilon_lower_bound

STATISTICS = ("sum", "lr")
SCHEDULES = ("constant", "charge-drain")


@dataclass(frozen=True)
class CanaryAudit:
    """One canary audit: the mechanism's settings, the claim to test, and the experiment's size."""

    algo: str
    noise_multiplier: float               # z the mechanism runs at
    sample_rate: float
    steps: int
    batch_size: float                     # expected batch size B (the normaliser)
    clip: float = 1.0
    ef_clip: float | None = None          # C2 (DiceSGD family); default as in DPEngine
    grad_bound: float | None = None
    gamma: float = 0.01
    dice_accounting: str = privacy.DEFAULT_DICE_ACCOUNTING
    delta: float = 1e-5
    claim_noise_multiplier: float | None = None  # the claim is computed at this z (default: z)
    canary_norm: float | None = None      # default: grad_bound, else 1e4 * clip
    trials: int = 4000
    confidence: float = 0.95
    seed: int = 0
    extra: dict = field(default_factory=dict)
    statistic: str = "sum"                # sum | lr (see ``statistic``)
    schedule: str = "constant"            # the canary's gradient per step (see ``gradient_signs``)
    anti_norm: float | None = None        # an anti-canary in both worlds: gradient -anti_norm x the canary's
    bands: int = 1                        # banded noise (``clipbias.algorithms.bands``): b bands, b classes
    band_class: int | None = None         # the canary's class, known to the adversary (None: drawn per run)
    band_momentum: float = 0.0            # the momentum the band coefficients are shaped for
    bands_strategy: str = "taylor"        # taylor (canary mode); blt: BLT noise (white-box one-run mode only)

    def __post_init__(self) -> None:
        check_positive(self.noise_multiplier, "noise_multiplier")
        check_rate(self.sample_rate)
        check_steps(self.steps)
        check_positive(self.batch_size, "batch_size")
        check_delta(self.delta)
        if self.claim_noise_multiplier is not None:
            check_positive(self.claim_noise_multiplier, "claim_noise_multiplier")
        if self.canary_norm is not None:
            check_positive(self.canary_norm, "canary_norm")
        if not (isinstance(self.trials, int) and self.trials >= 10):
            raise ConfigError(f"`trials` must be an integer >= 10, got {self.trials!r}")
        if not 0 < self.confidence < 1:
            raise ConfigError(f"`confidence` must lie in (0, 1), got {self.confidence!r}")
        if self.statistic not in STATISTICS:
            raise ConfigError(f"`statistic` must be one of {', '.join(STATISTICS)}, got {self.statistic!r}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"`schedule` must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.anti_norm is not None:
            check_positive(self.anti_norm, "CanaryAudit.anti_norm")
        check_bands(self.bands, self.sample_rate)
        algorithms.get(self.algo).check_bands(self.bands)
        if self.band_class is not None and not (isinstance(self.band_class, int) and 0 <= self.band_class < self.bands):
            raise ConfigError(f"`band_class` must be a whole number in [0, `bands`) = [0, {self.bands}), "
                              f"got {self.band_class!r}")
        self.basis  # noqa: B018  (checked here, where the setting enters)
        if self.bands < self.strategy.min_bands:
            raise ConfigError(f"`bands_strategy={self.strategy.name!r}` needs `bands` >= {self.strategy.min_bands} "
                              f"participation classes")
        if self.bands > 1 and self.anti_norm is not None:
            raise ConfigError("`CanaryAudit.anti_norm` drives hidden state across steps; the bandable algorithms have none: "
                              "audit banded noise without it")

    @property
    def basis(self) -> privacy.DiceBasis:
        """The error-feedback basis whose claim is tested (``dice_accounting``, checked when made)."""
        return privacy.dice.basis(self.dice_accounting)

    @property
    def strategy(self) -> NoiseStrategy:
        """The ``algorithms.bands.NoiseStrategy`` of ``bands_strategy`` (a ConfigError for an unknown one)."""
        return noise_strategy(self.bands_strategy)

    def algo_config(self) -> AlgoConfig:
        cfg = AlgoConfig(lr=1.0, clip=self.clip, ef_clip=self.ef_clip, grad_bound=self.grad_bound,
                         gamma=self.gamma, extra=dict(self.extra))
        return algorithms.get(self.algo).with_defaults(cfg, self.batch_size)

    @property
    def norm(self) -> float:
        if self.canary_norm is not None:
            return self.canary_norm
        return self.grad_bound if self.grad_bound is not None else 1e4 * self.clip


def check_batched(name: str) -> algorithms.Algorithm:
    """The algorithm, if its rows are per-example gradients mapped row by row (what the batched
    canary simulation drives); a ConfigError naming the reason otherwise."""
    algo = algorithms.get(name)
    if not algo.private:
        raise ConfigError(f"`algo='{name}'` is not private (epsilon = inf): there is no claim to audit")
    if algo.source is not None:  # group means, momenta over past iterates, augmentations
        raise ConfigError(f"`algo='{name}'` computes its rows with its own backend (groups, momentum over "
                          f"past iterates, augmentations or DiSK's two points), which the batched canary simulation does not "
                          f"drive; audit it with --mode one-run")
    if getattr(algo.parts(AlgoConfig()).per_sample[-1], "dynamic", False):
        raise ConfigError(f"`algo='{name}'` moves its clip with a released count of unclipped rows, one count per "
                          f"run: the batched simulation's leading axis of independent runs does not carry it; audit "
                          f"it with --mode one-run")
    return algo


def gradient_signs(audit: CanaryAudit) -> np.ndarray:
    """The sign of the canary's gradient at each step, fixed before the runs (white-box: the adversary
    crafts its gradient per step). ``constant``: +1 throughout; ``charge-drain``: +1 in the first half,
    -1 in the second (it charges a hidden buffer or momentum, then pushes it the other way)."""
    signs = np.ones(audit.steps)
    if audit.schedule == "charge-drain":
        signs[audit.steps // 2:] = -1.0
    return signs


def simulate(audit: CanaryAudit, with_canary: bool, *, progress: bool = False) -> np.ndarray:
    """The statistic S of ``audit.trials`` independent runs, with or without the canary.

    The canary's gradient at step t is ``gradient_signs(audit)[t] * norm`` (one parameter); an
    anti-canary (``anti_norm``) is in both worlds with the opposite gradient. Each example is in a
    step's batch independently with probability q, its rows through every per-example stage of a
    ``DPEngine`` step, the sum through feedback and noise."""
    algo = check_batched(audit.algo)
    cfg = audit.algo_config()
    trials = audit.trials
    seed = audit.seed * 2 + int(with_canary)
    # the audit is an experiment, not a release: its mechanism runs under a key from its own seed
    pipe = algo.pipeline(cfg, audit.batch_size, audit.noise_multiplier, SecretKey.from_seed(seed),
                         coefficients(audit.bands, audit.band_momentum))
    if pipe.noise is None or pipe.noise.std <= 0:
        raise ConfigError(f"`algo='{audit.algo}'`: its pipeline adds no noise")
    sigma = pipe.noise.std
    gen = torch.Generator().manual_seed(seed + (1 << 40))
    signs = gradient_signs(audit)
    members = ([float(audit.norm)] if with_canary else []) + \
        ([-float(audit.anti_norm)] if audit.anti_norm is not None else [])
    rate, b = band_rate(audit.bands, audit.sample_rate), audit.bands
    # each member's class (bands > 1): drawn once per run, as the sampler does, or the adversary's fixed one
    classes = [torch.full((trials, 1), audit.band_class) if audit.band_class is not None
               else torch.randint(0, b, (trials, 1), generator=gen) for _ in members] if b > 1 else None
    score = _Statistic(audit, pipe, sigma, signs)
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=audit.steps, unit="step", mininterval=1.0, leave=False,
                   desc=f"{'D' + chr(39) if with_canary else 'D'} ({trials} runs)")
    for t in range(audit.steps):
        proc, ref = torch.zeros(trials, 1), torch.zeros(trials, 1)
        # D = {anti-canary if any}; D' adds the canary: each in the batch with probability q
        for i, g in enumerate(members):
            r, p = pipe.rows(torch.full((trials, 1, 1), g * signs[t]), StepContext(None, t))  # a DPEngine step's stages
            inc = (torch.rand(trials, 1, generator=gen, dtype=torch.float64) < rate).float()
            if classes is not None:  # cyclic Poisson participation (classes mod b): only the steps of its class
                inc = inc * (classes[i] == t % b).float()
            proc += p * inc
            ref = ref + (r * inc if r is not None else 0)
        # the released noisy update (before post-processing)
        u = Pipeline.finish(pipe, proc, ref if pipe.error_feedback is not None else None)
        pipe.commit()
        score.add(t, u[:, 0])
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    return score.value()


def step_llr(u: torch.Tensor, c, sigma, q: float) -> torch.Tensor:
    """log P(u | the canary's contribution c is in the step with probability q) / P(u | it is not),
    for a release u = (contribution) + N(0, sigma^2): log(1 - q + q exp((c u - c^2 / 2) / sigma^2))."""
    z = (c * u.double() - c * c / 2) / sigma ** 2
    base = torch.full_like(z, math.log1p(-q) if q < 1 else -math.inf)
    return torch.logaddexp(base, z + math.log(q))


class _Statistic:
    """The adversary's test statistic over the released updates u_t, standardised so that it is about
    N(0, 1) under D without an anti-canary (the thresholds are a grid in those units).

    * ``sum``: ``sum_t s_t u_t / (sigma sqrt(T))``, s_t the canary's sign: the optimal test for a shift
      that persists (an error-feedback buffer);
    * ``lr``: ``sum_t log(1 - q + q exp((c_t u_t - c_t^2 / 2) / sigma^2))``, c_t = s_t b / divisor the
      canary's clipped contribution: the log-likelihood ratio of a step of the subsampled Gaussian
      (Neyman-Pearson optimal for DPSGD's Dirac canary); centred and scaled by its mean and standard
      deviation under u_t ~ N(0, sigma^2) (Gauss-Hermite quadrature, not the runs).

    With banded noise (``bands`` > 1) the updates are first turned back into the releases y = C u
    (``banded.releases``); ``sum`` is then the matched sum ``(C s)^T y / (sigma ||C s||)`` and ``lr`` the
    likelihood ratio of the canary's participation blocks at rate b q, of its known class
    (``band_class``) or averaged over the classes (``banded``).
    """

    def __init__(self, audit: CanaryAudit, pipe: Pipeline, sigma: float, signs: np.ndarray) -> None:
        self.kind, self.q, self.sigma, self.signs = audit.statistic, audit.sample_rate, sigma, signs
        self.total = torch.zeros(audit.trials, dtype=torch.float64)
        last = pipe.per_sample[-1] if pipe.per_sample else None
        bound = getattr(last, "bound", None)
        self.c = min(float(audit.norm), float(bound) if bound else float(audit.norm)) / pipe.divisor
        self.bands, self.band_class = audit.bands, audit.band_class
        if self.bands > 1:
            self.coefs, self.updates = pipe.noise.coefs, []
            return
        if self.kind == "lr":
            x, w = np.polynomial.hermite_e.hermegauss(80)  # E f(Z), Z ~ N(0, 1)
            llr = self._llr(torch.from_numpy(x * sigma), 1.0).numpy()
            w = w / w.sum()
            self.mean = float(w @ llr)
            self.std = float(np.sqrt(w @ (llr - self.mean) ** 2))

    def _llr(self, u: torch.Tensor, sign: float) -> torch.Tensor:
        return step_llr(u, sign * self.c, self.sigma, self.q)

    def add(self, t: int, u: torch.Tensor) -> None:
        if self.bands > 1:
            self.updates.append(u.double().clone())
            return
        self.total += self.signs[t] * u.double() if self.kind == "sum" else self._llr(u, self.signs[t])

    def value(self) -> np.ndarray:
        T = len(self.signs)
        if self.bands > 1:
            return banded_statistic(self.kind, torch.stack(self.updates), self.signs, self.coefs, self.sigma,
                                    self.c, band_rate(self.bands, self.q), self.band_class).numpy()
        if self.kind == "sum":
            return (self.total / (self.sigma * math.sqrt(T))).numpy()
        return ((self.total - T * self.mean) / (self.std * math.sqrt(T))).numpy()


def banded_statistic(kind: str, updates: torch.Tensor, signs: np.ndarray, coefs, sigma: float, c: float,
                     rate: float, band_class: int | None = None) -> torch.Tensor:
    """The statistic ``kind`` (sum | lr) of each column of ``updates`` (T x m: the updates the optimizer
    received under banded noise of coefficients ``coefs``), for a canary of contribution ``s_t c``
    joining the steps of its class at ``rate``; standardised (exactly N(0, 1) for ``sum``, by its
    Gauss-Hermite moments for ``lr``) under a noise-only run."""
    y = banded.releases(updates, coefs)
    if kind == "sum":
        return banded.matched_sum(y, signs, coefs, sigma)
    b, T = len(coefs), len(signs)
    per_class = banded.class_llr(y, torch.from_numpy(np.asarray(signs, dtype=np.float64)) * c, coefs, sigma, rate, b)
    stat = per_class[band_class] if band_class is not None else banded.mixture_llr(per_class)
    mean, std = banded.null_moments(T, coefs, sigma, c, rate, b, band_class)
    return (stat - mean) / std


def claim(audit: CanaryAudit) -> privacy.PrivacyReport:
    """What the library states for this configuration (at ``claim_noise_multiplier`` if given)."""
    algo = algorithms.get(audit.algo)
    z = audit.claim_noise_multiplier or audit.noise_multiplier
    spec = algo.spec(audit.algo_config(), audit.sample_rate, z, audit.batch_size, audit.bands)
    return privacy.account(spec, audit.steps, audit.delta, "pld", audit.basis)


def canary_audit(audit: CanaryAudit, *, progress: bool = False) -> dict:
    """Run the canary audit and compare with the claim. Returns the JSON-able result."""
    if audit.strategy.optimised:
        raise ConfigError(f"the canary audit simulates banded noise with the Taylor coefficients, not "
                          f"`bands_strategy='{audit.strategy.name}'`: audit BLT noise with clipbias.audit.blt.blt_audit "
                          f"(or the white-box one-run audit)")
    rep = claim(audit)
    null = simulate(audit, False, progress=progress)
    alt = simulate(audit, True, progress=progress)
    lb = epsilon_lower_bound(null, alt, audit.delta, audit.confidence)
    refuted = lb["epsilon_lower_bound"] > rep.epsilon
    return {
        **lb, **gdp_epsilon_lower_bound(null, alt, audit.delta, audit.confidence),
        "epsilon_claimed": rep.epsilon, "certified": rep.certified, "basis": rep.basis,
        "refuted": refuted, "confidence": audit.confidence, "method": "canary",
        "trials": audit.trials, "delta": audit.delta,
        "mean_shift": float(alt.mean() - null.mean()), "statistic": audit.statistic, "schedule": audit.schedule,
        "anti_norm": audit.anti_norm, "bands": audit.bands, "band_class": audit.band_class,
        "settings": {k: v for k, v in asdict(audit).items() if k != "extra"},
    }

