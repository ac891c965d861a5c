"""Pre-clipping perturbation (Chen, Wu, Hong 2020, Section 5): ``clip(g_i + k zeta_i, C)``.

``zeta_i ~ N(0, I_d)`` is drawn fresh for every example and step. The perturbation is *not* a
privacy mechanism (it is never released and its scale is not calibrated to anything); it trades
clipping bias for variance (Chen et al. Thm. 6: ``|b_t| = O(sigma_xi^2 / k^2)``). The privacy
accounting is that of the clip that follows: sensitivity C, Poisson-subsampled Gaussian.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import Setting, real
from ..errors import ConfigError
from ..sampling import PERTURB, PROBE_STEP, keyed_normal, mix
from ..transforms import PerSample, StepContext


class Perturb(PerSample):
    """``g_i -> g_i + k zeta_i`` (no norm bound: ``bound = None``; a Clip/Normalize must follow).

    With example indices in the context, ``zeta_i`` is a pure function of ``(seed, step, index)``
    (exact resume, independent of micro-batching). Without indices a sequential generator owned by
    the stage is used; its state is in ``state_dict``.
    """

    bound = None

    def __init__(self, k: float, seed: int = 0) -> None:
        if not (isinstance(k, (int, float)) and k > 0):
            raise ConfigError(f"--perturb-k (perturbation scale k) must be > 0, got {k!r}")
        self.k, self.seed = float(k), int(seed)
        # a stream of its own: the pipeline's GaussianNoise is seeded with the same seed
        self.generator = torch.Generator().manual_seed(mix(self.seed, PERTURB))
        self._start: torch.Tensor | None = None  # generator state at the step's first draw

    def noise(self, g: Tensor, ctx: StepContext) -> Tensor:
        if ctx.indices is not None:
            return keyed_normal(self.seed, PERTURB, ctx.step, ctx.indices.tolist(), g.shape[1],
                                g.device, g.dtype)
        if self._start is None:
            self._start = self.generator.get_state()
        return torch.randn(g.shape, generator=self.generator, dtype=g.dtype).to(g.device)

    def __call__(self, g: Tensor, ctx: StepContext) -> Tensor:
        return g + self.k * self.noise(g, ctx)

    def probe(self, g: Tensor, ctx: StepContext) -> Tensor:
        """Probe randomness (keyed at ``PROBE_STEP``): the sequential generator is not touched."""
        keys = ctx.indices.tolist() if ctx.indices is not None else list(range(len(g)))
        return g + self.k * keyed_normal(self.seed, PERTURB, PROBE_STEP, keys, g.shape[1], g.device, g.dtype)

    def commit(self) -> None:
        self._start = None

    def rollback(self) -> None:
        if self._start is not None:  # un-draw what the failed step drew
            self.generator.set_state(self._start)
        self._start = None

    def state_dict(self) -> dict:
        return {"seed": self.seed, "rng": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        # the key of the draws is part of the (secret) stream state: a resumed run continues it
        self.seed = int(state.get("seed", self.seed))
        self.generator.set_state(state["rng"])
        self._start = None


K_PERTURB = Setting("k", 0.01, "a number > 0", real(0, float("inf"), lo_open=True), "--perturb-k",
                    float, "scale k of the pre-clipping perturbation k N(0, I)",
                    aliases=("perturb_k",))
