"""The papers' small problems, run through the real engine.

Each problem is a finite data set ``xi_1..xi_n`` (rows of ``[n, d]``) and a per-example loss of the
residual ``x - xi_i``; the iterate ``x`` is the only parameter of a tiny ``nn.Module``
(:class:`Iterate`), so every ``--algo`` of ``clipbias train`` runs unchanged through
:class:`clipbias.engine.DPEngine` (full batch unless a batch size is given). Problems:

* ``dice-b1``: Zhang et al. (DiceSGD) App. B.1. Huber loss with delta C' = ceil(C) + 1, data
  xi = -1 (C' times) and xi = C' (once); optimum 0; clipped SGD's fixed point C/C' - 1 (-0.5 at C = 1).
* ``chen-ex2``: Chen, Wu, Hong Example 2. f(x) = 1/2 sum_i 1/2 (x - a_i)^2, a = (-3, 3), c = 1;
  optimum 0; every x in [-2, 2] is stationary for clipped SGD, which started at 5 stops at 2.
* ``chen-mixture``: Chen et al. Section 5's high-dimensional example. f(x) = (1/n) sum 1/2 ||x - z_i||^2,
  n = 10000, d = 10, z_i from a mixture of three N(mu_k, I), mu_k ~ N(0, 36 I), N(0, 4 I), N(0, I)
  (equal weights: the paper does not give them); optimum mean(z). Clipped SGD's fixed point is the
  minimiser of sum_i H_c(||x - z_i||) (H_c: Huber with delta c), computed independently here.
* ``xiao-two-sample``: Xiao et al. Section 3.1. F(w) = (w - 1)^2 + (w + 3)^2 (two samples 1, -3),
  start w = 0 where the per-sample gradients are -2 and 6; optimum -1; normalised (and clipped, c <= 2)
  SGD has zero update at w = 0 and never moves.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np
import torch
from torch import Tensor, nn

from .. import algorithms, privacy
from ..config import AlgoConfig
from ..engine.core import DPEngine, run_steps
from ..errors import ClipbiasError, ConfigError

# Algorithms that cannot run on a toy problem, with the reason (checked only if registered).
NOT_APPLICABLE = {
    "self-aug": "self-augmentation averages gradients over random data augmentations of an image; a "
                "toy problem's examples are points, not images",
    "batch-clip": "BatchClipping computes each gradient together with public features through a "
                  "BatchNorm network; a toy problem has no network and no public features",
    "dice-self-aug": "self-augmentation averages gradients over random data augmentations of an image; a "
                     "toy problem's examples are points, not images",
}


class Iterate(nn.Module):
    """The model of a toy problem: ``forward(xi) = x - xi`` (the residual), ``x`` the only parameter."""

    def __init__(self, x0: Tensor) -> None:
        super().__init__()
        self.x = nn.Parameter(x0.detach().clone().float())

    def forward(self, xi: Tensor) -> Tensor:
        return self.x - xi


@dataclass(frozen=True)
class Instance:
    """One built problem: data, per-example loss of the residual, start, optimum, predictions."""

    data: Tensor                       # [n, d]
    loss_fn: Callable[[Tensor, Tensor], Tensor]
    x0: Tensor                         # [d]
    x_opt: Tensor                      # [d]
    predicted: dict[str, list[float]]  # algorithm -> fixed point the paper's analysis predicts
    notes: str = ""


@dataclass(frozen=True)
class Problem:
    name: str
    title: str
    source: str
    defaults: dict
    build: Callable[["Settings"], Instance]
    compare: tuple[str, ...] | None = None  # default figure algorithms (None: every registered one)


@dataclass(frozen=True)
class Settings:
    """Everything a toy run depends on (all reported in the output)."""

    lr: float
    steps: int
    clip: float
    ef_clip: float | None = None
    gamma: float = 0.01
    noise_multiplier: float = 1.0
    batch_size: float | None = None  # None: full batch
    x0: float | None = None           # start (broadcast to every coordinate); None: the problem's
    seed: int = 0
    delta: float = 1e-5
    dice_accounting: str = privacy.DEFAULT_DICE_ACCOUNTING
    momentum: float = 0.0
    optimizer: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def basis(self) -> privacy.DiceBasis:
        """The error-feedback basis the setting names (a ConfigError for an unknown one)."""
        return privacy.dice.basis(self.dice_accounting)


# ----------------------------------------------------------------------------- losses

def _huber(delta: float):
    def loss(out: Tensor, _y: Tensor) -> Tensor:
        return nn.functional.huber_loss(out, torch.zeros_like(out), delta=delta, reduction="sum")
    loss.__name__ = f"huber_{delta:g}"
    return loss


def half_square(out: Tensor, _y: Tensor) -> Tensor:
    """1/2 ||x - xi||^2: gradient x - xi."""
    return 0.5 * (out ** 2).sum()


def square(out: Tensor, _y: Tensor) -> Tensor:
    """||x - xi||^2: gradient 2 (x - xi) (Xiao et al.'s per-sample loss (w - s)^2)."""
    return (out ** 2).sum()


def _x0(s: Settings, default: float, d: int = 1) -> Tensor:
    return torch.full((d,), float(default if s.x0 is None else s.x0), dtype=torch.float64)


# ----------------------------------------------------------------------------- problems

def dice_b1_data(c: float) -> tuple[Tensor, int]:
    """App. B.1 data for clip C: xi = -1 (C' times), xi = C' (once), C' = ceil(C) + 1."""
    cp = math.ceil(c) + 1
    return torch.tensor([-1.0] * cp + [float(cp)], dtype=torch.float64).unsqueeze(1), cp


def dice_b1_clipped_fixed_point(c: float) -> float:
    """Clipped SGD's stationary point: C' clip(x + 1, C) + clip(x - C', C) = 0 gives x = C/C' - 1
    (|x + 1| = C/C' < C while x - C' < -C)."""
    cp = math.ceil(c) + 1
    return c / cp - 1.0


def _build_dice_b1(s: Settings) -> Instance:
    data, cp = dice_b1_data(s.clip)
    fp = dice_b1_clipped_fixed_point(s.clip)
    return Instance(data, _huber(float(cp)), _x0(s, 1.0), torch.zeros(1, dtype=torch.float64),
                    {"sgd": [0.0], "clip-sgd": [fp], "dpsgd": [fp], "ef-sgd": [0.0], "dice": [0.0]},
                    f"C = {s.clip:g}, C' = {cp}, data = {cp} x (-1) and 1 x {cp}; Huber delta C'")


def _build_chen_ex2(s: Settings) -> Instance:
    data = torch.tensor([[-3.0], [3.0]], dtype=torch.float64)
    x0 = _x0(s, 5.0)
    pred = {"sgd": [0.0], "ef-sgd": [0.0], "dice": [0.0]}
    fp = chen_ex2_clipped_fixed_point(float(x0[0]), s.clip)
    if fp is not None:
        pred["clip-sgd"] = pred["dpsgd"] = [fp]
    return Instance(data, half_square, x0, torch.zeros(1, dtype=torch.float64), pred,
                    f"a = (-3, 3), c = {s.clip:g}; with c = 1 every x in [-2, 2] is stationary for clipped SGD")


def chen_ex2_clipped_fixed_point(x0: float, c: float) -> float | None:
    """Where full-batch clipped GD started at ``x0`` stops on Example 2 (small steps): the mean
    clipped gradient (clip(x+3, c) + clip(x-3, c)) / 2 vanishes on [-(3 - c), 3 - c] when c <= 3,
    so a start outside that interval stops at its nearer end; a start inside never moves."""
    if c > 3:
        return 0.0
    edge = 3.0 - c
    return max(-edge, min(edge, x0))


def chen_mixture_data(seed: int = 0, n: int = 10000, d: int = 10) -> Tensor:
    """Chen et al.'s mixture: 3 components N(mu_k, I), mu_k ~ N(0, s_k^2 I), s = (6, 2, 1),
    equal weights; deterministic for a seed."""
    gen = torch.Generator().manual_seed(seed)
    mus = torch.stack([torch.randn(d, generator=gen, dtype=torch.float64) * sd for sd in (6.0, 2.0, 1.0)])
    comp = torch.randint(0, 3, (n,), generator=gen)
    return mus[comp] + torch.randn(n, d, generator=gen, dtype=torch.float64)


def huber_center(z: Tensor, c: float, x0: Tensor | None = None) -> Tensor:
    """argmin_x sum_i H_c(||x - z_i||), H_c(r) = r^2/2 (r <= c), c r - c^2/2 (r > c): the point where
    the mean of clip(x - z_i, c) vanishes, i.e. full-batch clipped GD's fixed point (convex problem;
    solved with scipy L-BFGS, independently of the engine)."""
    from scipy.optimize import minimize

    zz = z.double().numpy()

    def fun(x: np.ndarray) -> tuple[float, np.ndarray]:
        r = x[None, :] - zz
        nr = np.linalg.norm(r, axis=1)
        small = nr <= c
        val = np.where(small, 0.5 * nr ** 2, c * nr - 0.5 * c * c).mean()
        scale = np.where(small, 1.0, c / np.maximum(nr, 1e-300))
        return float(val), (r * scale[:, None]).mean(0)

    start = zz.mean(0) if x0 is None else x0.double().numpy()
    res = minimize(fun, start, jac=True, method="L-BFGS-B", options={"gtol": 1e-12, "ftol": 1e-15,
                                                                       "maxiter": 10000})
    return torch.from_numpy(res.x)


def _build_chen_mixture(s: Settings) -> Instance:
    z = chen_mixture_data(s.seed)
    x_opt = z.mean(0)
    fp = huber_center(z, s.clip).tolist()
    return Instance(z, half_square, _x0(s, 0.0, z.shape[1]), x_opt,
                    {"sgd": x_opt.tolist(), "clip-sgd": fp, "dpsgd": fp, "ef-sgd": x_opt.tolist(),
                     "dice": x_opt.tolist()},
                    f"n = {z.shape[0]}, d = {z.shape[1]}, 3 equal-weight components N(mu_k, I), "
                    f"mu_k ~ N(0, s_k^2 I), s = (6, 2, 1), data seed {s.seed}; DP noise std on the mean "
                    f"update = z * C / B (Chen et al. use std 1: z = B / C)")


def _build_xiao(s: Settings) -> Instance:
    data = torch.tensor([[1.0], [-3.0]], dtype=torch.float64)
    x0 = _x0(s, 0.0)
    pred = {"sgd": [-1.0], "ef-sgd": [-1.0], "dice": [-1.0]}
    if float(x0[0]) == 0.0:
        pred["normalized"] = [0.0]  # exact normalisation (gamma -> 0): zero update at w = 0
        if s.clip <= 2.0:
            pred["clip-sgd"] = pred["dpsgd"] = [0.0]
    return Instance(data, square, x0, torch.tensor([-1.0], dtype=torch.float64), pred,
                    "F(w) = (w - 1)^2 + (w + 3)^2 (engine averages: F/2, same minimiser); "
                    "per-sample gradients at w = 0: -2 and 6")


PROBLEMS: dict[str, Problem] = {p.name: p for p in [
    Problem("dice-b1", "DiceSGD App. B.1: constant clipping bias",
            "Zhang, Bu, Wu, Hong, 'DP SGD without clipping bias: an error-feedback approach', App. B.1",
            dict(lr=0.1, steps=600, clip=1.0, noise_multiplier=1.0), _build_dice_b1),
    Problem("chen-ex2", "Chen et al. Example 2: a = (-3, 3), c = 1",
            "Chen, Wu, Hong, 'Understanding gradient clipping in private SGD: a geometric perspective', Example 2",
            dict(lr=0.05, steps=600, clip=1.0, noise_multiplier=1.0), _build_chen_ex2),
    Problem("chen-mixture", "Chen et al. high-dimensional mixture (n = 10000, d = 10)",
            "Chen, Wu, Hong, Section 5 (Figure 4, right)",
            dict(lr=0.015, steps=1500, clip=1.0, noise_multiplier=10000.0), _build_chen_mixture,
            # n = 10000 per-example rows per step: the default figure keeps to the core algorithms
            ("sgd", "clip-sgd", "ef-sgd", "dpsgd", "dice")),
    Problem("xiao-two-sample", "Xiao et al. two-sample example: F(w) = (w-1)^2 + (w+3)^2 from w = 0",
            "Xiao, Xiang, Wang, Devadas, 'A theory to instruct DP learning via clipping bias reduction', Section 3.1",
            dict(lr=0.05, steps=600, clip=1.0, gamma=1e-6, noise_multiplier=1.0), _build_xiao),
]}


def get_problem(name: str) -> Problem:
    if name not in PROBLEMS:
        raise ConfigError(f"`problem` must be one of {', '.join(PROBLEMS)}, got {name!r}")
    return PROBLEMS[name]


def settings_for(problem: str, **overrides) -> Settings:
    """The problem's default settings with ``overrides`` (None values are ignored)."""
    p = get_problem(problem)
    kw = {**p.defaults, **{k: v for k, v in overrides.items() if v is not None}}
    return Settings(**kw)


# ----------------------------------------------------------------------------- runner

class NotApplicable(ClipbiasError):
    """The algorithm does not apply to this toy problem (the message says why)."""


class TooSlow(NotApplicable):
    """The run would exceed the time budget of a default comparison (the message says how long)."""


@dataclass
class ToyResult:
    problem: str
    algo: str
    x_final: list[float]
    x_opt: list[float]
    distance: float
    distances: list[float]            # ||x_t - x*|| for t = 0..steps
    smoothed: list[float]             # ||mean(x_{t-w+1..t}) - x*|| (running mean, window w)
    x_tail_mean: list[float]          # mean of the last 10% of iterates (noisy runs)
    distance_tail_mean: float
    mean_distance_second_half: float  # mean of ||x_t - x*|| over t > steps/2 (noisy runs)
    predicted_fixed_point: list[float] | None
    privacy: dict
    settings: dict

    def to_dict(self, curve: bool = False) -> dict:
        d = asdict(self)
        scalar = len(self.x_final) == 1
        for k in ("x_final", "x_opt", "x_tail_mean", "predicted_fixed_point"):
            if scalar and d[k] is not None:
                d[k] = d[k][0]
        if not curve:
            d.pop("distances")
            d.pop("smoothed")
        return d


def smoothing_window(steps: int) -> int:
    """Window of the running mean of iterates drawn for noisy runs (5% of the run, >= 1)."""
    return max(1, steps // 20)


def run(problem: str, algo: str, settings: Settings | None = None, instance: Instance | None = None,
        time_budget: float | None = None) -> ToyResult:
    """Run ``algo`` (any registered ``--algo`` name) on ``problem`` through :class:`DPEngine`.

    Raises :class:`NotApplicable` when the algorithm cannot run on the problem, ``ConfigError``
    (or another ``ClipbiasError``) for bad settings, and :class:`TooSlow` when ``time_budget``
    (seconds) is given and the first steps project a longer run.
    """
    s = settings or settings_for(problem)
    inst = instance or get_problem(problem).build(s)
    a = algorithms.get(algo)
    if algo in NOT_APPLICABLE:
        raise NotApplicable(f"{algo} does not apply to toy problems: {NOT_APPLICABLE[algo]}")
    n, d = inst.data.shape
    if s.steps < 1:
        raise ConfigError(f"`steps` must be >= 1, got {s.steps}")
    # toy problems study the fixed point: the paper's C2 = C1 unless given (the engine's default r = 0.01
    # is for private training, where the sound privacy cost grows with r)
    ef_clip = s.ef_clip if s.ef_clip is not None else s.clip
    cfg = AlgoConfig(lr=s.lr, clip=s.clip, ef_clip=ef_clip, gamma=s.gamma, momentum=s.momentum,
                     optimizer=s.optimizer, extra=dict(s.extra))
    torch.manual_seed(s.seed)
    model = Iterate(inst.x0)
    batch = float(n) if s.batch_size is None else float(s.batch_size)
    engine = DPEngine(model, algo, n=n, batch_size=batch, steps=s.steps, delta=s.delta,
                      noise_multiplier=s.noise_multiplier if a.private else None,
                      dice_accounting=s.basis, config=cfg, loss_fn=inst.loss_fn,
                      max_physical_batch=max(n, 1),
                      noise_seed=s.seed)  # toy problems are deterministic research runs
    x = inst.data.float()
    y = torch.zeros(n, dtype=torch.long)
    x_opt64 = inst.x_opt.double()
    traj = [model.x.detach().double().clone()]
    tail_from = s.steps - max(1, s.steps // 10)
    clock: list[float] = []

    def trace(engine: DPEngine, losses: Tensor) -> None:
        traj.append(model.x.detach().double().clone())
        if time_budget is None or engine.steps_taken > 4:
            return
        clock.append(time.perf_counter())  # after steps 1..4: three steps' time projects the run
        if engine.steps_taken == 4:
            per_step = (clock[-1] - clock[0]) / 3
            if per_step * s.steps > time_budget:
                raise TooSlow(f"{algo} would take about {per_step * s.steps:.0f} s here ({per_step * 1e3:.1f} "
                              f"ms/step x {s.steps} steps; budget {time_budget:g} s): run it explicitly with "
                              f"--algo or --compare, or with a smaller --batch-size")
    run_steps(engine, x, y, after=trace)
    xs = torch.stack(traj)  # [steps + 1, d]
    dist = (xs - x_opt64).norm(dim=1).tolist()
    w = smoothing_window(s.steps)
    cs = torch.cat([torch.zeros(1, d, dtype=torch.float64), xs.cumsum(0)])
    lo = (torch.arange(len(xs)) + 1 - w).clamp_min(0)
    run_mean = (cs[1:] - cs[lo]) / (torch.arange(len(xs)) + 1 - lo).unsqueeze(1).double()
    smoothed = (run_mean - x_opt64).norm(dim=1).tolist()
    tail = xs[tail_from + 1:].mean(0)
    x_final = model.x.detach().double()
    pred = inst.predicted.get(algo)
    try:
        priv = engine.privacy().to_dict()
    except ClipbiasError as e:  # report, never invent, a guarantee
        priv = {"epsilon": None, "error": str(e)}
    if engine.mechanism.takes_basis and engine.spec.dice is not None:
        priv["note"] = (f"DiceSGD accounted with dice_accounting={engine.mechanism.basis.name!r} at feedback ratio "
                        f"r = B C2 / C1 = {engine.spec.dice.ratio:g}: the sound cost grows with r")
    settings_out = {**asdict(s), "problem": problem, "algo": algo, "n": n, "d": d,
                    "x0": inst.x0.tolist() if d > 1 else float(inst.x0[0]),
                    "batch_size": batch, "full_batch": s.batch_size is None,
                    "noise_multiplier": engine.noise_multiplier, "private": a.private,
                    "sample_rate": engine.sample_rate, "notes": inst.notes}
    return ToyResult(problem, algo, x_final.tolist(), inst.x_opt.tolist(), dist[-1], dist, smoothed,
                     tail.tolist(), float((tail - inst.x_opt).norm()), float(sum(dist[s.steps // 2 + 1:]) /
                                                                              len(dist[s.steps // 2 + 1:])),
                     pred, priv, settings_out)


def run_all(problem: str, settings: Settings | None = None, algos: list[str] | None = None,
            instance: Instance | None = None, time_budget: float | None = None
            ) -> tuple[dict[str, ToyResult], dict[str, str]]:
    """Run every registered algorithm (or ``algos``) on one problem with the same settings.

    Returns ``(results, skipped)``; ``skipped`` maps an algorithm to the reason it did not run
    (not applicable, refused settings, or over ``time_budget`` seconds).
    """
    s = settings or settings_for(problem)
    inst = instance or get_problem(problem).build(s)
    results, skipped = {}, {}
    for name in algos or list(algorithms.ALGORITHMS):
        try:
            results[name] = run(problem, name, s, inst, time_budget)
        except NotApplicable as e:
            skipped[name] = str(e)
        except ClipbiasError as e:
            skipped[name] = f"{name} did not run with these settings: {e}"
    return results, skipped

