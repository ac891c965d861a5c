"""Composable stages of a DP update, each with explicit, checkpointable state.

The stages run in one direction:

    per-example rows [b, d] --PerSample stages--> rows --sum / B--> aggregate [d]
        --ErrorFeedback--> v [d] --GaussianNoise--> v + w [d] --post stage--> base torch optimizer

Stateful stages never mutate their state while a step is computed: they stage the new value and
``commit()`` applies it once the whole step succeeded, ``rollback()`` drops it when a later
micro-batch failed (a NaN gradient, a bad shape), so a failed step leaves everything as it was, in
the spirit of optax's ``(update, new_state)``. ``PerSample.probe`` is the pure version of a stage
(diagnostics measure what a stage would produce without staging anything).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .errors import ConfigError
from .grads.precision import full_float32, last_norms
from .randomness import Purpose, SecretKey, snapped_gaussian
from .randomness.prefetch import NormalsPrefetch, wanted


@dataclass
class StepContext:
    """What a stage may look at besides the rows: the example indices of this (micro-)batch, the
    step, and the norms of the rows as the pipeline received them (``norms``, computed once by the
    engine's finiteness check; None when unknown)."""

    indices: Tensor | None = None
    step: int = 0
    norms: Tensor | None = None


def safe_factor(norms: Tensor, factor: Tensor) -> Tensor:
    """A per-row factor as the rows may use it: 0 where it is below float32's smallest normal number
    or the row's norm is not finite.

    A subnormal float32 factor carries up to 100 % rounding (a row of norm 1 contributed 1.96 C at
    C = 0.51 * 2^-149, adaptive clipping drove C there; a single-parameter row of norm 3.4e38 at
    C = 1e-6 contributed 1.20 C); a normal one at most 2^-24. A factor of 0 is always within the
    bound (the row contributes nothing), and so is the zero row a non-finite norm gets (``inf * 0``
    would be NaN). Both cases are data-dependent roundings below the bound, not refusals."""
    ok = torch.isfinite(norms) & (factor >= torch.finfo(torch.float32).tiny)
    return torch.where(ok, factor, torch.zeros_like(factor))


TINY_CLIP = 1e-30
"""Below this clip a clipped row's entries would be float32 subnormals, whose rounding (2^-149 each,
not relative) can exceed the clip itself: clipped rows then contribute 0, rows within the clip
themselves (adaptive clipping can drive its clip there when every gradient is 0)."""


def clip_scale(norms: Tensor, c: float) -> Tensor:
    """min(1, C / ||g_i||): the factor ``clip_rows`` multiplies each row by (``safe_factor``)."""
    factor = torch.clamp(c / norms.clamp_min(1e-30), max=1.0)
    if c < TINY_CLIP:
        factor = (factor >= 1).to(factor.dtype)
    return safe_factor(norms, factor)


def normalize_scale(norms: Tensor, gamma: float) -> Tensor:
    """1 / (||g_i|| + gamma): the factor ``normalize_rows`` multiplies each row by (``safe_factor``)."""
    return safe_factor(norms, 1.0 / (norms + gamma))


def scale_rows(g: Tensor, factor: Tensor) -> Tensor:
    """``g * factor`` per row (factors from ``clip_scale``/``normalize_scale``): a row with a non-finite
    norm has factor 0, and its infinite entries' ``inf * 0 = NaN`` become 0 (one pass, in place)."""
    return (g * factor.to(g.dtype)).nan_to_num_(nan=0.0)


def clip_rows(g: Tensor, c: float) -> Tensor:
    """clip(g_i, C) = g_i * min(1, C / ||g_i||) along the last axis (global L2 norm over all
    parameters): each row of ``[..., b, d]``, or one vector ``[d]``."""
    return scale_rows(g, clip_scale(last_norms(g, keepdim=True), c))


def normalize_rows(g: Tensor, gamma: float) -> Tensor:
    """g_i / (||g_i|| + gamma): automatic clipping (Bu et al. 2022); every row has norm < 1."""
    # an infinite entry: inf / inf = NaN -> 0
    return (g / (last_norms(g, keepdim=True) + gamma).to(g.dtype)).nan_to_num_(nan=0.0)


class Stage:
    """Base of every stage: stateless by default. ``distributed_refusal`` says why a stage cannot
    run split over the ranks of a process group (None: it can; ``clipbias.distributed``)."""

    distributed_refusal: str | None = None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def commit(self) -> None:
        """Apply the state staged during the step (the step succeeded)."""

    def rollback(self) -> None:
        """Drop the state staged during the step (the step failed)."""


class Carried(Stage):
    """A stage that carries one tensor from step to step (the attribute and ``state_dict`` key
    ``KEY``): a step stages the next value in ``_pending``, which becomes the state only on ``commit``
    (a failed step leaves it as it was). Error feedback, outer momentum and DiSK's filter."""

    KEY = "state"

    def __init__(self) -> None:
        setattr(self, self.KEY, None)
        self._pending: Tensor | None = None

    def commit(self) -> None:
        if self._pending is not None:
            setattr(self, self.KEY, self._pending)
            self._pending = None

    def rollback(self) -> None:
        self._pending = None

    def state_dict(self) -> dict:
        v = getattr(self, self.KEY)
        return {self.KEY: None if v is None else v.detach().clone()}

    def load_state_dict(self, state: dict) -> None:
        setattr(self, self.KEY, state[self.KEY])
        self._pending = None


class PerSample(Stage):
    """Maps per-example rows ``[b, d] -> [b, d]``.

    ``bound`` is the guaranteed upper bound on every output row's norm (the per-example
    sensitivity) when this stage enforces one, else None. A ``dynamic`` stage's bound moves: its
    ``release(device)`` releases the next one, and the noise stage follows it.
    """

    bound: float | None = None
    dynamic = False  # the bound moves from step to step, released by ``release`` (adaptive clipping)

    def __call__(self, g: Tensor, ctx: StepContext) -> Tensor:  # pragma: no cover - every stage overrides it
        return g

    def probe(self, g: Tensor, ctx: StepContext) -> Tensor:
        """What the stage outputs for probe rows, staging nothing (default: a stateless stage's call)."""
        return self(g, ctx)

    def scale(self, norms: Tensor) -> Tensor | None:
        """Per-row factors when the stage only rescales rows by a function of their norm (clip,
        normalise), else None. Then the pipeline sums ``scale @ rows`` in one pass, with no [b, d]
        temporary."""
        return None


def scales_by_norm(stage: PerSample) -> bool:
    """Whether the stage only rescales each row by a function of its norm (it overrides ``scale``):
    decided without calling it (a stage may count what ``scale`` sees: adaptive clipping)."""
    return type(stage).scale is not PerSample.scale


class Clip(PerSample):
    def __init__(self, c: float) -> None:
        if not c > 0:
            raise ConfigError(f"clip norm must be > 0, got {c!r}")
        self.c = self.bound = float(c)

    def __call__(self, g: Tensor, ctx: StepContext) -> Tensor:
        return clip_rows(g, self.c)

    def scale(self, norms: Tensor) -> Tensor:
        return clip_scale(norms, self.c)


class Normalize(PerSample):
    def __init__(self, gamma: float = 0.01) -> None:
        if not gamma > 0:
            raise ConfigError(f"`AlgoConfig.gamma` (normalisation stability constant) must be > 0, got {gamma!r}")
        self.gamma, self.bound = float(gamma), 1.0

    def __call__(self, g: Tensor, ctx: StepContext) -> Tensor:
        return normalize_rows(g, self.gamma)

    def scale(self, norms: Tensor) -> Tensor:
        return normalize_scale(norms, self.gamma)


class ErrorFeedback(Carried):
    """DiceSGD's clipped error feedback (Zhang et al. Alg. 2, lines 5 and 7).

    ``v = aggregate + clip(e, C2)`` and ``e <- e + reference_mean - v`` where ``reference_mean`` is
    ``(1/B) sum_i g_i`` (the unclipped gradients, after the optional outer clip). With
    ``normalize=gamma`` the feedback is ``e / (||e|| + gamma)`` (automatic DiceSGD, Alg. 4).
    ``e`` is a hidden state: it is in ``state_dict`` (checkpoints are private) but never released.
    """

    KEY = "e"
    e: Tensor | None

    def __init__(self, c2: float | None = None, normalize: float | None = None) -> None:
        if (c2 is None) == (normalize is None):
            raise ConfigError("ErrorFeedback needs exactly one of c2 (clip) or normalize (gamma)")
        if c2 is not None and not c2 > 0:
            raise ConfigError(f"`AlgoConfig.ef_clip` must be > 0, got {c2!r}")
        self.c2, self.gamma = c2, normalize
        super().__init__()

    @property
    def bound(self) -> float:
        """Norm bound of the feedback term (C2, or 1 when normalised)."""
        return float(self.c2) if self.c2 is not None else 1.0

    def feedback(self, e: Tensor) -> Tensor:
        if self.c2 is not None:
            return clip_rows(e, self.c2)
        return normalize_rows(e, self.gamma)  # e is finite here (__call__)

    def __call__(self, aggregate: Tensor, reference_mean: Tensor) -> Tensor:
        # .to: a checkpoint saved on the CPU may be resumed on CUDA (no-op when already there)
        e = self.e.to(aggregate.device) if self.e is not None else torch.zeros_like(aggregate)
        # the unclipped sum can overflow while every example's gradient is finite (three examples of norm
        # 1.7e38 in float32); clip(inf) is NaN, and a NaN release would tell whether they were sampled. The
        # sound bound allows the buffer to be anything, so a non-finite one restarts from zero: the feedback
        # term stays within its bound (docs/privacy.md, the DiceSGD proof, step 2). No host sync.
        e = torch.where(torch.isfinite(e).all(), e, torch.zeros_like(e))
        v = aggregate + self.feedback(e)
        self._pending = e + reference_mean - v
        return v


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
        self.strategy = strategy  # the name of the coefficients' strategy (algorithms.band_strategy.STRATEGIES)
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


@dataclass
class Pipeline:
    """The whole private update rule.

    ``reference``: per-example stages applied before the rows are recorded as the gradients
    error feedback tracks (e.g. an outer clip G_max). ``per_sample``: the stages after it (perturb,
    clip/normalise, ...). ``divisor``: what the summed rows are divided by: B = qN, the expected
    batch size (never the realised one), or the number of groups for p-averaging. ``post``: a stage
    after the noise (post-processing of the released update, e.g. outer momentum).
    """

    per_sample: list[PerSample]
    divisor: float
    reference: list[PerSample] = field(default_factory=list)
    error_feedback: ErrorFeedback | None = None
    noise: GaussianNoise | None = None
    post: Stage | None = None

    def named_stages(self) -> list[tuple[str, Stage]]:
        """Every stage with its ``state_dict`` key, in the order of the data flow."""
        named = [(f"reference.{i}", s) for i, s in enumerate(self.reference)]
        named += [(f"per_sample.{i}", s) for i, s in enumerate(self.per_sample)]
        named += [(k, s) for k, s in (("error_feedback", self.error_feedback), ("noise", self.noise),
                                      ("post", self.post)) if s is not None]
        return named

    @property
    def sensitivity(self) -> float | None:
        """Per-example L2 bound of the aggregated sum: the bound of the *last* per-sample stage.

        ``None`` (the pipeline is refused) when the last stage bounds nothing: an unbounded stage
        after a Clip would void the Clip's bound.
        """
        return self.per_sample[-1].bound if self.per_sample else None

    def rows(self, g: Tensor, ctx: StepContext) -> tuple[Tensor | None, Tensor]:
        """Per-example rows -> (reference rows summed, processed rows summed). The reference sum is
        only read by error feedback: None (not computed) without it."""
        known = ctx.norms  # the norms of g as received, while no stage has changed it
        for s in self.reference:
            g, known = s(g, ctx), None
        ref = g.sum(-2) if self.error_feedback is not None else None
        for s in self.per_sample[:-1]:
            g, known = s(g, ctx), None
        last = self.per_sample[-1] if self.per_sample else None
        if last is not None:
            norms = known if known is not None else last_norms(g)
            factors = last.scale(norms)
            if factors is None:
                g = last(g, ctx)
            else:  # clip/normalise and sum in one pass: sum_i s_i g_i
                if known is None and not bool(torch.isfinite(norms).all()):
                    # a row an earlier stage overflowed (a perturbation; the received rows were checked
                    # finite): zero, not 0 * inf = NaN in the product
                    g = g.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
                with full_float32():  # TF32 would round the rows before their factors (grads/precision.py)
                    return ref, (factors.to(g.dtype).unsqueeze(-2) @ g).squeeze(-2)
        return ref, g.sum(-2)

    def draw_ahead(self, count: int, device: torch.device | str) -> None:
        """As a step begins: the noise's normals for an update of ``count`` coordinates on ``device`` start
        being drawn in the background (``GaussianNoise.draw_ahead``), while the step computes its sums."""
        if self.noise is not None:
            self.noise.draw_ahead(count, device)

    def finish(self, processed_sum: Tensor, reference_sum: Tensor | None) -> Tensor:
        """Sums over the logical batch -> the (noisy) update handed to the base optimizer."""
        v = processed_sum / self.divisor
        if self.error_feedback is not None:
            v = self.error_feedback(v, reference_sum / self.divisor)
        last = self.per_sample[-1] if self.per_sample else None
        if last is not None and last.dynamic:  # adaptive clipping: its own release, and the noise at this step's bound
            last.release(v.device)
            if self.noise is not None:
                self.noise.follow(last.bound)
        if self.noise is not None:
            v = self.noise(v)
        return self.post(v) if self.post is not None else v

    def commit(self) -> None:
        for _, s in self.named_stages():
            s.commit()

    def rollback(self) -> None:
        for _, s in self.named_stages():
            s.rollback()

    def state_dict(self) -> dict:
        return {k: s.state_dict() for k, s in self.named_stages()}

    def load_state_dict(self, state: dict) -> None:
        for k, s in self.named_stages():
            s.load_state_dict(state[k])


class Chain(Stage):
    """Post stages in sequence (each sees the previous one's output), with one checkpointable state."""

    def __init__(self, *stages: Stage) -> None:
        self.stages = tuple(stages)
        refusals = [s.distributed_refusal for s in self.stages if s.distributed_refusal]
        self.distributed_refusal = refusals[0] if refusals else None

    def __call__(self, v: Tensor) -> Tensor:
        for s in self.stages:
            v = s(v)
        return v

    def commit(self) -> None:
        for s in self.stages:
            s.commit()

    def rollback(self) -> None:
        for s in self.stages:
            s.rollback()

    def state_dict(self) -> dict:
        return {str(i): s.state_dict() for i, s in enumerate(self.stages)}

    def load_state_dict(self, state: dict) -> None:
        for i, s in enumerate(self.stages):
            s.load_state_dict(state[str(i)])
