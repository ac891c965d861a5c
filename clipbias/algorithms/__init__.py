"""The catalog of algorithms: importing it registers every one (``ALGORITHMS``, ``get``).

Layout: ``base`` (the ``Algorithm`` type, ``Parts``, the registry) at the bottom; one module per
method, each declaring its stages, row source, settings and registration (whether banded noise covers
it, ``bandable``; whether ``compose`` builds on it, ``composable``); this catalog imports them, one line
each. The table of every ``--algo`` is docs/methods.md's ("Every algorithm"), checked against the
registry by ``tests/test_architecture.py``; ``ALGORITHMS`` itself is what the engine, the CLI and the
integrations read. Method settings go in ``AlgoConfig.extra`` (see ``docs/methods.md``), e.g.
``DPEngine(model, "inner-outer", ..., config=AlgoConfig(lr=0.1, clip=1, extra={"K0": 2}))``.
"""

# the catalog: importing a method module registers its algorithms; in this order (the order the registry,
# the toy comparison and the docs list them): the core algorithms, the paper methods, the compositions
from . import core  # noqa: I001 (order matters)
from . import momentum
from . import p_avg
from . import batchclip
from . import adaptive
from . import kalman_filter  # DiSK
from . import compose as _compose  # noqa: F401  (registers the compositions, last)
from . import bands  # noqa: F401  (registers the noise strategies, bands.NOISE_STRATEGIES)
from ..config import Setting
from .augment import AugmentedGradients, CropFlip
from .base import ALGORITHMS, Algorithm, Parts, clip_or_normalize, get, make_optimizer, register
from .batchclip import (BatchClipGradients, GroupBatchNorm, batchclip_logits, batchclip_predict,
                        batchnorm_variant, check_batchnorm_model, public_split)
from .compose import COMPOSABLE, bases, compose
from .kalman_filter import KalmanFilter, TwoPointRows, kalman, kalman_name
from .momentum import (InnerMomentumGradients, OuterMomentum, PerExampleMomentum, available_memory_bytes,
                       check_momentum_memory, momentum_memory_bytes)
from .p_avg import GroupClip, GroupMeanGradients, noise_ratio_vs_dpsgd, num_groups
from .perturb import Perturb

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
