"""The catalog of algorithms: importing it registers every one (``ALGORITHMS``, ``get``).

Layout: ``base`` (the ``Algorithm`` type, ``Parts``, the registry) at the bottom; one module per
method, each declaring its stages, row source, settings and registration (whether banded noise covers
it, ``bandable``; whether ``compose`` builds on it, ``composable``); this catalog imports every module of
the package itself (``_modules``), so a new method is its module alone (docs/architecture.md, "Adding a
method"). The table of every ``--algo`` is docs/methods.md's ("Every algorithm"), checked against the
registry by ``tests/test_architecture.py``; ``ALGORITHMS`` itself is what the engine, the CLI and the
integrations read. Method settings go in ``AlgoConfig.extra`` (see ``docs/methods.md``), e.g.
``DPEngine(model, "inner-outer", ..., config=AlgoConfig(lr=0.1, clip=1, extra={"K0": 2}))``.
"""

import importlib
import pkgutil

# the catalog: importing a method module registers its algorithms. The modules are discovered (``_modules``):
# ``_FIRST`` in its order (the order the registry, the toy comparison and the docs list the methods: the core
# algorithms, then the paper methods), then every other module of the package by name (a new method needs
# no line here), then ``_LAST``: the compositions of the registered ``composable`` bases and the noise
# strategies (``bands.NOISE_STRATEGIES``). ``_LAZY`` are helpers that register nothing, imported by their
# users when needed (scipy's optimisers of banded and BLT noise), not by the catalog.
_FIRST = ("core", "momentum", "p_avg", "batchclip", "adaptive", "kalman_filter")  # kalman_filter: DiSK
_LAST = ("compose", "bands")
_LAZY = ("band_strategy", "blt")


def _modules(found: list[str]) -> list[str]:
    """The order in which the catalog imports the package's modules ``found`` (their names)."""
    rest = sorted(set(found) - set(_FIRST) - set(_LAST) - set(_LAZY))
    return [*_FIRST, *(n for n in rest if not n.startswith("_")), *_LAST]


def _load() -> None:
    for name in _modules([m.name for m in pkgutil.iter_modules(__path__)]):
        importlib.import_module(f"{__name__}.{name}")


_load()
# the public names, once every module is loaded (importing ``batchclip`` first would register it first)
from ..config import Setting  # noqa: E402, I001
from .augment import AugmentedGradients, CropFlip  # noqa: E402
from .base import ALGORITHMS, Algorithm, Parts, clip_or_normalize, get, make_optimizer, register  # noqa: E402
from .batchclip import (BatchClipGradients, GroupBatchNorm, batchclip_logits, batchclip_predict,  # noqa: E402
                        batchnorm_variant, check_batchnorm_model, public_split)
from .compose import COMPOSABLE, bases, compose  # noqa: E402
from .kalman_filter import KalmanFilter, TwoPointRows, kalman, kalman_name  # noqa: E402
from .momentum import (InnerMomentumGradients, OuterMomentum, PerExampleMomentum,  # noqa: E402
                       available_memory_bytes, check_momentum_memory, momentum_memory_bytes)
from .p_avg import GroupClip, GroupMeanGradients, noise_ratio_vs_dpsgd, num_groups  # noqa: E402
from .perturb import Perturb  # noqa: E402

__all__ = [
    "ALGORITHMS", "Algorithm", "AugmentedGradients", "BatchClipGradients", "COMPOSABLE", "CropFlip",
    "GroupBatchNorm", "GroupClip", "KalmanFilter", "TwoPointRows", "kalman", "kalman_name", "GroupMeanGradients", "InnerMomentumGradients", "OuterMomentum", "Parts",
    "PerExampleMomentum", "Perturb", "available_memory_bytes", "batchclip_logits", "batchclip_predict",
    "bases", "batchnorm_variant", "check_batchnorm_model", "check_momentum_memory", "clip_or_normalize", "compose", "get",
    "all_settings", "make_optimizer", "momentum_memory_bytes", "setting_flag", "noise_ratio_vs_dpsgd", "num_groups", "public_split", "register",
]


def all_settings() -> dict[str, Setting]:
    """Every method setting of the registered algorithms, by key (the CLI's method flags)."""
    out: dict = {}
    for algo in ALGORITHMS.values():
        for s in algo.schema:
            out.setdefault(s.key, s)
    return out


def setting_flag(key: str) -> str:
    """The CLI flag of an ``AlgoConfig.extra`` key (a key or an alias); the key itself if unknown."""
    for s in all_settings().values():
        if key in (s.key, *s.aliases):
            return s.flag
    return key
