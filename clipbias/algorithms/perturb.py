"""Pre-clipping perturbation (Chen, Wu, Hong 2020, Section 5): ``clip(g_i + k zeta_i, C)``.

``zeta_i ~ N(0, I_d)`` is drawn fresh for every example and step. The perturbation is *not* a
privacy mechanism (it is never released and its scale is not calibrated to anything); it trades
clipping bias for variance (Chen et al. Thm. 6: ``|b_t| = O(sigma_xi^2 / k^2)``). The privacy
accounting is that of the clip that follows: sensitivity C, Poisson-subsampled Gaussian.
"""

from __future__ import annotations

from torch import Tensor

from ..config import Setting, real
from ..errors import ConfigError
from ..randomness import PROBE_STEP, Purpose, SecretKey, batch_keys, keyed_normal, normals
from ..step import PerSample, StepContext


class Perturb(PerSample):
    """``g_i -> g_i + k zeta_i`` (no norm bound: ``bound = None``; a Clip/Normalize must follow).

    With example indices in the context, ``zeta_i`` is a pure function of ``(key, step, index)``:
    exact resume, independent of micro-batching. Without indices (rows of a bare ``step(x, y)``, or
    the canary audit's leading axis of independent runs), the j-th call of a step draws one block for
    all its rows at ``(key, step, j)``: fresh for every row, call and step.
    """

    bound = None

    def __init__(self, k: float, key: SecretKey | None = None) -> None:
        if not (isinstance(k, (int, float)) and k > 0):
            raise ConfigError(f"`AlgoConfig.extra['k']` (perturbation scale k) must be > 0, got {k!r}")
        self.k, self.key = float(k), key
        self._calls = 0  # calls without indices in the current step

    def _key(self) -> SecretKey:
        if self.key is None:
            raise ConfigError("Perturb draws its perturbation from the run's secret key: build it with "
                              "Perturb(k, key) (DPEngine does)")
        return self.key

    def noise(self, g: Tensor, ctx: StepContext) -> Tensor:
        if ctx.indices is not None:
            return keyed_normal(self._key(), Purpose.PERTURB, ctx.step, ctx.indices.tolist(), g.shape[-1],
                                g.device, g.dtype)
        self._calls += 1
        z = normals(self._key(), Purpose.PERTURB_BATCH, ctx.step, self._calls - 1, g.numel(), g.device)
        return z.view(g.shape).to(g.dtype)

    def __call__(self, g: Tensor, ctx: StepContext) -> Tensor:
        return self._plus(g, self.noise(g, ctx))

    def probe(self, g: Tensor, ctx: StepContext) -> Tensor:
        """Probe randomness (keyed at ``PROBE_STEP`` by index or position); the call count is untouched."""
        keys = batch_keys(ctx.indices, 0, len(g))
        return self._plus(g, keyed_normal(self._key(), Purpose.PERTURB, PROBE_STEP, keys, g.shape[-1], g.device,
                                          g.dtype))

    def _plus(self, g: Tensor, z: Tensor) -> Tensor:
        """``g + k z`` (z broadcast to g), in the buffer of a fresh ``z`` of g's shape: no [B, d] temporaries."""
        return z.mul_(self.k).add_(g) if z.shape == g.shape else g + self.k * z

    def commit(self) -> None:
        self._calls = 0

    def rollback(self) -> None:
        self._calls = 0


K_PERTURB = Setting("k", 0.01, "a number > 0", real(0, float("inf"), lo_open=True), "--perturb-k",
                    float, "scale k of the pre-clipping perturbation k N(0, I)",
                    aliases=("perturb_k",))
