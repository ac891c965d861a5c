"""Adaptive quantile clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021): DPSGD whose clip
norm follows a target quantile of the per-example gradient norms.

Each step releases, besides the noisy clipped sum, a noisy count of the rows that were not clipped:
``r_t = sum_i (b_i - 1/2) + N(0, sigma_b^2)`` with ``b_i = 1[||g_i|| <= C_t]``, and sets
``C_{t+1} = C_t exp(-eta (r_t / B + 1/2 - gamma))`` (``gamma`` the target fraction unclipped,
``eta`` the clip learning rate, B the expected batch size: ``r_t / B + 1/2`` estimates the fraction
unclipped without the private realised batch size). ``b_i - 1/2`` has add/remove sensitivity 1/2.

Privacy (docs/privacy.md, "Adaptive clipping"): one example adds the vector
``(clip(g_i, C_t) / C_t, b_i - 1/2)``, of norm at most 1 in the first part and 1/2 in the second,
to two sums released with Gaussian noise of std ``z_g C_t`` and ``sigma_b``. Scaling each part by
its noise makes the pair one Gaussian mechanism with unit noise and L2 sensitivity
``sqrt(1 / z_g^2 + 1 / (4 sigma_b^2)) = 1 / z``: the step is the Poisson-subsampled Gaussian
mechanism with noise multiplier ``z = (z_g^-2 + (2 sigma_b)^-2)^-1/2`` (Andrew et al. Thm. 1),
whatever ``C_t`` is (it is a function of earlier releases: adaptive composition). ``z`` is what the
accountant, the calibration and ``--noise-multiplier`` speak of; the gradient noise is the larger
``z_g = (z^-2 - (2 sigma_b)^-2)^-1/2``, which needs ``2 sigma_b > z``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import distributed
from ..config import OPTIONAL, AlgoConfig, Setting, real
from ..errors import ConfigError
from ..grads.precision import last_norms
from ..randomness import Purpose, SecretKey, snapped_gaussian
from ..step import Clip, StepContext, clip_rows, clip_scale, scale_rows
from .base import Algorithm, Parts, register


class QuantileClip(Clip):
    """Clip at ``C_t``; after each step ``release`` draws the noisy unclipped count and stages
    ``C_{t+1}``. ``dynamic``: the pipeline scales its noise with the current bound."""

    dynamic = True

    def __init__(self, c0: float, quantile: float, lr: float, count_std: float, expected_batch_size: float,
                 key: SecretKey | None = None) -> None:
        super().__init__(c0)
        self.quantile, self.lr, self.count_std = float(quantile), float(lr), float(count_std)
        self.expected_batch_size, self.key = float(expected_batch_size), key
        self.releases = 0
        self._partial, self._pending = 0.0, None

    def _count(self, norms: Tensor) -> None:
        if norms.dim() != 1:
            raise ConfigError("adaptive clipping counts one row per example: it cannot run on a leading axis of "
                              "independent runs (the batched canary audit); audit it with --mode one-run")
        self._partial += float((norms <= self.c).sum()) - 0.5 * len(norms)

    def __call__(self, g: Tensor, ctx: StepContext) -> Tensor:
        norms = last_norms(g)
        self._count(norms)
        return scale_rows(g, clip_scale(norms, self.c).unsqueeze(-1))

    def scale(self, norms: Tensor) -> Tensor:
        self._count(norms)
        return clip_scale(norms, self.c)

    def probe(self, g: Tensor, ctx: StepContext) -> Tensor:
        return clip_rows(g, self.c)

    def release(self, device: torch.device | str = "cpu") -> float:
        """The noisy count ``r_t`` of this step (every rank's share summed) and the staged next clip."""
        if self.key is None:
            raise ConfigError("QuantileClip draws its count noise from the run's secret key (DPEngine sets it)")
        total = distributed.sum_over_ranks(self._partial, device)
        r = float(snapped_gaussian(torch.tensor([total], dtype=torch.float64), self.count_std, self.key,
                                   self.releases, Purpose.CLIP_COUNT))
        unclipped = r / self.expected_batch_size + 0.5
        self._pending = (self.c * math.exp(-self.lr * (unclipped - self.quantile)), self.releases + 1)
        return r

    def commit(self) -> None:
        if self._pending is not None:
            (self.c, self.releases), self._pending = self._pending, None
            self.bound = self.c
        self._partial = 0.0

    def rollback(self) -> None:
        self._partial, self._pending = 0.0, None

    def state_dict(self) -> dict:
        return {"c": self.c, "releases": self.releases}

    def load_state_dict(self, state: dict) -> None:
        self.c = self.bound = float(state["c"])
        self.releases, self._partial, self._pending = int(state["releases"]), 0.0, None


def count_std(s: dict, expected_batch_size: float) -> float:
    """sigma_b: the ``--count-noise`` setting, by default B / 20 (Andrew et al.'s choice)."""
    return float(s["count_noise"]) if s["count_noise"] is not None else expected_batch_size / 20.0


def gradient_noise(cfg: AlgoConfig, s: dict, z: float, expected_batch_size: float) -> float:
    """z_g = (z^-2 - (2 sigma_b)^-2)^-1/2: the gradient noise multiplier that, with the count noise
    sigma_b, makes the joint release a Gaussian mechanism of multiplier z (module docstring)."""
    two_sb = 2.0 * count_std(s, expected_batch_size)
    if z == 0:
        return 0.0
    if not two_sb > z:
        raise ConfigError(f"adaptive clipping: the noise multiplier z = {z:.4g} of the joint release needs a count "
                          f"noise 2 sigma_b > z, got sigma_b = {two_sb / 2:.4g}: raise `AlgoConfig.extra['count_noise']` (default B/20)")
    return (z ** -2 - two_sb ** -2) ** -0.5


QUANTILE = Setting("quantile", 0.5, "a number in (0, 1)", real(0, 1, lo_open=True, hi_open=True),
                   "--clip-quantile", float, "adaptive clipping: target fraction of rows left unclipped")
CLIP_LR = Setting("clip_lr", 0.2, "a number > 0", real(0, float("inf"), lo_open=True), "--clip-lr", float,
                  "adaptive clipping: geometric learning rate eta of the clip norm")
COUNT_NOISE = Setting("count_noise", OPTIONAL, "a number > 0", real(0, float("inf"), lo_open=True),
                      "--count-noise", float, "adaptive clipping: std sigma_b of the noisy unclipped count "
                      "(default B/20)")


def _build(cfg: AlgoConfig, s: dict, b: float, key: SecretKey | None) -> Parts:
    return Parts([QuantileClip(cfg.clip, s["quantile"], s["clip_lr"], count_std(s, b), b, key)])


def _note(cfg: AlgoConfig, s: dict) -> str:
    return (f"adaptive quantile clipping (Andrew et al. 2021): each step releases the clipped sum at the current clip "
            f"C_t (initial C = {cfg.clip:g}, target unclipped fraction {s['quantile']:g}, clip learning rate "
            f"{s['clip_lr']:g}) and a noisy count of unclipped rows (sensitivity 1/2, std sigma_b = B/20 unless "
            f"--count-noise); together one Gaussian mechanism with noise multiplier z = (z_g^-2 + (2 sigma_b)^-2)^-1/2 "
            f"relative to C_t, which the accounting uses")


register(Algorithm("adaptive", "DPSGD with adaptive quantile clipping (Andrew et al. 2021)", True, "gaussian",
                   _build, schema=(QUANTILE, CLIP_LR, COUNT_NOISE), note=_note, gradient_noise=gradient_noise))
