"""The catalog of algorithms: importing it registers every one (``ALGORITHMS``, ``get``).

===================  ==============================================================  ==================
``--algo``           what                                                            accounting
===================  ==============================================================  ==================
``sgd``/``clip-sgd``  non-private baselines (plain, clipped)                          none
``ef-sgd``           clipped error feedback without noise                             none
``dpsgd``            DPSGD-GC (Abadi et al.; Zhang et al. Alg. 1)                     Gaussian (S = C)
``normalized``       automatic clipping g/(||g|| + gamma)                             Gaussian (S = 1)
``dice``             DiceSGD, clipped error feedback (Zhang et al. Alg. 2)            DiceSGD's (sound)
``dice-adam``        DiceSGD with Adam (Alg. 3)                                       DiceSGD's (sound)
``dice-auto``        automatic DiceSGD (Alg. 4)                                       DiceSGD's (r = B)
``perturb``          ``clip(g_i + k zeta_i, C)`` (Chen et al. Sec. 5)                 DPSGD's (S = C)
``self-aug``         clip of the mean gradient of K augmentations (Xiao Sec. 6)       DPSGD's (S = C)
``dpgd-momentum``    per-example momentum, full batch (Xiao Alg. 1)                   Gaussian, q = 1
``inner-outer``      inner momentum over K0 past iterates + outer momentum (Alg. 2)   DPSGD's (S = C)
``p-avg``            clip of random-group mean gradients (Xiao Sec. 3.3)              S = 2C
``batch-clip``       BatchNorm group gradients with public features (Alg. 3)          DPSGD's, private N
``dice-perturb``     DiceSGD + pre-clipping perturbation                             DiceSGD's
``dice-self-aug``    DiceSGD + self-augmentation                                     DiceSGD's
``adaptive``         DPSGD with adaptive quantile clipping (Andrew et al. 2021)       Gaussian, joint z
``disk``             DPSGD-GC + DiSK's Kalman filter (Zhang et al. 2025); ``X+disk``  DPSGD's (S = C)
                     adds it to any base X (``--kalman``)                             (X's)
===================  ==============================================================  ==================

Layout: ``base`` (the ``Algorithm`` type, ``Parts``, the registry) at the bottom; one module per
method, each declaring its stages, row source, settings and registration; this catalog imports
them. Adding a method is one module (plus its import here) and its test. Method settings go in
``AlgoConfig.extra`` (see ``docs/methods.md``), e.g.
``DPEngine(model, "inner-outer", ..., config=AlgoConfig(lr=0.1, clip=1, extra={"K0": 2}))``.
"""

# importing a method module registers its algorithms; in this order (the order the registry, the toy
# comparison and the docs list them): the core algorithms, the paper methods, the compositions
from . import core  # noqa: I001 (order matters)
from . import momentum
from . import p_avg
from . import batchclip
from . import adaptive
from . import disk
from . import compose as _compose
from ..config import Setting
from .augment import AugmentedGradients, CropFlip
from .base import ALGORITHMS, Algorithm, Parts, clip_or_normalize, get, make_optimizer, register
from .batchclip import (BatchClipGradients, GroupBatchNorm, batchclip_logits, batchclip_predict,
                        batchnorm_variant, check_batchnorm_model, public_split)
from .compose import BASES, COMPOSABLE, compose
from .disk import KalmanFilter, TwoPointRows, kalman, kalman_name
from .momentum import (InnerMomentumGradients, OuterMomentum, PerExampleMomentum, available_memory_bytes,
                       check_momentum_memory, momentum_memory_bytes)
from .p_avg import GroupClip, GroupMeanGradients, noise_ratio_vs_dpsgd, num_groups
from .perturb import Perturb

REGISTRATION_ORDER = (core, momentum, p_avg, batchclip, adaptive, disk, _compose)  # the imports above, in order

__all__ = [
    "ALGORITHMS", "Algorithm", "AugmentedGradients", "BASES", "BatchClipGradients", "COMPOSABLE", "CropFlip",
    "GroupBatchNorm", "GroupClip", "KalmanFilter", "TwoPointRows", "kalman", "kalman_name", "GroupMeanGradients", "InnerMomentumGradients", "OuterMomentum", "Parts",
    "PerExampleMomentum", "Perturb", "available_memory_bytes", "batchclip_logits", "batchclip_predict",
    "batchnorm_variant", "check_batchnorm_model", "check_momentum_memory", "clip_or_normalize", "compose", "get",
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
