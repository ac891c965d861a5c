"""DiSK: a simplified Kalman filter over the privatised gradients (Zhang, Bu, Balle, Hong, Razaviyayn,
Mirrokni, ICLR 2025), as a stage that composes with every base algorithm.

With ``d_t = x_t - x_{t-1}`` (released iterates; ``d_0 = 0``) and ``c = (1 - kappa) / (kappa gamma)``,
each example's row is the combination of its gradients at two points of the same step,

    r_i = c grad f(x_t + gamma d_t; xi_i) + (1 - c) grad f(x_t; xi_i),

(the prediction ``g_{t-1} + H_t d_t`` of the filter with the Hessian-vector product taken as a finite
difference of the same example's gradients), and the base algorithm privatises these rows exactly as it
privatises gradients (clip ``r_i`` to C, sum, noise: one release per step). The filter
``g_t = (1 - kappa) g_{t-1} + kappa v_t`` (``g_0 = v_0``) on the noisy update ``v_t`` is
post-processing; ``g_t`` goes to the base's update rule (its post stage, then the torch optimizer).

Privacy: ``r_i`` is a function of example i and of the released ``x_t, x_{t-1}``, clipped once, so the
per-example sensitivity and the accounting are the base algorithm's (DPSGD-GC: C). Cost: two gradient
evaluations per example per step, one where ``c`` is 1 (``gamma = (1 - kappa) / kappa``) or 0.
``kappa = 1`` is the base algorithm itself.

``--algo disk`` is DPSGD-GC + DiSK; ``--algo X --kalman`` (``X+disk``) adds it to the base X.
"""

from __future__ import annotations

import math
from dataclasses import replace

from torch import Tensor, nn

from ..config import AlgoConfig, Setting, real
from ..errors import ConfigError
from ..grads.rows import LossFn, RowSource
from ..grads.two_point import TwoPointRows
from ..randomness import SecretKey
from ..step import Carried, Chain
from . import base as registry
from .base import Algorithm, Parts, get, register

KAPPA = Setting("kappa", 0.7, "a number in (0, 1]", real(0, 1, lo_open=True), "--kappa", float,
                "DiSK: Kalman gain kappa, g_t = (1 - kappa) g_(t-1) + kappa v_t; 1 = the base algorithm")
DISK_GAMMA = Setting("disk_gamma", 0.5, "a number > 0", real(0, math.inf, lo_open=True), "--disk-gamma", float,
                     "DiSK: extrapolation gamma, gradients at x_t + gamma (x_t - x_(t-1)) and x_t",
                     aliases=("kf_gamma",))
SETTINGS = (KAPPA, DISK_GAMMA)
SUFFIX = "disk"


def combination(kappa: float, gamma: float) -> float:
    """c = (1 - kappa) / (kappa gamma): the weight of the extrapolated point's gradient in a row (exactly 1,
    one evaluation per example, when ``gamma`` is ``(1 - kappa) / kappa`` up to rounding)."""
    c = (1.0 - kappa) / (kappa * gamma)
    return 1.0 if math.isclose(c, 1.0, rel_tol=1e-12) else c


class KalmanFilter(Carried):
    """``g_t = (1 - kappa) g_{t-1} + kappa v_t`` on the noisy update ``v_t`` (``g_0 = v_0``): post-processing."""

    KEY = "g"  # g_t
    g: Tensor | None

    def __init__(self, kappa: float) -> None:
        if not 0 < kappa <= 1:
            raise ConfigError(f"`AlgoConfig.extra['kappa']` (DiSK's Kalman gain) must lie in (0, 1], got {kappa!r}")
        self.kappa = float(kappa)
        super().__init__()

    def __call__(self, v: Tensor) -> Tensor:
        if self.kappa == 1.0:
            return v
        g = v if self.g is None else (1.0 - self.kappa) * self.g.to(v.device) + self.kappa * v
        self._pending = g
        return g


def kalman(base: str, name: str | None = None) -> Algorithm:
    """``base`` + DiSK: its rows taken at two points, its noisy update filtered (module docstring).
    The accounting, sensitivity and refusals are the base's."""
    b = get(base)
    if b.name == "disk" or b.name.endswith("+" + SUFFIX):
        raise ConfigError(f"`algo='{b.name}'` already runs DiSK: use it without '+disk'")
    own = {k for s in b.schema for k in (s.key, *s.aliases)}

    def split(s: dict) -> dict:
        return {k: v for k, v in s.items() if k in own}

    def base_cfg(cfg: AlgoConfig) -> AlgoConfig:
        return replace(cfg, extra={k: v for k, v in (cfg.extra or {}).items() if k in own})

    def build(cfg: AlgoConfig, s: dict, batch_size: float, key: SecretKey | None) -> Parts:
        parts = b.build(cfg, split(s), batch_size, key)
        kf = KalmanFilter(s["kappa"])
        return Parts(parts.per_sample, parts.error_feedback, kf if parts.post is None else Chain(kf, parts.post),
                     parts.divisor)

    def source(model: nn.Module, loss_fn: LossFn, cfg: AlgoConfig, s: dict, *, n: int, batch_size: float,
               key: SecretKey | None) -> RowSource:
        rows = b.row_source(model, loss_fn, base_cfg(cfg), n=n, batch_size=batch_size, key=key)
        return TwoPointRows(rows, rows.layout.params(model), s["disk_gamma"], combination(s["kappa"], s["disk_gamma"]))

    def validate(cfg: AlgoConfig, s: dict, q: float, batch_size: float) -> None:
        if b.validate is not None:
            b.validate(base_cfg(cfg), split(s), q, batch_size)

    def note(cfg: AlgoConfig, s: dict) -> str:
        c = combination(s["kappa"], s["disk_gamma"])
        if b.note is not None:
            what = b.note(base_cfg(cfg), split(s))
        else:
            last = b.build(cfg, split(s), 1.0, None).per_sample[-1]
            what = f"per-example L2 sensitivity {last.bound:g} ({type(last).__name__})"
        return (f"{what}; DiSK: each row is {c:.4g} g_i(x_t + {s['disk_gamma']:g} (x_t - x_(t-1))) + {1 - c:.4g} "
                f"g_i(x_t), one example's gradients at two released points, bounded by the base's stage before "
                f"the one noise release; the Kalman filter (kappa {s['kappa']:g}) is post-processing")

    dice_grad_bound = None if b.dice_grad_bound is None else (lambda cfg, s: b.dice_grad_bound(base_cfg(cfg), split(s)))
    gradient_noise = None if b.gradient_noise is None else (
        lambda cfg, s, z, bs: b.gradient_noise(base_cfg(cfg), split(s), z, bs))
    return Algorithm(name or f"{b.name}+{SUFFIX}", f"{b.description} + DiSK (Zhang et al. 2025)", b.private,
                     b.accounting, build, schema=(*b.schema, *SETTINGS), source=source, optimizer=b.optimizer,
                     certifiable=b.certifiable, why_not_certifiable=b.why_not_certifiable, dice_units=b.dice_units,
                     dice_grad_bound=dice_grad_bound, validate=validate, note=note, gradient_noise=gradient_noise,
                     bandable=b.bandable)  # both points are one example's gradients at one step


def kalman_name(algo: str) -> str:
    """The algorithm ``--algo algo --kalman`` runs: ``algo+disk`` (refused for a DiSK algorithm)."""
    name = f"{algo}+{SUFFIX}"
    get(name)  # refuses an unknown base or a second DiSK stage now, with the reason
    return name


registry.DERIVED[SUFFIX] = kalman
DISK = register(kalman("dpsgd", name="disk"))
