"""The privacy of hyperparameter tuning on private data (Papernot & Steinke, ICLR 2022).

Random search run a *random* number K of times, each trial a private training run plus a noisy
score, and only the best trial released (its hyperparameters, model and score): if one trial is
``(lambda, eps(lambda))``-RDP at every order and K follows a truncated negative binomial
distribution of shape eta (0: logarithmic, 1: geometric) and mean mu, the selection is
``(lambda, eps'(lambda))``-RDP with

    eps'(lambda) = eps(lambda) + (1 + eta) min_lhat [(1 - 1/lhat) eps(lhat) + ln(1/gamma) / lhat]
                   + ln(mu) / (lambda - 1)

(their Thm. 2; gamma is fixed by eta and mu). dp-accounting implements it as
``RepeatAndSelectDpEvent``; this module builds the event of one trial (the training run composed
with the score's Gaussian release), samples K, and calibrates the trials' noise so that the whole
tuning meets a target epsilon. The other trials' outputs, and K itself, must stay secret.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp

from ..errors import ConfigError
from . import rdp as cached_rdp  # dp-accounting's RdpAccountant, its Gaussian leaves kept per process

BASIS = ("private hyperparameter tuning (Papernot & Steinke, ICLR 2022, Thm. 2): random search with a random "
         "number of trials K ~ truncated negative binomial (shape {shape:g}, mean {mean:g}), each trial the "
         "training run composed with its Gaussian-noised validation count (std {score_std:g}), only the best "
         "trial released; Renyi DP via dp-accounting RepeatAndSelectDpEvent")


def trial_event(training: dp_event.DpEvent, score_std: float) -> dp_event.DpEvent:
    """One trial: the training run and the release of its validation count (sensitivity 1) with
    Gaussian noise of std ``score_std``, composed (an example in either part is covered)."""
    return dp_event.ComposedDpEvent([training, dp_event.GaussianDpEvent(score_std)])


def tuned_epsilon(training: dp_event.DpEvent | Sequence[dp_event.DpEvent], score_std: float, delta: float,
                  mean: float, shape: float) -> float:
    """Epsilon at ``delta`` of releasing the best of K ~ TNB(shape, mean) trials. ``training``: one trial's
    training event, or the events a trial chooses among (a secret draw independent of the data, e.g. the
    number of noise bands): then a trial is a mixture of them, whose Renyi divergence at every order is at
    most the largest of theirs (joint quasi-convexity; van Erven & Harremoes 2014, Thm. 13), and that
    pointwise maximum is the one-trial RDP that Papernot & Steinke's Thm. 2 takes."""
    events = [training] if isinstance(training, dp_event.DpEvent) else list(training)
    if len(events) == 1:
        acc = cached_rdp.accountant()
        acc.compose(dp_event.RepeatAndSelectDpEvent(trial_event(events[0], score_std), mean, shape))
        return float(acc.get_epsilon(delta))
    orders = np.asarray(rdp.DEFAULT_RDP_ORDERS, dtype=np.float64)
    curves = []
    for e in events:
        acc = cached_rdp.accountant(list(orders))
        acc.compose(trial_event(e, score_std))
        curves.append(np.asarray(acc._rdp, dtype=np.float64))  # one trial's RDP at ``orders``
    worst = np.max(curves, axis=0)
    return float(rdp.compute_epsilon(orders, rdp._compute_rdp_repeat_and_select(orders, worst, mean, shape),
                                     delta)[0])


def calibrate(event_of: Callable[[float], dp_event.DpEvent | Sequence[dp_event.DpEvent]], target: float,
              delta: float, mean: float, shape: float, score_std: float, lo: float = 0.3, hi: float = 100.0,
              rel_tol: float = 2e-3) -> float:
    """The smallest noise multiplier z (to ``rel_tol``) whose tuning epsilon is at most ``target``;
    ``event_of(z)`` is one trial's training event (or the events it chooses among, ``tuned_epsilon``).
    Never overshoots: the upper end of the bracket."""
    if tuned_epsilon(event_of(hi), score_std, delta, mean, shape) > target:
        raise ConfigError(f"tuning with {mean:g} trials on average cannot reach epsilon {target:g} even at noise "
                          f"multiplier {hi:g}: allow a larger `epsilon`, fewer `trials` or fewer steps")
    if tuned_epsilon(event_of(lo), score_std, delta, mean, shape) <= target:
        return lo
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        if tuned_epsilon(event_of(mid), score_std, delta, mean, shape) <= target:
            hi = mid
        else:
            lo = mid
    return hi


def gamma_of(mean: float, shape: float) -> float:
    """The gamma parameter of the truncated negative binomial of this shape and mean (dp-accounting's
    own inversion, so the sampled distribution is the one accounted)."""
    return rdp._gamma_truncated_negative_binomial(shape, mean)


def trial_count(u: float, mean: float, shape: float) -> int:
    """K ~ TNB(shape, mean) by the inverse of its CDF at the uniform ``u`` in (0, 1):
    P(K = k) proportional to (1 - gamma)^k / k (shape 0) or (1 - gamma)^k Gamma(k + eta) / (Gamma(eta) k!)."""
    if not 0 < u < 1:
        raise ValueError("u must lie in (0, 1)")
    if mean == 1:
        return 1
    gamma = gamma_of(mean, shape)
    log_q = math.log1p(-gamma)
    def log_w(k: int) -> float:
        if shape == 0:
            return k * log_q - math.log(k)
        return k * log_q + math.lgamma(k + shape) - math.lgamma(shape) - math.lgamma(k + 1)
    total = (-math.log(gamma) if shape == 0 else (gamma ** -shape - 1))  # sum over k >= 1 of exp(log_w(k))
    acc, k = 0.0, 0
    while True:
        k += 1
        acc += math.exp(log_w(k)) / total
        if acc >= u or k > 10 ** 7:
            return k
