"""Composition of a base algorithm with pre-clipping perturbation and/or self-augmentation.

Registers ``perturb`` (= dpsgd + perturb), ``self-aug`` (= dpsgd + self-aug), ``dice-perturb`` and
``dice-self-aug``; ``compose`` builds (and refuses) other combinations. The bases are the registered
algorithms that declare ``composable`` (``bases()``). See ``docs/methods.md``.
"""

from __future__ import annotations

from ..config import AlgoConfig
from ..errors import ConfigError
from ..randomness import SecretKey
from ..step import Clip
from . import augment, core  # noqa: F401  (core registers the bases)
from . import base as registry
from .base import ALGORITHMS, Algorithm, Parts, get
from .perturb import K_PERTURB, Perturb

COMPOSABLE = {"perturb": (K_PERTURB,), "self-aug": augment.SETTINGS}


def bases() -> tuple[str, ...]:
    """The algorithms ``compose`` builds on: those registered with ``composable=True`` (dpsgd, normalized,
    dice, dice-adam, dice-auto, and any registered later), in registration order."""
    return tuple(n for n, a in ALGORITHMS.items() if a.composable)


# why a combination is refused (method -> reason), when the base uses DiceSGD's error feedback
_REFUSED_WITH_DICE = {
    "p-avg": "p-averaging clips group means: one example moves one group's clipped mean by up to 2 C1 "
             "and the error feedback would accumulate group errors, while DiceSGD's proof bounds one "
             "clipped term of norm <= C1 per sampled example; the guarantee would not hold",
    "inner-outer": "the inner momentum re-uses an example's gradients at the K0 previous iterates, so the "
                   "error feedback would carry one example's clipping error into steps where it is not "
                   "sampled; DiceSGD's proof covers neither",
    "dpgd-momentum": "per-example momentum buffers carry an example's gradients across steps and the "
                     "algorithm is full-batch; DiceSGD's subsampled proof does not cover it",
    "batch-clip": "BatchClipping's group gradients through BatchNorm with error feedback are not covered "
                  "by the DiceSGD accounting implemented here",
}


def _check(base: str, methods: tuple[str, ...]) -> Algorithm:
    for m in methods:
        if m in _REFUSED_WITH_DICE:
            b = ALGORITHMS.get(base)
            if b is not None and b.accounting == "dice":
                raise ConfigError(f"refused: {base} + {m}: {_REFUSED_WITH_DICE[m]}. Use `algo='{m}'` "
                                  f"(DPSGD accounting) or {base} without it.")
            raise ConfigError(f"{m} is a complete algorithm, not a composable piece: use `algo='{m}'`")
        if m not in COMPOSABLE:
            raise ConfigError(f"cannot compose {m!r}: composable pieces are {', '.join(COMPOSABLE)}")
    if len(set(methods)) != len(methods) or not methods:
        raise ConfigError(f"compose needs one or more distinct pieces, got {methods!r}")
    if base not in bases():
        raise ConfigError(f"cannot compose on {base!r}: the base must be one of {', '.join(bases())}")
    return get(base)


def compose(base: str, *methods: str, name: str | None = None, register: bool = True) -> Algorithm:
    """``base`` (one of ``bases()``: dpsgd, normalized, dice, dice-adam, dice-auto) with pre-clipping perturbation
    and/or self-augmentation. Refuses combinations whose guarantee would not hold.

    Soundness: both pieces keep every row a function of one example and of data-independent
    randomness, so the sensitivity is the base's (C, or 1 when normalised) and the base's accounting
    applies -- including DiceSGD's, conditionally on the randomness. One adjustment: with
    perturbation and an outer clip G_max, ``||g_i - clip(g_i + k zeta_i, C1)||`` is bounded by
    ``G_max + C1`` (not ``G_max - C1``), so DiceSGD's accounting is given ``G' = G_max + C1``.
    """
    b = _check(base, methods)
    perturb, selfaug = "perturb" in methods, "self-aug" in methods
    schema = tuple(s for m in ("perturb", "self-aug") if m in methods for s in COMPOSABLE[m])

    def build(cfg: AlgoConfig, s: dict, batch_size: float, key: SecretKey | None) -> Parts:
        parts = b.build(cfg, {}, batch_size, key)
        if not perturb:
            return parts
        return Parts([Perturb(s["k"], key), *parts.per_sample], parts.error_feedback, parts.post, parts.divisor)

    def note(cfg: AlgoConfig, s: dict) -> str:
        last = b.build(cfg, {}, 1.0, None).per_sample[-1]  # the base's bounding stage
        bound = f"{last.bound:g} (clip C)" if isinstance(last, Clip) else f"{last.bound:g} (normalised)"
        parts = []
        if selfaug:
            parts.append(f"rows average the gradients of K={s['K']} random augmentations of one example")
        if perturb:
            parts.append(f"rows are perturbed g_i + {s['k']:g} N(0, I) before the clip (no privacy "
                         f"by itself, nothing changes in the accounting)")
        return f"per-example L2 sensitivity {bound}; {'; '.join(parts)}"

    def dice_grad_bound(cfg: AlgoConfig, s: dict) -> float | None:
        if cfg.grad_bound is None or not perturb:
            return cfg.grad_bound
        return cfg.grad_bound + 2 * b.dice_units(cfg)[0]  # G' = G_max + C1

    what = " + ".join(("pre-clipping perturbation (Chen et al. Sec. 5)" if m == "perturb" else
                       "self-augmentation (Xiao et al. Sec. 6)") for m in methods)
    algo = Algorithm(name or "+".join((base, *methods)), f"{b.description} with {what}", True, b.accounting,
                     build, schema=schema, source=augment.augmented_source if selfaug else None,
                     optimizer=b.optimizer, certifiable=b.certifiable, why_not_certifiable=b.why_not_certifiable,
                     dice_units=b.dice_units, dice_grad_bound=dice_grad_bound, note=note,
                     bandable=b.bandable)  # both pieces keep a row one example's at one step
    return registry.register(algo) if register else algo


compose("dpsgd", "perturb", name="perturb")
compose("dpsgd", "self-aug", name="self-aug")
compose("dice", "perturb", name="dice-perturb")
compose("dice", "self-aug", name="dice-self-aug")
