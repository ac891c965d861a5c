"""The Renyi DP accountant: dp-accounting's ``RdpAccountant`` on the subsampled Gaussian's event, with
the Canonne-Kamath-Steinke conversion to (epsilon, delta). Milliseconds per evaluation and any noise
multiplier; looser than the PLD."""

from __future__ import annotations

import functools

import numpy as np
from absl import logging as absl_logging
from dp_accounting import dp_event
from dp_accounting import rdp as dp_rdp

from .accountants import Accountant, SampledGaussian, register

# dp-accounting's RDP accountant logs one warning per Renyi order it excludes (the epsilon stays a valid
# upper bound without them): dozens of lines per call that users read as errors.
absl_logging.set_verbosity(absl_logging.ERROR)


class RDP(Accountant):
    name = "rdp"
    basis = ("Poisson-subsampled Gaussian, T-fold composition, Renyi DP (dp-accounting RdpAccountant; "
             "Mironov et al. 2019) with the Canonne-Kamath-Steinke 2020 conversion")

    def compute(self, noise_multiplier: float, sample_rate: float, steps: int, delta: float) -> float:
        acc = accountant()
        acc.compose(SampledGaussian(noise_multiplier, sample_rate).event(steps))
        return float(acc.get_epsilon(delta))


_RDP = dp_rdp.rdp_privacy_accountant
_CACHEABLE = all(hasattr(_RDP, name) for name in ("_compute_rdp_poisson_subsampled_gaussian", "NeighborRel")) and \
    hasattr(dp_rdp.RdpAccountant, "_maybe_compose")


@functools.lru_cache(maxsize=2048)
def _sampled_gaussian_rdp(q: float, noise_multiplier: float, orders: tuple) -> np.ndarray:
    """dp-accounting's RDP of one Poisson-subsampled Gaussian (q = 1: the Gaussian) at ``orders``, kept per
    process (read-only): 30-100 ms of Python series per call, and the same (q, z) comes back at every report of
    a run, at every step of a tuning's bisection repeated, and in every calibration of the same event."""
    rdp = _RDP._compute_rdp_poisson_subsampled_gaussian(q=q, noise_multiplier=noise_multiplier, orders=np.array(orders))
    rdp = np.array(rdp, dtype=np.float64)
    rdp.setflags(write=False)
    return rdp


class CachedRdpAccountant(dp_rdp.RdpAccountant):
    """dp-accounting's ``RdpAccountant`` with the RDP of its Gaussian and Poisson-subsampled Gaussian leaves
    kept per process (``_sampled_gaussian_rdp``): every other event, every composition and every conversion is
    the library's own code, and a leaf's RDP is the array the library computes for it, so every epsilon is the
    library's, bit for bit (tests/test_privacy.py)."""

    def _maybe_compose(self, event, count, do_compose):
        if do_compose and self._neighboring_relation == _RDP.NeighborRel.ADD_OR_REMOVE_ONE:
            q = None
            if isinstance(event, dp_event.GaussianDpEvent):
                q, z = 1.0, event.noise_multiplier
            elif isinstance(event, dp_event.PoissonSampledDpEvent) and isinstance(event.event, dp_event.GaussianDpEvent):
                q, z = event.sampling_probability, event.event.noise_multiplier
            if q is not None:  # the library's own line, with the leaf's RDP kept
                self._rdp += count * _sampled_gaussian_rdp(q, z, tuple(self._orders.tolist()))
                return None
        return super()._maybe_compose(event, count, do_compose)


def accountant(orders=None) -> dp_rdp.RdpAccountant:
    """A fresh RDP accountant (at dp-accounting's default orders unless given): ``CachedRdpAccountant``, or
    the library's own where its internals differ from those the cache relies on."""
    return CachedRdpAccountant(orders) if _CACHEABLE else dp_rdp.RdpAccountant(orders)


ACCOUNTANT = register(RDP())
