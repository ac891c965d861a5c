"""The noise stages: ``GaussianNoise`` (independent, or b-banded correlated noise; plain noise is one band)
and ``BLTNoise`` (buffered linear Toeplitz noise), each releasing onto its grid from the run's secret key."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..errors import ConfigError
from ..randomness import Purpose, SecretKey, snapped_gaussian
from ..randomness.prefetch import NormalsPrefetch, wanted
from .stage import Stage


class GaussianNoise(Stage):
    """The noise stage: Gaussian noise, independent across steps (one band, the plain case) or b-banded
    (banded matrix factorisation; ``clipbias.algorithms.bands`` for the mechanism, its coefficients and
    its privacy argument).

    With unit-norm coefficients ``coefs = (c_0, ..., c_{b-1})`` (c_0 > 0) the stage releases at its t-th
    committed call ``y_t = round_g(sum_{k < b} c_k v_{t-k} + std Z_t)`` (Z_t a pure function of the secret
    key and t; ``clipbias.randomness.snapped_gaussian``) and returns ``g_t = (y_t - sum_{1 <= k < b} c_k
    g_{t-k}) / c_0``, post-processing of the releases. With one band (``coefs=(1.0,)``) that is
    ``round_g(v_t + std Z_t)``, computed directly in the input's dtype (a deterministic rounding of the
    released float64 grid value). The output always has the input's dtype.

    ``per_bound``: with a moving per-example bound (adaptive clipping), std / bound; ``follow(bound)`` then
    sets the std for the step's bound.

    State: the draw counter; with b > 1 bands also the last b - 1 inputs ``v`` (PRIVATE: clipped sums
    without noise, saved only in the engine's private ``state_dict``) and outputs ``g``, all float64.

    ``prefetch``: whether ``draw_ahead`` starts drawing a step's normals in the background as the step
    begins (``clipbias.randomness.prefetch``; True, False, or None: ``prefetch.DEFAULT``). The release is
    the same bit for bit either way; the draws made ahead are not state."""

    def __init__(self, std: float, key: SecretKey, coefs: tuple[float, ...] = (1.0,), strategy: str = "taylor",
                 per_bound: float | None = None) -> None:
        if not std >= 0 or len(coefs) > 1 and not std > 0:
            raise ConfigError(f"noise std must be >= 0 (> 0 with more than one band), got {std!r}")
        if not coefs or not coefs[0] > 0 or not math.isclose(sum(c * c for c in coefs), 1.0, rel_tol=1e-12):
            raise ConfigError(f"noise coefficients must have c_0 > 0 and unit norm, got {coefs!r}")
        if not isinstance(key, SecretKey):
            raise ConfigError(f"GaussianNoise needs a clipbias.randomness.SecretKey, got {type(key).__name__}")
        self.std, self.key, self.coefs = float(std), key, tuple(float(c) for c in coefs)
        self.strategy = strategy  # the coefficients' strategy's name, the state's tag (algorithms.bands.NOISE_STRATEGIES)
        self.per_bound = per_bound
        self.draws = 0
        self.inputs: list[Tensor] = []   # v_{t-1}, v_{t-2}, ... (at most b - 1)
        self.outputs: list[Tensor] = []  # g_{t-1}, g_{t-2}, ...
        self._pending: tuple[int, list[Tensor], list[Tensor]] | None = None
        self.prefetch: bool | None = None
        self._ahead = NormalsPrefetch()

    @property
    def bands(self) -> int:
        return len(self.coefs)

    def follow(self, bound: float) -> None:
        """The std for this step's per-example ``bound`` (a moving bound: ``per_bound``; else unchanged)."""
        if self.per_bound is not None:
            self.std = self.per_bound * bound

    def draw_ahead(self, count: int, device: torch.device | str) -> None:
        """Start drawing the normals of this step's release (``count`` coordinates on ``device``) in the
        background where ``prefetch`` says so: the engine calls it as a step begins, and the release takes
        them (``_noisy``). They are those of the draw counter now, which only ``commit`` moves."""
        if not wanted(self.prefetch) or self.bands == 1 and self.std == 0 and self.per_bound is None:
            self._ahead.release()  # (the buffer of a run that drew ahead before: freed)
            return
        self._ahead.start(self.key, Purpose.NOISE, self.draws, count, device)

    def _noisy(self, x: Tensor, dtype: torch.dtype = torch.float64) -> Tensor:
        """The release ``snapped_gaussian(x, std, key, draws)``, with its normals drawn ahead where they were."""
        z = self._ahead.take(self.key, Purpose.NOISE, self.draws, x.numel(), x.device) if self._ahead.pending else None
        return snapped_gaussian(x, self.std, self.key, self.draws, dtype=dtype, normals=z)

    def __call__(self, v: Tensor) -> Tensor:
        if self.bands == 1:
            if self.std == 0:
                return v
            self._pending = (self.draws + 1, [], [])
            return self._noisy(v, v.dtype)
        c, keep = self.coefs, self.bands - 1
        self.inputs, self.outputs = _on(v.device, self.inputs), _on(v.device, self.outputs)  # a loaded state: CPU
        v64 = v.to(torch.float64, copy=True)  # kept: never an alias of the caller's tensor
        mixed = c[0] * v64
        for ck, past in zip(c[1:], self.inputs):
            mixed += ck * past
        y = self._noisy(mixed)  # the release (float64 grid values)
        for ck, past in zip(c[1:], self.outputs):
            y -= ck * past
        g = y.div_(c[0])
        self._pending = (self.draws + 1, ([v64] + self.inputs)[:keep], ([g] + self.outputs)[:keep])
        return g.to(v.dtype, copy=True)  # g is kept: the caller gets its own copy

    def commit(self) -> None:
        self._ahead.clear()  # this draw is released: never drawn again
        if self._pending is not None:
            self.draws, self.inputs, self.outputs = self._pending
            self._pending = None

    def rollback(self) -> None:
        self._pending = None
        self._ahead.wait()  # kept for the retry, which releases this draw; no thread outlives the step

    def state_dict(self) -> dict:
        return {"draws": self.draws, "coefs": list(self.coefs), "strategy": self.strategy,
                "inputs": [t.clone() for t in self.inputs], "outputs": [t.clone() for t in self.outputs]}

    def load_state_dict(self, state: dict) -> None:
        if state.get("strategy") == "blt":
            raise ConfigError(f"noise state is BLT noise, this run {self.bands}-band {self.strategy} noise: resume with "
                              f"the same `bands` and `bands_strategy`")
        saved, strategy = tuple(float(c) for c in state["coefs"]), state["strategy"]
        # A run keeps one c from its first step to its last: a c changed mid-run would give the columns of
        # C that straddle the change a norm above 1 (docs/privacy.md, "Banded noise"). So a resumed run goes
        # on with the saved c: taylor's must equal this run's (the same bands and momentum); optimised ones
        # are kept as they are (recomputed elsewhere they may differ in the last bits; an extended run's
        # steps would give others)
        valid = len(saved) == self.bands and saved[0] > 0 and \
            math.isclose(sum(c * c for c in saved), 1.0, rel_tol=1e-12)
        if strategy != self.strategy or not valid or strategy == "taylor" and saved != self.coefs:
            raise ConfigError(f"noise state has {len(saved)}-band {strategy} coefficients {list(saved)}, this run "
                              f"{self.bands}-band {self.strategy} {list(self.coefs)}: resume with the same "
                              f"`bands`, `bands_strategy` and momentum")
        self.coefs = saved
        self.draws = int(state["draws"])
        self.inputs = [t.to(torch.float64) for t in state["inputs"]]
        self.outputs = [t.to(torch.float64) for t in state["outputs"]]
        self._pending = None
        self._ahead.clear()


def _on(device: torch.device, tensors: list[Tensor]) -> list[Tensor]:
    """``tensors`` on ``device`` (a checkpoint's state is read onto the CPU; the run may be on a GPU)."""
    return tensors if all(t.device == device for t in tensors) else [t.to(device) for t in tensors]


class BLTNoise(GaussianNoise):
    """BLT noise (``clipbias.algorithms.blt`` for the strategy and its privacy argument): the noise stage of
    ``bands_strategy="blt"``. With the strategy's ``scale`` c_0, ``omegas`` and ``thetas``, the t-th committed
    call releases ``y_t = round_g(c_0 (v_t + sum_i omega_i s_i) + std Z_t)`` and returns ``g_t = y_t / c_0 -
    sum_i omega_i r_i``, where ``s_i = sum_{j < t} theta_i^(t-1-j) v_j`` and ``r_i`` the same sum of the
    outputs: ``y = C v + std Z`` and ``g = C^{-1} y``, post-processing of the releases.

    State: the draw counter and the 2 x len(omegas) float64 sums ``s`` (PRIVATE: sums of clipped sums
    without noise, saved only in the engine's private ``state_dict``) and ``r``, updated in place on commit."""

    def __init__(self, std: float, key: SecretKey, blt) -> None:
        if not std > 0:
            raise ConfigError(f"noise std must be > 0 with BLT noise, got {std!r}")
        if not isinstance(key, SecretKey):
            raise ConfigError(f"BLTNoise needs a clipbias.randomness.SecretKey, got {type(key).__name__}")
        self.std, self.key, self.blt = float(std), key, blt
        self.strategy, self.per_bound = "blt", None  # no ``coefs``: the strategy is ``blt``
        self.draws = 0
        self.sums: list[Tensor] = []  # s_1 .. s_d (empty before the first step: zeros)
        self.out_sums: list[Tensor] = []  # r_1 .. r_d
        self._pending = None
        self.prefetch: bool | None = None  # the normals drawn ahead (GaussianNoise.draw_ahead)
        self._ahead = NormalsPrefetch()

    @property
    def bands(self) -> int:
        return self.blt.classes

    def __call__(self, v: Tensor) -> Tensor:
        b = self.blt
        self.sums, self.out_sums = _on(v.device, self.sums), _on(v.device, self.out_sums)  # a loaded state: CPU
        v64 = v.to(torch.float64, copy=True)  # kept: never an alias of the caller's tensor
        mixed = v64.clone() if not self.sums else torch.add(v64, self.sums[0], alpha=b.omegas[0])
        for w, s in zip(b.omegas[1:], self.sums[1:]):
            mixed.add_(s, alpha=w)
        y = self._noisy(mixed.mul_(b.scale))  # the release
        g = y.div_(b.scale)
        for w, r in zip(b.omegas, self.out_sums):
            g.sub_(r, alpha=w)
        self._pending = (self.draws + 1, v64, g)
        return g.to(v.dtype, copy=True)  # g is kept: the caller gets its own copy

    def commit(self) -> None:
        self._ahead.clear()  # this draw is released: never drawn again
        if self._pending is None:
            return
        self.draws, v64, g = self._pending
        self._pending = None
        if not self.sums:
            self.sums = [torch.zeros_like(v64) for _ in self.blt.thetas]
            self.out_sums = [torch.zeros_like(g) for _ in self.blt.thetas]
        for th, s, r in zip(self.blt.thetas, self.sums, self.out_sums):
            torch.add(v64, s, alpha=th, out=s)  # s <- theta s + v, one pass
            torch.add(g, r, alpha=th, out=r)

    def state_dict(self) -> dict:
        return {"draws": self.draws, "strategy": "blt", "blt": self.blt.to_dict(),
                "sums": [t.clone() for t in self.sums], "out_sums": [t.clone() for t in self.out_sums]}

    def load_state_dict(self, state: dict) -> None:
        # like the optimised bands, a resumed run goes on with its saved strategy (the engine then accounts
        # with it: engine.state), as long as it is a BLT strategy for the same classes
        saved = state.get("blt") if state.get("strategy") == "blt" else None
        if not isinstance(saved, dict) or int(saved.get("classes", -1)) != self.blt.classes:
            raise ConfigError(f"noise state is not BLT noise in {self.blt.classes} classes: resume with the same "
                              f"`bands` and `bands_strategy`")
        self.blt = type(self.blt).from_dict(saved)
        self.draws = int(state["draws"])
        # copies: commit updates the sums in place, which must never write into the state it was given (a
        # discarded continuation would then leave its clipped sums in the caller's checkpoint)
        self.sums = [t.to(torch.float64, copy=True) for t in state["sums"]]
        self.out_sums = [t.to(torch.float64, copy=True) for t in state["out_sums"]]
        self._pending = None
        self._ahead.clear()
