"""The Renyi DP accountant: dp-accounting's ``RdpAccountant`` on the subsampled Gaussian's event, with
the Canonne-Kamath-Steinke conversion to (epsilon, delta). Milliseconds per evaluation and any noise
multiplier; looser than the PLD."""

from __future__ import annotations

from absl import logging as absl_logging
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
        acc = dp_rdp.RdpAccountant()
        acc.compose(SampledGaussian(noise_multiplier, sample_rate).event(steps))
        return float(acc.get_epsilon(delta))


ACCOUNTANT = register(RDP())
