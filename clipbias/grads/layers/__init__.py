"""The fast path's layer rules, one module per layer family, each registering its ``LayerRule`` (``base``: the
protocol, the registry ``RULES`` and the defaults): ``linear`` (``nn.Linear``, transformers' ``Conv1D``),
``conv`` (``nn.Conv1d/2d/3d``), ``norms`` (InstanceNorm, GroupNorm, LayerNorm, RMSNorm, the reviewed Hugging
Face RMSNorms), ``embedding`` (``nn.Embedding``), ``prelu`` (``nn.PReLU``), ``vit`` (Hugging Face's
``ViTEmbeddings``); ``tied`` bounds a weight shared by an Embedding and a Linear or Conv1D.

Every rule forms the per-example gradients it sums, so its norms are ``sq_norms``' upper bounds on what is
summed, whatever the rounding; only the ghost norm of a ``groups=1`` Linear/Conv over several positions
needs its own rounding bound (``linear.ghost_norm_bound``), and a tied weight's cross term its own
(``tied.tie_cross``). A layer type without a rule, holding trainable parameters, makes
``fast.why_unsupported`` say so, and the engine keeps the rows path.

The modules are discovered: the families of ``_ORDER`` first, in that order (the order the rules are
registered, and the order in which ``grads.separable`` snapshots their classes), then any other module
of the package, alphabetically; adding a layer family touches no other file (docs/architecture.md,
"Adding a layer rule")."""

from __future__ import annotations

import importlib
import pkgutil

from .base import RULES, ChannelRule, LayerGrads, LayerRule, PerChannel, Rule, register

__all__ = ["RULES", "ChannelRule", "LayerGrads", "LayerRule", "PerChannel", "Rule", "register"]

_ORDER = ["base", "linear", "conv", "norms", "embedding", "prelu", "vit", "tied"]


def _load() -> None:
    found = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]
    for name in sorted(found, key=lambda n: (_ORDER.index(n) if n in _ORDER else len(_ORDER), n)):
        importlib.import_module(f"{__name__}.{name}")


_load()
