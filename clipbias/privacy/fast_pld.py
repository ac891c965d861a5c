"""One-step privacy loss distributions built as dp-accounting builds them (connect-the-dots,
pessimistic, both adjacency directions) but with their one scalar loop vectorised: the
Poisson-subsampled Gaussian (``from_gaussian_mechanism``) and the mixture of Gaussians
(``from_mixture_gaussian_mechanism``, DiceSGD's sound bound).

dp-accounting computes the hockey-stick divergence of the mechanism at every grid point of the
privacy loss, and inverts the privacy loss there one point at a time in Python (~7 us a point): at
the default grid (1e-4) and a noise multiplier of 0.25 that is 400,000 points per direction, 6 s of
a 7 s evaluation. ``_VectorGaussianLoss.get_delta_for_epsilon`` is the library's method with that
inversion done on the whole array by the same formulas (the Gaussian's closed-form inverse, through
the subsampling map log(1 + (e^l - 1)/q)); everything else (tails, truncation, the connect-the-dots
pmf, pessimistic rounding) is dp-accounting's own code. The result equals the library's to rounding
(tests/test_calibration.py checks the pmf and the epsilon). Should the library's internals change,
``gaussian_pld`` falls back to the public constructor: slower, never different.

The mixture's privacy loss has no closed-form inverse, and dp-accounting inverts it by one binary
search shared by all grid points, recursing over the sorted losses and evaluating the loss at each
node's midpoint one scalar at a time (167,000 calls, 2 s of a DiceSGD accounting at q = 0.01, z = 1,
r = 0.5; 11 s at r = 2). ``_VectorMixtureLoss`` runs the same search for every loss at once, level by
level, with the same midpoints, comparisons and leaves, and the loss evaluated by the library's own
formula on the array: the pmf is the library's, bit for bit (tests/test_calibration.py).
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting.pld import privacy_loss_distribution as _pld
from dp_accounting.pld import privacy_loss_mechanism as _mech


class _VectorGaussianLoss(_mech.GaussianPrivacyLoss):
    """dp-accounting's Gaussian privacy loss with ``get_delta_for_epsilon`` vectorised."""

    def _inverse(self, losses: np.ndarray) -> np.ndarray:
        """``inverse_privacy_loss`` of every loss (each inside its direction's range, as the caller
        guarantees): the largest x whose privacy loss is at least it."""
        s, var, q = self.sensitivity, self._standard_deviation ** 2, self.sampling_prob
        add = self.adjacency_type == _mech.AdjacencyType.ADD
        if q == 1.0:
            plain = np.asarray(losses, dtype=float)
        else:
            b = -losses if add else losses
            with np.errstate(divide="ignore", invalid="ignore"):  # the isclose ends are set below
                d = b + np.log(1 / q)
                plain = d + np.log1p(-np.exp(np.log(-(1 - 1 / q)) - d))  # log((e^b - 1)/q + 1)
            plain = np.where(b == 0, np.log(1 / q + (1 - 1 / q)), plain)
            plain = -plain if add else plain
            edge = -math.log(1 - q) if add else math.log(1 - q)
            at_edge = np.abs(losses - edge) <= 1e-9 * np.maximum(np.abs(losses), abs(edge))  # math.isclose
            plain = np.where(at_edge, math.inf if add else -math.inf, plain)
            if np.isnan(plain).any():
                raise ValueError("a privacy loss outside the subsampled Gaussian's range")
        x = -0.5 * s - plain * var / s  # the Gaussian's inverse loss (REMOVE)
        return s + x if add else x

    def get_delta_for_epsilon(self, epsilon):
        scalar = isinstance(epsilon, (int, float))
        eps = np.array([epsilon], dtype=float) if scalar else np.asarray(epsilon, dtype=float)
        deltas = np.zeros_like(eps, dtype=float)
        if self.sampling_prob == 1.0:
            inside = np.full_like(eps, True, dtype=bool)
        elif self.adjacency_type == _mech.AdjacencyType.ADD:
            inside = eps < -math.log1p(-self.sampling_prob)
        elif self.adjacency_type == _mech.AdjacencyType.REMOVE:
            inside = eps > math.log1p(-self.sampling_prob)
            deltas[~inside] = -np.expm1(eps[~inside])
        else:  # pragma: no cover - only ADD and REMOVE are built here
            raise ValueError(f"{self.adjacency_type} adjacency type is not supported")
        x = self._inverse(eps[inside])
        deltas[inside] = self.mu_upper_cdf(x) - np.exp(eps[inside] + self.mu_lower_log_cdf(x))
        deltas = np.clip(deltas, 0, 1)
        return float(deltas[0]) if scalar else deltas


class _VectorMixtureLoss(_mech.MixtureGaussianPrivacyLoss):
    """dp-accounting's mixture-of-Gaussians privacy loss with its binary search vectorised."""

    def _losses(self, x: np.ndarray) -> np.ndarray:
        """``privacy_loss`` at every x, by its own operations (per row: the same products, sums and
        left-to-right ``logaddexp`` over the sensitivities)."""
        x_loss = self.sensitivities[None, :] * x[:, None] / self._variance
        if self.adjacency_type == _mech.AdjacencyType.ADD:
            return -np.logaddexp.reduce(self._precompute_privacy_loss_constants + x_loss, axis=1)
        return np.logaddexp.reduce(self._precompute_privacy_loss_constants - x_loss, axis=1)

    def _inverse_privacy_losses_with_range(self, privacy_losses, bounds, precision=1e-6):
        """The library's recursion, one level for every loss at a time: a node (lo, hi) no wider than
        ``precision`` is a leaf, ``floor(hi / precision) * precision``; otherwise a loss below the
        loss at ``mid = (lo + hi) / 2`` goes to (mid, hi), one at or above it to (lo, mid), and one
        that compares neither way (a NaN) stays at 0, as the library leaves it."""
        losses = np.asarray(privacy_losses, dtype=float)
        lo, hi = np.full(losses.shape, float(bounds[0])), np.full(losses.shape, float(bounds[1]))
        out = np.zeros(losses.shape)
        active = np.arange(losses.size)
        while active.size:
            leaf = hi[active] - lo[active] <= precision
            done = active[leaf]
            out[done] = np.floor(hi[done] / precision) * precision
            active = active[~leaf]
            mid = (lo[active] + hi[active]) / 2
            at = self._losses(mid)
            below, above = losses[active] < at, losses[active] >= at
            lo[active[below]], hi[active[above]] = mid[below], mid[above]
            active = active[below | above]
        return out


def mixture_pld(standard_deviation: float, sensitivities, sampling_probs, discretization: float):
    """``from_mixture_gaussian_mechanism(standard_deviation, sensitivities, sampling_probs,
    value_discretization_interval=discretization)`` (the defaults otherwise), vectorised."""
    build = getattr(_pld, "_create_pld_pmf_from_monotone_privacy_loss", None)
    if build is None or not hasattr(_mech.MixtureGaussianPrivacyLoss, "_inverse_privacy_losses_with_range"):
        # pragma: no cover - another dp-accounting, without the internals replaced here: its public constructor
        return _pld.from_mixture_gaussian_mechanism(standard_deviation, list(sensitivities), list(sampling_probs),
                                                    value_discretization_interval=discretization)

    def one(adjacency):
        loss = _VectorMixtureLoss(standard_deviation, list(sensitivities), list(sampling_probs),
                                  pessimistic_estimate=True, log_mass_truncation_bound=-50,
                                  adjacency_type=adjacency)
        return build(loss, pessimistic_estimate=True, value_discretization_interval=discretization,
                     use_connect_dots=True)
    return _pld.PrivacyLossDistribution(one(_mech.AdjacencyType.REMOVE), one(_mech.AdjacencyType.ADD))


def gaussian_pld(standard_deviation: float, sampling_prob: float, discretization: float):
    """``from_gaussian_mechanism(standard_deviation, value_discretization_interval=discretization,
    sampling_prob=sampling_prob)`` (sensitivity 1, the defaults otherwise), vectorised."""
    try:
        build, subsampled = _pld._create_pld_pmf_from_monotone_privacy_loss, _pld._pld_for_subsampled_mechanism
    except AttributeError:  # pragma: no cover - another dp-accounting: its public constructor
        return _pld.from_gaussian_mechanism(standard_deviation, value_discretization_interval=discretization,
                                            sampling_prob=sampling_prob)

    def one(adjacency):
        loss = _VectorGaussianLoss(standard_deviation, sensitivity=1, pessimistic_estimate=True,
                                   log_mass_truncation_bound=-50, sampling_prob=sampling_prob,
                                   adjacency_type=adjacency)
        return build(loss, pessimistic_estimate=True, value_discretization_interval=discretization,
                     use_connect_dots=True)
    return subsampled(one, sampling_prob)
