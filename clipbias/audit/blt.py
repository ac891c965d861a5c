"""The mechanism-level audit of BLT noise (``clipbias.algorithms.blt``, ``step.BLTNoise``).

The claim under test (docs/privacy.md, "BLT noise"): an example of participation class l (steps
t = l mod k), contributing at most 1 (in units where the noise std is z) at any subset of its class's
steps, makes the T releases the Gaussian mechanism at sensitivity ``Delta(T) = blt.sensitivity(T)``, so
mu-GDP with mu = Delta(T) / z, no amplification by sampling. The epsilon claimed is the engine's
(``DPEngine(..., bands=k, bands_strategy="blt")``, ``engine.privacy(T)``).

The experiment (``blt_audit``), two worlds of ``runs`` independent runs each, vectorised as the
coordinates of one tensor v of shape (runs,) per step (each coordinate draws its own normal):

* world 0: ``v_t = 0`` at every step; world 1: the canary of class l contributes ``v_t = a_t`` (a scalar,
  |a_t| = 1) at every step of its class, 0 elsewhere; each world through its own ``BLTNoise`` stage
  under a fresh ``SecretKey`` (the engine's strategy and std);
* the adversary sees the stage's outputs ``g_t``, recovers the releases ``y = C g`` (post-processing,
  the dense C of ``blt.column(T)``) and scores the matched statistic ``S = (C a)^T y / (std ||C a||)``:
  exactly N(0, 1) in world 0 and N(||C a|| / std, 1) in world 1, the Neyman-Pearson test of the two
  (the canary's signs are known to it);
* the signs ``a`` (``signs``): ``"plus"`` (+1 at every step of the class) or ``"worst"`` (the pattern
  maximising ``a^T X a`` over the class's steps, X = C^T C: brute force; all +1 when C >= 0);
* the scores become an epsilon lower bound at ``confidence`` by the canary audit's estimators
  (``stats.epsilon_lower_bound``: Clopper-Pearson, distribution-free; ``stats.gdp_epsilon_lower_bound``:
  the Gaussian trade-off reading of the same tests, Nasr et al. 2023). The mechanism has no sampling
  and the test is optimal, so the GDP reading should be close to the claim when the canary attains
  the sensitivity (class 0 with C >= 0), and below it otherwise; the lower bound never above it.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import nn

from ..algorithms.bands import BLT_NOISE
from ..algorithms.blt import BLT
from ..config import AlgoConfig
from ..engine import DPEngine
from ..errors import ConfigError
from ..privacy.pld import gaussian_exact_epsilon
from ..randomness import SecretKey
from ..randomness.key import derive_seed
from ..step import BLTNoise
from .stats import epsilon_lower_bound, gdp_epsilon_lower_bound

SIGNS = ("plus", "worst")
CHUNK = 100_000  # runs per stage: each chunk of runs is one BLTNoise stage under its own key
BRUTE_FORCE_MAX = 20  # steps of a class whose sign patterns "worst" enumerates (2^19 patterns)


@dataclass(frozen=True)
class BLTAudit:
    """One mechanism-level audit of BLT noise: k = ``classes`` participation classes, T = ``steps``, noise
    multiplier z, the canary's class l = ``band_class``; ``momentum`` shapes the strategy (the engine's
    ``AlgoConfig.momentum`` with SGD); ``runs`` per world."""

    classes: int
    steps: int
    noise_multiplier: float
    band_class: int = 0
    runs: int = 100_000
    signs: str = "plus"
    momentum: float = 0.0
    delta: float = 1e-5
    confidence: float = 0.95
    seed: int | None = None  # None: every world's keys from the OS; an int: SecretKey.of(derived seeds)
    run_steps: int | None = None  # steps actually run (default: the planned ``steps``); more: a longer run

    @property
    def length(self) -> int:
        return self.steps if self.run_steps is None else self.run_steps

    def __post_init__(self) -> None:
        for name in ("classes", "steps", "runs"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= (10 if name == "runs" else 2 if name == "classes" else 1)):
                raise ConfigError(f"BLTAudit.{name} must be a whole number (classes >= 2, runs >= 10), got {v!r}")
        if not (isinstance(self.band_class, int) and 0 <= self.band_class < min(self.classes, self.steps)):
            raise ConfigError(f"BLTAudit.band_class must be a class with a step in [0, min(classes, steps)), "
                              f"got {self.band_class!r}")
        if self.run_steps is not None and not (isinstance(self.run_steps, int) and self.run_steps > self.band_class):
            raise ConfigError(f"BLTAudit.run_steps must be a whole number > band_class, got {self.run_steps!r}")
        if not self.noise_multiplier > 0:
            raise ConfigError(f"BLTAudit.noise_multiplier must be > 0, got {self.noise_multiplier!r}")
        if self.signs not in SIGNS:
            raise ConfigError(f"BLTAudit.signs must be one of {', '.join(SIGNS)}, got {self.signs!r}")


def engine_for(audit: BLTAudit) -> DPEngine:
    """The engine whose claim is audited: DPSGD (clip 1, B = 1, so the noise std is z and a contribution of
    norm 1 is one clip) in k classes with BLT noise for T steps (n = k examples, q = 1 / k)."""
    model = nn.Linear(1, 1, bias=False)
    return DPEngine(model, "dpsgd", n=audit.classes, batch_size=1, steps=audit.steps,
                    noise_multiplier=audit.noise_multiplier, delta=audit.delta, bands=audit.classes,
                    bands_strategy=BLT_NOISE, config=AlgoConfig(lr=1.0, clip=1.0, momentum=audit.momentum))


def dense(blt: BLT, steps: int) -> np.ndarray:
    """The T x T lower-triangular Toeplitz C of ``blt`` (first column ``blt.column(T)``)."""
    c = blt.column(steps)
    i, j = np.indices((steps, steps))
    return np.where(i >= j, c[np.clip(i - j, 0, steps - 1)], 0.0)


def class_steps(classes: int, steps: int, band_class: int) -> np.ndarray:
    return np.arange(band_class, steps, classes)


def worst_signs(x: np.ndarray) -> np.ndarray:
    """The signs s (s_0 = +1) maximising ``s^T x s`` (brute force over the 2^(m-1) patterns)."""
    m = len(x)
    if m > BRUTE_FORCE_MAX:
        raise ConfigError(f"signs='worst' enumerates the sign patterns of at most {BRUTE_FORCE_MAX} steps, got {m}")
    if m == 1:
        return np.ones(1)
    pats = np.array(list(itertools.product((1.0, -1.0), repeat=m - 1)))
    pats = np.concatenate((np.ones((len(pats), 1)), pats), 1)
    vals = np.einsum("pi,ij,pj->p", pats, x, pats)
    return pats[int(np.argmax(vals))]


def contribution(blt: BLT, audit: BLTAudit) -> np.ndarray:
    """The canary's contribution a (length ``audit.length``): its signs at the steps of its class, 0 elsewhere."""
    a = np.zeros(audit.length)
    idx = class_steps(audit.classes, audit.length, audit.band_class)
    if audit.signs == "plus":
        a[idx] = 1.0
    else:
        c = dense(blt, audit.length)[:, idx]
        a[idx] = worst_signs(c.T @ c)
    return a


def outputs(blt: BLT, std: float, a: np.ndarray, runs: int, key: SecretKey) -> torch.Tensor:
    """The stage's outputs g (T x runs, float64) of ``runs`` independent runs: ``BLTNoise(std, key, blt)``
    fed ``v_t = a_t`` in every coordinate, T = len(a)."""
    stage, out = BLTNoise(std, key, blt), []
    for t in range(len(a)):
        v = torch.full((runs,), float(a[t]), dtype=torch.float64)
        out.append(stage(v))
        stage.commit()
    return torch.stack(out)


def scores(g: torch.Tensor, blt: BLT, a: np.ndarray, std: float) -> np.ndarray:
    """The adversary's matched statistic per run: ``y = C g``, ``S = (C a)^T y / (std ||C a||)``."""
    c = torch.from_numpy(dense(blt, len(a)))
    y = c @ g
    ca = c @ torch.from_numpy(a)
    return ((ca @ y) / (std * float(ca.norm()))).numpy()


def blt_statistic(u: torch.Tensor, signs: np.ndarray, blt: BLT, std: float, bound: float) -> torch.Tensor:
    """The white-box one-run audit's score of every coordinate (``audit.white_box``) under BLT noise, the
    canary's class unknown: the releases ``y = C u`` recovered from the updates u (T x m), and for each class
    l the matched statistic ``(C a_l)^T y / (std ||C a_l||)`` of the contribution ``a_l`` (the signs times
    the bound at the steps of class l); the score is the largest over the classes."""
    steps = u.shape[0]
    c = torch.from_numpy(dense(blt, steps))
    y = c @ u.double()
    t = np.arange(steps)
    best = None
    for cls in range(min(blt.classes, steps)):
        a = torch.from_numpy(np.where(t % blt.classes == cls, signs[:steps] * bound, 0.0))
        ca = c @ a
        z = (ca @ y) / (std * float(ca.norm()))
        best = z if best is None else torch.maximum(best, z)
    return best


def world_scores(audit: BLTAudit, blt: BLT, std: float, a: np.ndarray, world: int) -> np.ndarray:
    """The scores of ``audit.runs`` runs of world 0 (no canary) or 1 (the canary ``a``), ``CHUNK`` runs per
    stage, each stage under a fresh key (``SecretKey.generate()``, or ``audit.seed``'s derived ones)."""
    fed = a if world else np.zeros_like(a)
    out = []
    for i, start in enumerate(range(0, audit.runs, CHUNK)):
        key = SecretKey.generate() if audit.seed is None else SecretKey.of(derive_seed(audit.seed, world, i))
        out.append(scores(outputs(blt, std, fed, min(CHUNK, audit.runs - start), key), blt, a, std))
    return np.concatenate(out)


def blt_audit(audit: BLTAudit) -> dict:
    """Run the audit (module docstring); returns the JSON-able row."""
    t0 = time.perf_counter()
    engine = engine_for(audit)
    blt, std = engine.noise_shape, engine.pipeline.noise.std
    if not isinstance(blt, BLT):
        raise ConfigError(f"the engine's noise is not BLT noise: {blt!r}")
    rep, planned = engine.privacy(audit.length), engine.privacy(audit.steps)
    a = contribution(blt, audit)
    null, alt = world_scores(audit, blt, std, a, 0), world_scores(audit, blt, std, a, 1)
    lb = epsilon_lower_bound(null, alt, audit.delta, audit.confidence)
    gdp = gdp_epsilon_lower_bound(null, alt, audit.delta, audit.confidence)
    norm_ca = float(np.linalg.norm(dense(blt, audit.length) @ a))
    mu_canary = norm_ca / std  # the canary's exact mu: what a perfect audit of this canary would read
    mu_claim = blt.sensitivity(audit.length) / audit.noise_multiplier
    return {
        **lb, **gdp,
        "epsilon_claimed": rep.epsilon, "certified": rep.certified, "basis": rep.basis,
        "refuted": lb["epsilon_lower_bound"] > rep.epsilon, "confidence": audit.confidence,
        "epsilon_planned": planned.epsilon,  # the claim at the planned T (differs when run_steps > steps)
        "method": "canary", "mode": "blt-mechanism", "trials": audit.runs, "delta": audit.delta,
        "mu_claimed": mu_claim, "mu_canary": mu_canary,
        "epsilon_canary": gaussian_exact_epsilon(1 / mu_canary, 1, audit.delta),
        "mean_shift": float(alt.mean() - null.mean()), "null_mean": float(null.mean()), "null_std": float(null.std()),
        "alt_std": float(alt.std()),
        "sensitivity": blt.sensitivity(audit.length), "strategy": blt.to_dict(), "signs_used": a.tolist(),
        "seconds": time.perf_counter() - t0,
        "settings": {**asdict(audit), "algo": "dpsgd", "steps": audit.length, "planned_steps": audit.steps,
                     "sample_rate": 1 / audit.classes, "batch_size": 1.0, "bands": audit.classes,
                     "bands_strategy": "blt", "claim_noise_multiplier": None},
    }
