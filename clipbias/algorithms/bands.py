"""Banded correlated noise (banded matrix factorisation; Choquette-Choo, Ganesh, McKenna, McMahan,
Rush, Thakurta, Xu, NeurIPS 2023) for the Gaussian-accounted algorithms that declare ``bandable``: the
mechanism, its coefficients and its accounting. The stage is the one noise stage,
``step.GaussianNoise`` with b coefficients (one coefficient: independent noise).

With b bands the mechanism releases, at step t, ``y_t = sum_{k < b} c_k v_{t-k} + std Z_t`` (v: the
clipped sum divided by B, as the plain noise stage receives it; Z_t i.i.d. standard normal, rounded
onto the grid like every release) and hands the optimizer

    g_t = (y_t - sum_{1 <= k < b} c_k g_{t-k}) / c_0  =  v_t + w_t,   w = C^{-1} std Z,

where C is the lower-triangular banded Toeplitz matrix of ``c``: post-processing of the releases.
The noise an update receives is then negatively correlated with the noise of the b - 1 updates before
it, so that the sums of updates the optimizer accumulates (its momentum and the iterate) carry less
noise than independent draws of the same scale would.

Privacy (docs/privacy.md, "Banded noise"): with ``sum c_k^2 = 1`` and cyclic Poisson participation
(``PoissonSampler(bands=b)``: an example joins only steps of one class mod b, each with probability
b q), one participation reaches b consecutive releases, those of different participations are
disjoint, and each such block is one Gaussian release of sensitivity C / B at the step's rate: the
subsampled Gaussian at rate b q composed ceil(T / b) times (``AccountingSpec.bands``). b = 1 is the
plain noise stage.

Coefficients (``bands_strategy``: a ``NoiseStrategy`` of ``NOISE_STRATEGIES``): ``taylor``, the first b
Taylor coefficients of ``((1 - x)(1 - beta x))^(-1/2)`` (the square root of the workload of SGD with
momentum beta, the run's momentum), scaled to unit norm; or ``optimized``, the unit-norm coefficients
that minimise the expected total squared error of the T iterates, ``||A C^{-1}||_F^2``
(``band_strategy``). Either is private with the same proof.
"""

from __future__ import annotations

from dataclasses import replace

from .. import distributed
from ..errors import ConfigError
from ..privacy import AccountingSpec
from ..registry import Registry
from ..step import GaussianNoise
from .band_taylor import coefficients


class NoiseStrategy:
    """One way of shaping the noise across steps: a value of ``bands_strategy`` (``NOISE_STRATEGIES``, looked up
    by ``noise_strategy``). It carries its constraints: ``min_bands`` (the participation classes it needs),
    ``needs_steps`` (whether its shape depends on the run's length), ``amplified`` (whether its accounting
    takes amplification by sampling: the banded accounting, ``privacy.Banded``, does; BLT's, ``privacy.BLTStrategy``,
    does not), and gives the noise's ``shape`` (coefficients, or a ``blt.BLT``) for a run."""

    name = ""
    min_bands = 1
    needs_steps = False
    amplified = True
    optimised = False  # the shape is optimised for the run's workload
    accounted_by_shape = False  # the accounting reads the shape (its sensitivity), not only the number of bands

    def check(self, bands: int) -> None:
        """Refuse ``bands`` participation classes the strategy cannot use."""

    def optimize(self, bands: int, steps: int, momentum: float):
        """The shape optimised for the run (the strategies with ``needs_steps``; ``shape`` calls it only there)."""
        raise ConfigError(f"bands_strategy={self.name!r} has no shape to optimise for the run's length")

    def warning(self, bands: int, sample_rate: float) -> str | None:
        """What to say about ``bands`` classes at ``sample_rate``, or None."""
        return None

    def shape(self, bands: int, momentum: float = 0.0, steps: float | None = None):
        """The noise's coefficients (or BLT strategy) for ``bands`` bands, shaped for SGD with ``momentum`` over
        ``steps`` steps; with torchrun, rank 0's (every rank then bands with the same bits)."""
        self.check(bands)
        if not self.needs_steps or bands == 1:
            return coefficients(bands, momentum)
        coefficients(bands, momentum)  # refuses a momentum outside [0, 1)
        if not (isinstance(steps, int) and steps >= 1):
            raise ConfigError(f"bands_strategy={self.name!r} shapes the noise for the run's length: give epochs or "
                              f"steps (got steps={steps!r})")
        return distributed.from_rank0(lambda: self.optimize(bands, steps, momentum))

    def __repr__(self) -> str:
        return f"NoiseStrategy({self.name!r})"


class TaylorBands(NoiseStrategy):
    """The first b Taylor coefficients of the workload's square root (the default; one band: independent noise)."""

    name = "taylor"


class OptimizedBands(NoiseStrategy):
    """Unit-norm banded coefficients optimised for the run's workload (``band_strategy``): the banded accounting."""

    name, needs_steps, optimised = "optimized", True, True

    def optimize(self, bands, steps, momentum):
        from .band_strategy import optimized
        return optimized(bands, steps, momentum)


class BLTBands(NoiseStrategy):
    """BLT noise (``blt``) in b >= 2 classes, accounted without amplification."""

    name, min_bands, needs_steps, amplified, optimised, accounted_by_shape = "blt", 2, True, False, True, True

    def check(self, bands):
        if bands < self.min_bands:
            raise ConfigError("bands_strategy='blt' needs `bands` >= 2 participation classes: it claims no "
                              "amplification by sampling, so give bands = floor(1 / sample rate) (every example "
                              "in one step per epoch)")

    def optimize(self, bands, steps, momentum):
        from .blt import optimized
        return optimized(steps, bands, momentum)

    def warning(self, bands, sample_rate):
        return blt_classes_warning(bands, sample_rate)


NOISE_STRATEGIES: Registry[NoiseStrategy] = Registry("a noise strategy", "bands_strategy")
TAYLOR = NOISE_STRATEGIES.register(TaylorBands())
OPTIMIZED = NOISE_STRATEGIES.register(OptimizedBands())
BLT_NOISE = NOISE_STRATEGIES.register(BLTBands())


def noise_strategy(spelling: str | NoiseStrategy) -> NoiseStrategy:
    """The strategy a ``bands_strategy`` spelling names (a ``NoiseStrategy`` is itself), else a ConfigError."""
    return spelling if isinstance(spelling, NoiseStrategy) else NOISE_STRATEGIES.lookup(spelling)


def check_strategy(strategy: str | NoiseStrategy) -> NoiseStrategy:
    """The ``NoiseStrategy`` of a ``bands_strategy``, or a ConfigError that lists ``NOISE_STRATEGIES``."""
    return noise_strategy(strategy)


def band_coefficients(bands: int, momentum: float = 0.0, strategy: str | NoiseStrategy = TAYLOR,
                      steps: float | None = None):
    """The coefficients of ``strategy`` (``taylor``, ``optimized`` or ``blt``, which need the run's finite number
    of ``steps``): ``NoiseStrategy.shape``."""
    return noise_strategy(strategy).shape(bands, momentum, steps)


def blt_classes_warning(bands: int, sample_rate: float) -> str | None:
    """With BLT noise, a warning when fewer classes than floor(1 / q) are asked for: the accounting claims no
    amplification, so every example's participations count as taken, and more classes would give each
    example fewer of them (less noise for the same epsilon)."""
    import math
    best = math.floor(1 / sample_rate + 1e-9)
    if bands < best:
        return (f"BLT noise with `bands={bands}` classes at sample rate {sample_rate:.4g}: its accounting counts every "
                f"step of an example's class as a participation (no amplification), so bands = floor(1 / q) = "
                f"{best} (one step per epoch) needs less noise for the same epsilon")
    return None


BandedNoise = GaussianNoise  # the noise stage is one type: ``GaussianNoise(std, key, coefs, strategy)``


def banded_spec(spec: AccountingSpec, bands: int, shape=None) -> AccountingSpec:
    """``spec`` with ``bands`` bands, its note saying what the accounting then rests on; ``shape`` a
    ``blt.BLT``: BLT noise in ``bands`` classes, accounted without amplification (``blt``)."""
    from .blt import BLT
    if isinstance(shape, BLT):
        note = (f"{spec.note}; BLT noise (buffered linear Toeplitz, {len(shape.omegas)} buffers) with cyclic "
                f"participation in {bands} classes: the Gaussian mechanism at sensitivity Delta(T) = sqrt(max over "
                f"classes of sum |C^T C| over the class's steps) (C / B units), no amplification by sampling "
                f"(Denisov et al. 2022 for adaptivity; docs/privacy.md, \"BLT noise\")")
        return replace(spec, bands=bands, note=note, blt=(shape.scale, *shape.omegas, *shape.thetas))
    if bands == 1:
        return spec
    note = (f"{spec.note}; {bands}-banded noise with cyclic Poisson participation in {bands} classes: each "
            f"participation is one Gaussian release over {bands} steps, accounted at rate {bands} q for "
            f"ceil(T / {bands}) steps (Choquette-Choo et al. 2023; docs/privacy.md, \"Banded noise\")")
    return replace(spec, bands=bands, note=note)
