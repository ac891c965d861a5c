"""The core algorithms: SGD baselines, DPSGD-GC, automatic clipping, DiceSGD (Zhang et al.)."""

from __future__ import annotations

from ..step import Clip, ErrorFeedback, Normalize
from .base import Algorithm, Parts, register

register(Algorithm("sgd", "plain SGD on per-example gradients (non-private)", False, "none",
                   lambda c, s, b, key: Parts([])))
register(Algorithm("clip-sgd", "SGD with per-example clipping, no noise (non-private)", False, "none",
                   lambda c, s, b, key: Parts([Clip(c.clip)])))
register(Algorithm("ef-sgd", "clipped error-feedback SGD, no noise (non-private DiceSGD)", False, "none",
                   lambda c, s, b, key: Parts([Clip(c.clip)], ErrorFeedback(c.c2))))
register(Algorithm("dpsgd", "DPSGD-GC (Abadi et al. 2016; Zhang et al. Alg. 1)", True, "gaussian",
                   lambda c, s, b, key: Parts([Clip(c.clip)]), bandable=True, composable=True))
register(Algorithm("normalized", "per-example normalisation g/(||g||+gamma) (automatic clipping)", True,
                   "gaussian", lambda c, s, b, key: Parts([Normalize(c.gamma)]), bandable=True, composable=True))
register(Algorithm("dice", "DiceSGD, clipped error feedback (Zhang et al. Alg. 2)", True, "dice",
                   lambda c, s, b, key: Parts([Clip(c.clip)], ErrorFeedback(c.c2)), composable=True))
register(Algorithm("dice-adam", "DiceSGD with Adam/AdamW on v + w (Zhang et al. Alg. 3)", True, "dice",
                   lambda c, s, b, key: Parts([Clip(c.clip)], ErrorFeedback(c.c2)), optimizer="adam",
                   composable=True))
register(Algorithm(
    "dice-auto", "automatic DiceSGD: normalised gradients and feedback (Zhang et al. Alg. 4)", True, "dice",
    lambda c, s, b, key: Parts([Normalize(c.gamma)], ErrorFeedback(normalize=c.gamma)),
    certifiable=False,
    why_not_certifiable="normalisation e/(||e||+gamma) is not non-expansive (Lipschitz 1/gamma), but "
                        "the proof's first term (App. A.2, after eq. (21)) needs a non-expansive map",
    dice_units=lambda c: (1.0, 1.0), composable=True))
