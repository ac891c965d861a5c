"""Shared pieces of the paper methods: the ``Method`` recipe, settings, keyed randomness, gradients.

``Method`` is an ``Algorithm`` (so ``DPEngine(model, name, config=AlgoConfig(extra=...))`` and the
CLI build it like any other) that can also

* read validated method settings from ``AlgoConfig.extra`` (``Setting``: default, rule, CLI flag);
* supply its own per-example *row* backend (``gradients``): the engine asks the algorithm for one
  when none is given (self-augmentation, p-averaging, inner momentum, BatchClipping);
* divide the summed rows by something other than B (p-averaging divides by the number of groups);
* add a post-noise stage (outer momentum: post-processing of the released noisy update);
* state its sensitivity and accounting basis in the ``AccountingSpec``.

Keyed randomness. Perturbation noise, augmentation parameters, group assignments and public-feature
draws are pure functions of ``(seed, purpose, step, example index)`` (``mix``): fresh per example
and step, independent of the data, identical whatever the micro-batching, and exactly reproducible on
resume without carrying generator state. ``seed`` is a secret key (``DPEngine`` passes its secret
streams): a public one would let removing an example re-key every later index predictably. Without example indices the position in the logical batch
is the key (then only the randomness, never the privacy, depends on the order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap

from ..algorithms import AlgoConfig, Algorithm
from ..errors import ConfigError
from ..grads import FuncGradients, LossFn, ParamLayout, check_model, cross_entropy
from ..privacy import AccountingSpec, DiceParams
from ..transforms import Clip, ErrorFeedback, GaussianNoise, PerSample, Pipeline, Stage

_MASK64 = (1 << 64) - 1

# purposes of keyed randomness (one stream each)
PERTURB, AUGMENT, GROUP, PUBLIC, PREDICT = 1, 2, 3, 4, 5
PROBE_STEP = 1 << 62  # step key of measurement probes: never collides with a training step


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix64 chain): distinct tuples give independent streams."""
    h = 0x2545F4914F6CDD1D
    for v in parts:
        h = _splitmix64(h ^ (int(v) & _MASK64))
    return h & ((1 << 63) - 1)


def keyed_ints(seed: int, purpose: int, step: int, keys: Iterable[int], count: int, high: int) -> Tensor:
    """``[len(keys), count]`` integers uniform in ``[0, high)``, a pure function of each key."""
    out = []
    for k in keys:
        h = mix(seed, purpose, step, k)
        row = []
        for _ in range(count):
            h = _splitmix64(h)
            row.append(h % high)
        out.append(row)
    return torch.tensor(out, dtype=torch.long).reshape(-1, count)


def keyed_normal(seed: int, purpose: int, step: int, keys: Iterable[int], d: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> Tensor:
    """``[len(keys), d]`` standard normal rows, row i from a generator seeded by ``keys[i]``."""
    rows = []
    for k in keys:
        gen = torch.Generator(device=device)
        gen.manual_seed(mix(seed, purpose, step, k))
        rows.append(torch.randn(d, generator=gen, device=device, dtype=dtype))
    return torch.stack(rows) if rows else torch.zeros(0, d, device=device, dtype=dtype)


def batch_keys(indices: Tensor | None, start: int, size: int) -> list[int]:
    """Example indices of ``[start, start + size)`` of the logical batch, or the positions."""
    if indices is not None:
        return [int(i) for i in indices[start:start + size]]
    return list(range(start, start + size))


# ---------------------------------------------------------------- settings (AlgoConfig.extra)
REQUIRED = object()  # Setting.default for a setting without default
OPTIONAL = None      # Setting.default for a setting that may stay unset (value None)


@dataclass(frozen=True)
class Setting:
    """One method setting read from ``AlgoConfig.extra[key]``."""

    key: str
    default: Any
    rule: str                        # e.g. "an integer >= 2"
    check: Callable[[Any], bool]
    flag: str                        # the CLI flag that sets it
    convert: Callable[[Any], Any] = lambda v: v
    help: str = ""
    aliases: tuple[str, ...] = ()    # other spellings accepted in ``extra`` (e.g. a CLI dest name)


def integral(v: Any) -> Any:
    """4.0 -> 4 (a CLI may parse integers as floats); anything else unchanged."""
    if isinstance(v, float) and math.isfinite(v) and v == int(v):
        return int(v)
    return v


def integer(lo: int, hi: int | None = None) -> Callable[[Any], bool]:
    def ok(v: Any) -> bool:
        v = integral(v)
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo and (hi is None or v <= hi)
    return ok


def real(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> Callable[[Any], bool]:
    def ok(v: Any) -> bool:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    return ok


def boolean(v: Any) -> bool:
    return isinstance(v, bool)


def anything(v: Any) -> bool:
    return True


def read_settings(algo: str, schema: tuple[Setting, ...], cfg: AlgoConfig) -> dict:
    """Validated settings; unknown keys (with a value other than None) are refused."""
    extra = {k: v for k, v in (cfg.extra or {}).items() if v is not None}
    known = {k for s in schema for k in (s.key, *s.aliases)}
    unknown = sorted(set(extra) - known)
    if unknown:
        valid = ", ".join(f"{s.key!r} ({s.flag})" for s in schema) or "none"
        raise ConfigError(f"--algo {algo} does not take setting(s) {', '.join(map(repr, unknown))}; "
                          f"its settings are: {valid}. Remove the others (or pass None).")
    out = {}
    for s in schema:
        given = [k for k in (s.key, *s.aliases) if k in extra]
        if len(given) > 1 and any(extra[k] is not extra[given[0]] and not _equal(extra[k], extra[given[0]])
                                  for k in given[1:]):
            raise ConfigError(f"{s.flag} for --algo {algo} is given twice with different values "
                              f"({', '.join(f'{k}={extra[k]!r}' for k in given)}); give it once")
        v = extra[given[0]] if given else s.default
        if v is REQUIRED:
            raise ConfigError(f"--algo {algo} needs {s.flag} (AlgoConfig.extra[{s.key!r}]): {s.help or s.rule}")
        if v is None:  # an optional setting left unset
            out[s.key] = None
            continue
        if not s.check(v):
            raise ConfigError(f"{s.flag} (AlgoConfig.extra[{s.key!r}]) for --algo {algo} must be {s.rule}, "
                              f"got {v!r}")
        out[s.key] = s.convert(integral(v)) if s.check is not boolean else v
    return out


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):  # tensors of different shapes, ...
        return False


# ---------------------------------------------------------------- per-example gradients at given params
class FunctionalGradients:
    """``vmap(grad)`` per-example gradients at the model's current *or any given* parameters.

    ``grouped=True``: each "example" is a group ``x_i`` of shape ``[p, *input]`` run through the
    model together (BatchNorm sees the group); the loss is that of the group's first row only.
    ``check=False`` skips the refusal of cross-example modules (BatchClipping wants BatchNorm).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn = cross_entropy, *, grouped: bool = False,
                 check: bool = True) -> None:
        if check:
            check_model(model)
        self.model, self.loss_fn, self.grouped = model, loss_fn, grouped
        self.layout = ParamLayout.of(model)

        def loss_one(params: dict, consts: dict, x: Tensor, y: Tensor) -> Tensor:
            inp = x if grouped else x.unsqueeze(0)
            out = functional_call(self.model, (params, consts), (inp,))
            return self.loss_fn(out[:1], y.unsqueeze(0))

        self._fn = vmap(grad_and_value(loss_one), in_dims=(None, None, 0, 0), randomness="different")

    def params(self) -> dict[str, Tensor]:
        trainable = set(self.layout.names)
        return {n: p.detach() for n, p in self.model.named_parameters() if n in trainable}

    def consts(self) -> dict[str, Tensor]:
        trainable = set(self.layout.names)
        c = {n: p.detach() for n, p in self.model.named_parameters() if n not in trainable}
        c.update(dict(self.model.named_buffers()))
        return c

    def __call__(self, x: Tensor, y: Tensor, params: dict[str, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        if len(x) == 0:
            return torch.zeros(0, self.layout.dim, device=y.device), torch.zeros(0, device=y.device)
        grads, losses = self._fn(params if params is not None else self.params(), self.consts(), x, y)
        return self.layout.flatten(grads), losses.detach()


# ---------------------------------------------------------------- the recipe
@dataclass
class MethodPipeline(Pipeline):
    """A ``Pipeline`` with an optional stage after the noise (post-processing, e.g. outer momentum)."""

    post: Stage | None = None

    def stages(self) -> list[Stage]:
        return [*super().stages(), *([self.post] if self.post is not None else [])]

    def finish(self, processed_sum: Tensor, reference_sum: Tensor) -> Tensor:
        v = super().finish(processed_sum, reference_sum)
        return self.post(v) if self.post is not None else v


Build = Callable[[AlgoConfig, dict, int, float], "tuple[list[PerSample], ErrorFeedback | None]"]


@dataclass(frozen=True)
class Method(Algorithm):
    """An ``Algorithm`` with settings, its own row backend, divisor, post stage and accounting note.

    ``build(cfg, settings, seed, B)`` returns the per-example stages and the error feedback (or None);
    ``backend(model, loss_fn, cfg, settings, n=, batch_size=, seed=)`` the row backend (None: plain
    per-example gradients); ``divisor(settings, B)`` what the summed rows are divided by (default B);
    ``post(cfg, settings)`` a stage after the noise; ``validate(cfg, settings, q, B)`` refuses settings
    the guarantee does not cover; ``note(cfg, settings)`` states sensitivity and sampling;
    ``dice_grad_bound(cfg, settings)`` the G_max DiceSGD's accounting may use (default cfg.grad_bound).
    """

    schema: tuple[Setting, ...] = ()
    build: Build | None = None
    backend: Callable[..., Any] | None = None
    divisor: Callable[[dict, float], float] | None = None
    post: Callable[[AlgoConfig, dict], Stage | None] | None = None
    validate: Callable[[AlgoConfig, dict, float, float], None] | None = None
    note: Callable[[AlgoConfig, dict], str] | None = None
    dice_grad_bound: Callable[[AlgoConfig, dict], float | None] | None = None

    def __post_init__(self) -> None:
        if self.build is None:
            raise ConfigError(f"method {self.name}: build is required")
        # ``stages(cfg)`` of the base class (read for the bounds only): B is irrelevant there
        object.__setattr__(self, "stages", lambda cfg: self.build(cfg, self.settings(cfg), 0, 1.0))

    def settings(self, cfg: AlgoConfig) -> dict:
        return read_settings(self.name, self.schema, cfg)

    def _checked(self, cfg: AlgoConfig, sample_rate: float, expected_batch_size: float) -> dict:
        s = self.settings(cfg)
        if self.validate is not None:
            self.validate(cfg, s, sample_rate, expected_batch_size)
        return s

    def pipeline(self, cfg: AlgoConfig, expected_batch_size: float, z: float, seed: int = 0,
                 device: torch.device | str = "cpu") -> Pipeline:
        s = self.settings(cfg)
        per_sample, ef = self.build(cfg, s, seed, expected_batch_size)
        reference = [Clip(cfg.grad_bound)] if cfg.grad_bound is not None else []
        div = self.divisor(s, expected_batch_size) if self.divisor is not None else expected_batch_size
        post = self.post(cfg, s) if self.post is not None else None
        p = MethodPipeline(per_sample, div, reference, ef, post=post)
        if p.sensitivity is None:
            raise ConfigError(f"{self.name}: no stage bounds the per-example norm")
        p.noise = GaussianNoise(z * p.sensitivity / div, seed, device)
        return p

    def spec(self, cfg: AlgoConfig, sample_rate: float, z: float, expected_batch_size: float) -> AccountingSpec:
        s = self._checked(cfg, sample_rate, expected_batch_size)
        per_sample, _ = self.build(cfg, s, 0, expected_batch_size)
        if not per_sample or per_sample[-1].bound is None:
            raise ConfigError(f"{self.name}: the last per-example stage must bound the norm (Clip/Normalize)")
        last = per_sample[-1]
        note = (self.note(cfg, s) if self.note is not None else
                f"per-example L2 sensitivity {last.bound:g} ({type(last).__name__})")
        dice = None
        if self.accounting == "dice":
            c1, c2 = self.dice_units(cfg)
            gb = self.dice_grad_bound(cfg, s) if self.dice_grad_bound is not None else cfg.grad_bound
            dice = DiceParams(sample_rate, 1, c1, c2, expected_batch_size, gb)
        return AccountingSpec(self.accounting, sample_rate, z, note, dice, self.certifiable,
                              self.why_not_certifiable)

    def gradients(self, model: nn.Module, loss_fn: LossFn, cfg: AlgoConfig, *, n: int,
                  batch_size: float, seed: int = 0):
        """The row backend the engine uses when the caller gives none."""
        s = self.settings(cfg)
        if self.backend is None:
            return FuncGradients(model, loss_fn)
        return self.backend(model, loss_fn, cfg, s, n=n, batch_size=batch_size, seed=seed)


def clip_or_normalize(cfg: AlgoConfig, normalize: bool) -> PerSample:
    """The bounding stage: ``Clip(C)`` (bound C) or ``Normalize(gamma)`` (bound 1)."""
    from ..transforms import Normalize
    return Normalize(cfg.gamma) if normalize else Clip(cfg.clip)
