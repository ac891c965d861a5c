"""Privacy accounting for DiceSGD (Zhang, Bu, Wu, Hong): four bases. See docs/privacy.md.

Units (resolved explicitly; the paper mixes them): C1 clips each per-example gradient; C2 clips the
feedback buffer e, which lives on the scale of the *average* gradient (v = (1/B) sum clip(g_i, C1)
+ clip(e, C2)). The noise added to v is ``N(0, sigma1^2 I)`` with ``sigma1 = z * C1 / B``: z is the
multiplier relative to one example's clipped contribution, exactly as in DPSGD-GC, and
``r = B C2 / C1`` is the feedback bound in units of one example's contribution.

* ``sound`` (default; our proof: docs/privacy.md, "`--dice-accounting sound` (default): the
  proof"): conditioned on the released history, adding one example moves the mean of the released update by
  ``1[example sampled now] a + b`` with ``||a|| <= C1/B`` (a fresh Poisson inclusion) and
  ``||b|| <= 2 C2`` (two clipped buffers, whatever the hidden state). Each step is dominated by the
  mixture ``(1-q) N(2r, z^2) + q N(2r + 1, z^2)`` against ``N(0, z^2)`` (units of C1/B), composed T
  times by dp-accounting's PLD accountant (``MixtureOfGaussiansDpEvent``), both adjacency directions.
* ``conservative``: the same argument without the mixture: T adaptive Gaussians whose means differ
  by at most ``C1/B + 2 C2`` (never below ``sound``).
* ``paper``: the paper's Theorem 3.8 (App. A.2 eq. (25)), kept to reproduce the paper only. It is
  **refuted** by a canary attack (``clipbias audit``; docs/privacy.md): ``certified = False``.
* ``authors``: the authors' experimental protocol ``z_DPSGD * sqrt(1 + 2 r)``; not a proof and
  refuted by the same attack: ``certified = False``.
"""

from __future__ import annotations

import abc
import functools
import math
from dataclasses import dataclass

import numpy as np
from dp_accounting import dp_event

from ..errors import ConfigError, PrivacyAccountingError
from ..registry import Registry
from . import gaussian, pld, search
from .report import (PrivacyReport, check_accountant, check_delta, check_epsilon, check_positive, check_rate,
                     check_steps)

DEFAULT_DICE_ACCOUNTING = "sound"
RENAMED = {"certified": "paper"}  # old name -> new name (the old default was the refuted bound)
DEFAULT_EF_RATIO = 0.01  # default feedback ratio r = B C2 / C1 (docs/algorithms/dicesgd.md, "Defaults")
_ALPHAS = 1.0 + np.geomspace(1e-3, 1e4, 6000)
# PLD discretisation of the sound bound: pessimistic (an upper bound on epsilon at any interval);
# 1e-3 is within 0.03% of 1e-4 on the configurations in docs/privacy.md and 10x faster.
SOUND_DISCRETIZATION = 1e-3
# The calibration's stand-in grid for the sound bound: pessimistic too (larger epsilons), 10x coarser and
# about 8x cheaper than SOUND_DISCRETIZATION, so it only aims the search (its epsilon is 4% high at
# epsilon 3, q = 256/60000, T = 2340; at epsilon 1 and r = 0.1 its z is 40% high).
SOUND_COARSE = 1e-2
PAPER_MIN_NOISE = 8.0  # the paper's Lemma A.11 needs z / 2 >= 4: its bound never applies below
_SOUND_PLD_MAX_SHIFT = 5.0  # feedback shift 2r/z above which the sound bound uses the conservative GDP formula


def check_basis(method: str | DiceBasis) -> str:
    """The name of the DiceSGD accounting basis ``method`` spells, or a ConfigError that names the valid ones."""
    return basis(method).name


def default_ef_clip(clip: float, batch_size: float, ratio: float = DEFAULT_EF_RATIO) -> float:
    """C2 = r C1 / B: the feedback clip giving the feedback ratio r (default 0.01)."""
    return ratio * clip / batch_size


@dataclass(frozen=True)
class DiceParams:
    """The quantities DiceSGD's accounting depends on (units: see the module docstring)."""

    sample_rate: float
    steps: int
    clip: float                  # C1
    ef_clip: float               # C2, on the average-gradient scale
    batch_size: float            # B = q N, the expected batch size
    grad_bound: float | None = None  # G_max: explicit outer clip of every per-example gradient

    def __post_init__(self) -> None:
        check_rate(self.sample_rate)
        check_steps(self.steps)
        check_positive(self.clip, "DiceParams.clip")
        check_positive(self.ef_clip, "DiceParams.ef_clip")
        check_positive(self.batch_size, "DiceParams.batch_size")
        if self.grad_bound is not None:
            check_positive(self.grad_bound, "DiceParams.grad_bound")

    @property
    def g_prime(self) -> float | None:
        """G' = max(0, G_max - C1): bound on ||g_i - clip(g_i, C1)|| (paper: G + sigma - C1)."""
        return None if self.grad_bound is None else max(0.0, self.grad_bound - self.clip)

    @property
    def feedback_bound(self) -> float:
        """Cbar2 = min(B C2, G'): the paper's feedback bound in per-example units (``paper`` basis)."""
        cb = self.batch_size * self.ef_clip
        return cb if self.g_prime is None else min(cb, self.g_prime)

    @property
    def ratio(self) -> float:
        """r = B C2 / C1, the feedback threshold relative to C1 in per-example units."""
        return self.batch_size * self.ef_clip / self.clip


# ---------------------------------------------------------------- sound (default)
def sound_step_event(p: DiceParams, z: float) -> dp_event.DpEvent:
    """One step's dominating pair, as a dp-accounting event (units of C1/B: noise std z).

    ``N(0, z^2)`` against ``(1-q) N(2r, z^2) + q N(2r + 1, z^2)``: the feedback term moves the mean by
    up to 2 r whether or not the example is sampled now; its own clipped gradient adds 1 with
    probability q.
    """
    r, q = p.ratio, p.sample_rate
    if q >= 1:
        return dp_event.MixtureOfGaussiansDpEvent(z, [2 * r + 1], [1.0])
    return dp_event.MixtureOfGaussiansDpEvent(z, [2 * r, 2 * r + 1], [1 - q, q])


def sound_event(p: DiceParams, z: float) -> dp_event.DpEvent:
    """The T-step event of the sound bound."""
    step = sound_step_event(p, z)
    return dp_event.SelfComposedDpEvent(step, p.steps) if p.steps != 1 else step


def sound_epsilon(p: DiceParams, z: float, delta: float, discretization: float = SOUND_DISCRETIZATION) -> float:
    """Epsilon of the sound bound (PLD, pessimistic discretisation: an upper bound at any grid).

    Reports and certification use ``SOUND_DISCRETIZATION``; the calibration's search also evaluates
    coarser grids (``SOUND_COARSE``: larger epsilons, cheaper), only to aim.
    """
    check_delta(delta)
    check_positive(z, "noise_multiplier")
    check_positive(discretization, "discretization")
    return _sound_epsilon(p.ratio, p.sample_rate, p.steps, float(z), float(delta), float(discretization))


@functools.lru_cache(maxsize=4096)
def _sound_epsilon(r: float, q: float, steps: int, z: float, delta: float,
                   discretization: float = SOUND_DISCRETIZATION) -> float:
    if q >= 1 or 2 * r / z > _SOUND_PLD_MAX_SHIFT:
        # q = 1: one Gaussian of shift (2r + 1)/z per step, the exact mu-GDP formula (equal to the PLD).
        # The feedback shift 2r above 5 noise stds at every step (e.g. dice-auto, where r = B): the PLD
        # grid would take minutes and gigabytes. The conservative bound (the mixture is dominated by
        # its larger-shift Gaussian; exact GDP) is proven, never below the PLD value, and instant;
        # in this regime no bound is anywhere near a useful epsilon.
        return pld.gaussian_exact_epsilon(z / (1 + 2 * r), steps, delta)
    pld.check_pld_noise(z)
    step = sound_step_event(DiceParams(q, steps, 1.0, r, 1.0), z)  # only r, q and T matter
    try:  # the event's PLD, as dp-accounting's PLDAccountant builds it, kept per process
        one = pld.one_step_pld("mixture", z, tuple(step.sensitivities), tuple(step.sampling_probs),
                                    discretization)
        return float(one.self_compose(steps).get_epsilon_for_delta(delta))
    except (MemoryError, ValueError) as e:  # out of memory, or "Maximum allowed size exceeded"
        raise PrivacyAccountingError(
            f"the PLD accountant cannot represent DiceSGD's sound bound at noise multiplier {z:g} (r = {r:g}, "
            f"q = {q:g}, T = {steps}): its privacy-loss grid is too large ({type(e).__name__}: {e}). Use a "
            f"larger noise multiplier or a smaller feedback ratio r = B*C2/C1") from e


# ---------------------------------------------------------------- conservative
def conservative_epsilon(p: DiceParams, z: float, delta: float) -> float:
    """Amplification-free bound: T adaptive Gaussians, mean shift <= (1 + 2 r) C1 / B."""
    check_delta(delta)
    check_positive(z, "noise_multiplier")
    z_eff = z / (1 + 2 * p.ratio)
    return gaussian.epsilon(z_eff, 1.0, p.steps, delta, "pld")


# ---------------------------------------------------------------- paper (refuted; reproduction only)
def rdp_to_dp(alpha: np.ndarray, rdp: np.ndarray, delta: float) -> np.ndarray:
    """(alpha, rdp)-RDP -> epsilon at delta (Canonne, Kamath, Steinke 2020, Prop. 12).

    Valid for every alpha > 1 and never larger than Mironov's Prop. 3 (the paper's Lemma A.6)
    ``rdp + log(1/delta) / (alpha - 1)``.
    """
    alpha = np.asarray(alpha, dtype=float)
    eps = rdp + np.log1p(-1.0 / alpha) - (math.log(delta) + np.log(alpha)) / (alpha - 1)
    return np.maximum(eps, 0.0)


def lemma_a11_valid(q: float, sigma: float, alpha: np.ndarray) -> np.ndarray:
    """Where Mironov-Talwar-Zhang 2019 Thm 11 (the paper's Lemma A.11) holds.

    Conditions: q <= 1/5, sigma >= 4 (sigma: noise std / sensitivity), 1 < alpha <=
    sigma^2 L / 2 - 2 ln sigma and alpha (L + ln(q alpha) + 1/(2 sigma^2)) <= sigma^2 L^2 / 2
    - ln 5 - 2 ln sigma, with L = ln(1 + 1/(q (alpha - 1))). Then the subsampled Gaussian is
    (alpha, 2 q^2 alpha / sigma^2)-RDP.
    """
    alpha = np.asarray(alpha, dtype=float)
    if q > 0.2 or sigma < 4:
        return np.zeros_like(alpha, dtype=bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        L = np.log1p(1.0 / (q * (alpha - 1)))
        c1 = alpha <= 0.5 * sigma**2 * L - 2 * math.log(sigma)
        c2 = alpha * (L + np.log(q * alpha) + 1 / (2 * sigma**2)) <= (
            0.5 * sigma**2 * L**2 - math.log(5) - 2 * math.log(sigma))
    return (alpha > 1) & c1 & c2


def paper_rdp(p: DiceParams, z: float, alpha: np.ndarray) -> np.ndarray:
    """Eq. (25) summed over T steps: 16 alpha T q^2 (1 + 2 (Cbar2 / C1)^2) / z^2."""
    k = (p.feedback_bound / p.clip) ** 2
    return 16.0 * np.asarray(alpha) * p.steps * p.sample_rate**2 * (1 + 2 * k) / z**2


def paper_conditions(p: DiceParams, z: float) -> tuple[np.ndarray, list[str]]:
    """The alpha grid points where every Lemma A.11 application of the proof holds, and why not."""
    why: list[str] = []
    q = p.sample_rate
    if q > 0.2:
        why.append(f"sample rate q={q:g} > 1/5 (Lemma A.11 needs q <= 1/5)")
    sigma_grad = z / 2  # noise relative to the 2 C1 / B sensitivity of the gradient term
    if sigma_grad < 4:
        why.append(f"noise multiplier z={z:g} gives z/2={sigma_grad:g} < 4 relative to the proof's "
                   f"sensitivity 2 C1 / B (Lemma A.11 needs >= 4, i.e. z >= 8)")
    valid = lemma_a11_valid(q, sigma_grad, _ALPHAS)
    cb = p.feedback_bound
    if cb > 0:  # Lemma A.7 step (e): the feedback term, sensitivity 2 Cbar2 / B (the bound eq. (25) uses)
        sigma_fb = z * p.clip / (2 * cb)
        if sigma_fb < 4:
            what = "B C2" if p.g_prime is None else "min(B C2, G_max - C1)"
            why.append(f"noise relative to the feedback sensitivity 2 Cbar2/B is z C1/(2 Cbar2) = {sigma_fb:g} "
                       f"< 4 (Cbar2 = {what} = {cb:g}, r = B C2/C1 = {p.ratio:g}); Lemma A.11 needs >= 4, "
                       f"i.e. z >= 8 Cbar2/C1")
        valid &= lemma_a11_valid(q, sigma_fb, _ALPHAS)
    if not why and not valid.any():
        why.append("no Renyi order alpha satisfies Lemma A.11's range conditions")
    return valid, why


def paper_epsilon(p: DiceParams, z: float, delta: float) -> tuple[float, float]:
    """(epsilon, best alpha) of the paper's Theorem 3.8; raises outside its stated conditions.

    Refuted: a canary attack beats this number (docs/privacy.md). For reproduction only.
    """
    check_delta(delta)
    check_positive(z, "noise_multiplier")
    valid, why = paper_conditions(p, z)
    if why:
        raise PrivacyAccountingError("the paper's DiceSGD bound (Thm 3.8) does not apply: " + "; ".join(why)
                                     + ". Raise the noise or lower q; for a guarantee use `dice_accounting='sound'`.")
    alphas = _ALPHAS[valid]
    eps = rdp_to_dp(alphas, paper_rdp(p, z, alphas), delta)
    i = int(np.argmin(eps))
    return float(eps[i]), float(alphas[i])


# ---------------------------------------------------------------- authors (refuted heuristic)
def authors_factor(p: DiceParams) -> float:
    """sqrt(1 + 2 r): the authors' noise inflation of DPSGD's multiplier (not a proof)."""
    return math.sqrt(1 + 2 * p.ratio)


def authors_epsilon(p: DiceParams, z: float, delta: float, accountant: str = "pld") -> float:
    return gaussian.epsilon(z / authors_factor(p), p.sample_rate, p.steps, delta, accountant)


REFUTED = ("REFUTED by a canary attack on the hidden feedback buffer (epsilon >= 6.76 where the paper's bound "
           "states 1.63; >= 7.63 where the authors' protocol states 2; docs/privacy.md, `clipbias audit --algo "
           "dice --dice-accounting {basis}`): NOT a guarantee")


# ---------------------------------------------------------------- the bases as typed objects
@dataclass(frozen=True)
class DiceBasis(abc.ABC):
    """One basis DiceSGD's error feedback is accounted by (``BASES``, looked up by ``basis``): its report,
    its calibration and its dp-accounting event. ``certified``: whether its epsilon is a proven upper bound
    (False for the refuted ones, kept to reproduce the paper). Subclasses give ``report`` and ``calibrate``."""

    name: str
    certified: bool = True

    @abc.abstractmethod
    def report(self, p: DiceParams, z: float, delta: float, accountant: str) -> PrivacyReport:
        """The privacy statement of the run ``p`` at noise multiplier ``z``."""

    @abc.abstractmethod
    def calibrate(self, target: float, delta: float, p: DiceParams, accountant: str) -> float:
        """Smallest z whose epsilon is <= the target (inputs validated by ``calibrate``)."""

    def event(self, p: DiceParams, z: float) -> dp_event.DpEvent:
        """The T-step dp-accounting event; a basis that is an algorithm-specific formula has none."""
        return dp_event.UnsupportedDpEvent()

    def check_claims(self, certifiable: bool, why: str) -> None:
        """Refuse an algorithm the basis does not even claim (only the paper's bound claims less than all)."""


class Sound(DiceBasis):
    """Our proof (module docstring): a mixture of Gaussians per step, composed by the PLD accountant."""

    def report(self, p, z, delta, accountant):
        r = p.ratio
        basis = BASIS["sound"].format(r=r)
        if p.sample_rate < 1 and 2 * r / z > _SOUND_PLD_MAX_SHIFT:
            basis += (f"; here the feedback shift 2r/z = {2 * r / z:.3g} > {_SOUND_PLD_MAX_SHIFT:g} noise stds "
                      f"per step, so the dominating Gaussian N(2r+1, z^2) is composed exactly (GDP) instead")
        return PrivacyReport(sound_epsilon(p, z, delta), delta, "pld", basis, True, z)

    def calibrate(self, target, delta, p, accountant):
        return _calibrate_sound(target, delta, p, _conservative_z(target, delta, p))

    def event(self, p, z):
        return sound_event(p, z)


class Conservative(DiceBasis):
    """The sound argument without the mixture: T adaptive Gaussians (never below ``sound``)."""

    def report(self, p, z, delta, accountant):
        return PrivacyReport(conservative_epsilon(p, z, delta), delta, "pld",
                             BASIS["conservative"].format(r=p.ratio), True, z)

    def calibrate(self, target, delta, p, accountant):
        return _conservative_z(target, delta, p)


class Paper(DiceBasis):
    """The paper's Theorem 3.8, refuted: reproduction only."""

    def report(self, p, z, delta, accountant):
        eps, alpha = paper_epsilon(p, z, delta)
        return PrivacyReport(eps, delta, "dice-paper-rdp", BASIS["paper"].format(alpha=alpha), False, z)

    def calibrate(self, target, delta, p, accountant):
        return _calibrate_paper(target, delta, p)

    def check_claims(self, certifiable, why):
        if not certifiable:
            raise PrivacyAccountingError(f"the paper's DiceSGD bound does not even claim this algorithm: "
                                         f"{why}. Use `dice_accounting='sound'` (the default).")


class Authors(DiceBasis):
    """The authors' experimental protocol, refuted: DPSGD's multiplier inflated by sqrt(1 + 2 r)."""

    def report(self, p, z, delta, accountant):
        return PrivacyReport(authors_epsilon(p, z, delta, accountant), delta, accountant,
                             BASIS["authors"].format(r=p.ratio, accountant=accountant), False, z)

    def calibrate(self, target, delta, p, accountant):
        return gaussian._calibrate(target, delta, p.sample_rate, p.steps, accountant) * authors_factor(p)


class _Bases(Registry):
    def lookup(self, name):
        """A renamed spelling is refused with its new name; an unknown one lists the bases."""
        if isinstance(name, str) and name in RENAMED:
            raise ConfigError(
                f"`{self.parameter}` {name!r} was renamed {RENAMED[name]!r}: it is the paper's Theorem 3.8, "
                f"which a canary attack refutes (docs/privacy.md), so it is no longer certified nor the default. "
                f"Use 'sound' (the default, proven) or 'paper' to reproduce the paper's numbers.")
        return super().lookup(name)


BASES: Registry[DiceBasis] = _Bases("a DiceSGD accounting basis", "dice_accounting")
SOUND = BASES.register(Sound("sound"))
CONSERVATIVE = BASES.register(Conservative("conservative"))
PAPER = BASES.register(Paper("paper", certified=False))
AUTHORS = BASES.register(Authors("authors", certified=False))
DICE_ACCOUNTING = tuple(BASES)  # the spellings of ``dice_accounting``


def basis(spelling: str | DiceBasis) -> DiceBasis:
    """The basis a ``dice_accounting`` spelling names (a ``DiceBasis`` is itself), else a ConfigError."""
    return spelling if isinstance(spelling, DiceBasis) else BASES.lookup(spelling)


BASIS = {
    "sound": "DiceSGD error feedback, sound bound (clipbias docs/privacy.md): per step the mixture "
             "(1-q) N(2r, z^2) + q N(2r+1, z^2) vs N(0, z^2) in units of C1/B, r = B C2/C1 = {r:.4g}, "
             "dominates the released update whatever the hidden buffer; T-fold PLD composition "
             "(dp-accounting MixtureOfGaussiansDpEvent, both adjacency directions)",
    "conservative": "DiceSGD amplification-free bound (clipbias docs/privacy.md): T adaptive "
                    "Gaussians with sensitivity (1 + 2 r) C1/B, r = B C2 / C1 = {r:.4g}, exact GDP composition",
    "paper": "DiceSGD paper's Thm 3.8 (Zhang et al., App. A.2 eq. (25)): per-step RDP 16 alpha q^2 "
             "(1 + 2 (Cbar2/C1)^2) / z^2, alpha={alpha:.3g}; " + REFUTED.format(basis="paper"),
    "authors": "DiceSGD authors' experimental protocol (heuristic, NOT a proof): z_DPSGD * sqrt(1 + 2 r), "
               "r = {r:.4g}, accounted as DPSGD with {accountant}; " + REFUTED.format(basis="authors"),
}


def report(p: DiceParams, z: float, delta: float, method: str | DiceBasis = DEFAULT_DICE_ACCOUNTING,
           accountant: str = "pld") -> PrivacyReport:
    """The report of ``method`` (a ``dice_accounting`` spelling or a ``DiceBasis``)."""
    return basis(method).report(p, z, delta, accountant)


@functools.lru_cache(maxsize=256)
def calibrate(target_epsilon: float, delta: float, p: DiceParams, method: str | DiceBasis = DEFAULT_DICE_ACCOUNTING,
              accountant: str = "pld") -> float:
    """Smallest z (0.1% tolerance) whose DiceSGD epsilon under ``method`` is <= the target (cached
    in-process: a pure function of its arguments)."""
    check_epsilon(target_epsilon)
    check_delta(delta)
    b = basis(method)
    check_accountant(accountant)  # the inputs are valid from here on (DiceParams checks its own)
    return b.calibrate(target_epsilon, delta, p, accountant)


def _conservative_z(target: float, delta: float, p: DiceParams) -> float:
    """The conservative bound's z: DPSGD's at rate 1 times (1 + 2 r)."""
    return gaussian._calibrate(target, delta, 1.0, p.steps, "pld") * (1 + 2 * p.ratio)


def _calibrate_sound(target: float, delta: float, p: DiceParams, z_cons: float) -> float:
    """``search.calibrate_levels`` on the sound bound. eps_DPSGD(z) <= eps_sound(z) <= eps_conservative(z),
    so the answer lies between DPSGD's z and ``z_cons``. The secant starts at ``z_cons`` (the PLD is
    cheapest at large z, and z_cons costs milliseconds where DPSGD's z costs a PLD calibration), aims
    with the sound bound on the coarse grid ``SOUND_COARSE`` (never trusted), and ``search.confirm``
    certifies with the report's grid: the returned z was evaluated at <= target, and a z at most 0.1%
    below it above the target."""
    def at(discretization: float):
        def eps(z: float) -> float:
            try:  # the inputs were validated by calibrate
                return _sound_epsilon(p.ratio, p.sample_rate, p.steps, float(z), float(delta), float(discretization))
            except pld.NoiseTooSmallError:  # below the PLD's smallest z: certainly too little noise
                return math.inf
        return eps

    # the ceiling leaves room above z_cons for the PLD's pessimistic discretisation (a hair above GDP's)
    z = search.calibrate_levels(target, [(at(SOUND_COARSE), 1e-2)], at(SOUND_DISCRETIZATION), start=z_cons,
                                floor=pld.PLD_MIN_NOISE, ceiling=2 * z_cons)
    if math.isinf(z):  # pragma: no cover - eps_sound <= eps_conservative, which z_cons meets
        raise PrivacyAccountingError(f"DiceSGD's sound bound exceeds epsilon={target:g} even at noise multiplier "
                                     f"{2 * z_cons:g}, twice the conservative bound's z: please report this")
    return z


def _calibrate_paper(target: float, delta: float, p: DiceParams) -> float:
    """The paper's bound (reproduction only): its own closed form (milliseconds) aims and confirms. It
    never applies below z = 8 (Lemma A.11 needs z/2 >= 4), the search's floor."""
    if p.sample_rate > 0.2:
        raise PrivacyAccountingError(f"the paper's DiceSGD bound needs q <= 1/5 (Lemma A.11), got "
                                     f"q={p.sample_rate:g}")

    def eps(z: float) -> float:
        try:
            return paper_epsilon(p, z, delta)[0]
        except PrivacyAccountingError:  # outside the theorem's conditions: counts as too little noise
            return math.inf

    z = search.calibrate_levels(target, [(eps, 1e-2)], eps, start=PAPER_MIN_NOISE, floor=PAPER_MIN_NOISE,
                                ceiling=1e8)
    if math.isinf(z):
        raise PrivacyAccountingError(f"the paper's DiceSGD bound cannot reach epsilon={target:g} "
                                     f"with these settings (noise multiplier would exceed 1e8)")
    return z
