"""The declared protocol of a fast-path layer rule, its registry, and the defaults a rule inherits.

A layer family is one module of this package holding a ``LayerRule`` and its ``register`` call; the
book-keeping engine (``grads.fast``), its run-time checks (``grads.fast_checks``) and the structural proof
(``grads.separable``) reach a layer only through ``RULES.rule_for(m)`` (the rule claiming module ``m``:
looked up by ``type(m)``, cached) and ``RULES.separable_rule(t)`` (the rule whose exact class ``t`` acts on
each example alone). ``Rule`` gives every method its default: a torch layer whose trainable parameters are
``weight`` and ``bias`` and whose ``forward`` is its class's; ``ChannelRule`` the per-channel rule of the
normalisations and PReLU (one value per channel or feature: a transform of the input times the output
gradient, summed over positions)."""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ...errors import ConfigError
from ...registry import Registry
from ..formed import FormedRows


class LayerGrads(Protocol):
    """One layer's per-example gradients on one batch, as a rule computes them from the layer's input ``a``
    and output gradient ``g`` (one forward and backward of the summed loss), never as a ``[b, d]`` row matrix
    unless the rule forms one. Parameters come in the rule's ``params`` order."""

    sq: Tensor
    """``[b]`` float64: an upper bound on each example's squared gradient norm over the layer's trainable
    parameters, whatever the rounding (``precision.sq_norms`` of formed rows, a bound such as
    ``ghost_norm_bound`` otherwise)."""

    terms: int
    """The longest float64 sum behind ``sq`` and ``cross`` (DiSK's combination bounds its rounding with it)."""

    def sums(self, S: Tensor) -> list[Tensor]:
        """``[n, numel]`` per parameter: ``sum_i S[j, i] grad_i`` for every row j of ``S [n, b]`` (the clipped
        sum in row 0, the reference sum in row 1 where asked)."""

    def one(self, i: int) -> list[Tensor]:
        """Example ``i``'s gradient, one flat tensor per parameter (the probe)."""

    def combo(self, idx: list[int], w: list[float]) -> list[Tensor]:
        """``sum_k w[k] grad_{idx[k]}``, one flat tensor per parameter (the probe's secret combination)."""

    def cross(self, o: "LayerGrads") -> Tensor:
        """``[b]``: ``<grad_i, grad'_i>``, ``o`` the same rule on the same examples at other weights (DiSK)."""


@runtime_checkable
class LayerRule(Protocol):
    """A layer family on the fast path: which modules it covers, what it refuses, and the per-example
    gradients of their trainable parameters (``grads``). ``Rule`` implements every method but ``grads``."""

    name: str
    """The registry key (``RULES``)."""

    separable: tuple[type, ...]
    """The exact classes (not subclasses) whose forward acts on each example alone: ``grads.separable``
    proves a model of them, composed by ``nn.Sequential``, per-example without the probe."""

    def kind(self, c: type) -> bool:
        """Whether class ``c`` itself is one the rule covers (``rule_kind`` walks a module's class bases)."""

    def claims(self, m: nn.Module) -> bool:
        """Whether the rule computes ``m``'s gradients (only asked of a module one of whose class bases is a
        ``kind``)."""

    def why_not(self, m: nn.Module, name: str) -> str | None:
        """Why module ``m`` (named ``name`` in the model), with trainable parameters, is refused when the
        engine is built (an overridden ``forward``, options the rule does not cover), else None."""

    def params(self, m: nn.Module) -> list[nn.Parameter]:
        """``m``'s trainable parameters, in the order ``grads`` returns their pieces."""

    def hooks(self, m: nn.Module, record: Callable) -> list:
        """Handles of the hooks that call ``record(m, (input,), output)`` in the forward, where the rule reads
        the layer's input and output (default: a forward hook on ``m``; its return value replaces the output)."""

    def batch_rows(self, m: nn.Module, a: Tensor, out: Tensor, b: int) -> tuple[Tensor, Tensor]:
        """The input and output the rule reads, one row per example of a batch of ``b`` (``out`` as the
        layer's forward continues with it)."""

    def check_step(self, m: nn.Module, name: str) -> None:
        """Raise where module ``m`` (trainable or frozen) would make this step's forward unsound (a
        statistic of the batch updated, say); run before every step's forward."""

    def input_dims(self, m: nn.Module) -> tuple[int, int | None] | None:
        """``(fewest, most)`` dimensions of an input that holds the batch dimension (most None: any number),
        or None when every input does (``grads.separable.batched``; an exact count is also checked at the
        step, ``fast_checks``)."""

    def why_not_separable(self, m: nn.Module) -> str | None:
        """Why a module of a ``separable`` class does not act on each example alone (the message's
        predicate: "uses ..."), else None."""

    def plan(self, m: nn.Module, a: Tensor, out: Tensor) -> tuple[int, bool] | None:
        """Against ``fast.FORMED_BYTES``: the bytes of the per-example gradients this layer forms in the
        batch and whether the ghost norm may replace them; None when it forms none against the budget."""

    def own_reference(self, m: nn.Module, ghost: bool) -> bool:
        """Whether ``grads``' sums give the reference sum as a nearly free second row (else it comes from
        autograd); ``ghost``: whether ``fast.ghost_plan`` put the layer on the ghost norm."""

    def tie(self, m: nn.Module) -> str | None:
        """``"table"`` (an Embedding's weight) or ``"matrix"`` (a Linear's or Conv1D's weight): the two
        sides of a weight shared by two layers that ``layers.tied`` bounds; None for any other layer."""

    def grads(self, m: nn.Module, a: Tensor, g: Tensor, ghost: bool) -> LayerGrads:
        """The layer's per-example gradients from its input ``a`` and output gradient ``g`` (float32 or
        float64: 16-bit ones are widened first), on the ghost norm where ``ghost``."""


class Rules(Registry):
    """The registry of layer rules (``Registry``: one name once), looked up by a module's type. A class is
    covered by one rule at most (``register`` refuses a second), and a lookup is a dictionary read after
    the first of each type: the cache is dropped when a rule is added or removed (``del RULES[name]``).
    ``watchers`` are called ``(rule, added)`` on each change (``grads.separable`` snapshots a new rule's
    classes)."""

    def __init__(self) -> None:
        super().__init__("a layer rule", "rule")
        self.watchers: list[Callable[[LayerRule, bool], None]] = []
        self._candidates: dict[type, tuple] = {}
        self._exact: dict[type, LayerRule] | None = None

    def register(self, item: LayerRule) -> LayerRule:
        """Add ``item`` under its ``name``; refused when one of its classes is another rule's."""
        for other in self.values():
            if other.name == getattr(item, "name", None):
                continue  # refused below: a name is registered once
            both = [c for c in getattr(item, "types", ()) + item.separable if other.kind(c) or c in other.separable]
            if both:
                raise ConfigError(f"a layer rule covers {both[0].__name__} already: {other.name!r}")
        super().register(item)
        self._changed(item, True)
        return item

    def __delitem__(self, name: str) -> None:
        rule = self[name]
        super().__delitem__(name)
        self._changed(rule, False)

    def _changed(self, rule: LayerRule, added: bool) -> None:
        self._candidates.clear()
        self._exact = None
        for w in self.watchers:
            w(rule, added)

    def rule_for(self, m: nn.Module) -> LayerRule | None:
        """The rule that computes ``m``'s gradients, or None: the first registered whose ``kind`` is one of
        ``type(m)``'s class bases (cached by type) and which ``claims`` ``m``."""
        t = type(m)
        found = self._candidates.get(t)
        if found is None:
            found = self._candidates[t] = tuple(r for r in self.values() if any(r.kind(c) for c in t.__mro__))
        for r in found:
            if r.claims(m):
                return r
        return None

    def kind_of(self, t: type) -> str | None:
        """The name of the first of ``t``'s class bases that a rule covers, or None."""
        return next((c.__name__ for c in t.__mro__ if any(r.kind(c) for r in self.values())), None)

    def separable_rule(self, t: type) -> LayerRule | None:
        """The rule whose ``separable`` classes hold exactly ``t``, or None."""
        if self._exact is None:
            self._exact = {c: r for r in self.values() for c in r.separable}
        return self._exact.get(t)


RULES = Rules()
"""Every layer rule, in registration order (``layers/__init__``: the built-in families first, in
``_ORDER``, then any other module of the package)."""


def register(rule: LayerRule) -> LayerRule:
    """Register a layer rule (its module's one call)."""
    return RULES.register(rule)


def trainable_pair(m: nn.Module) -> tuple[bool, bool]:
    """Whether the layer's weight, its bias, is a trainable parameter (an RMSNorm has no bias)."""
    w, b = getattr(m, "weight", None), getattr(m, "bias", None)
    return isinstance(w, Tensor) and w.requires_grad, isinstance(b, Tensor) and b.requires_grad


def weight_and_bias_only(m: nn.Module, name: str) -> str | None:
    """Why ``m`` is refused for trainable parameters other than ``weight`` and ``bias`` (weight_norm's
    ``weight_g`` / ``weight_v``, say), else None."""
    own = {n for n, p in m.named_parameters(recurse=False) if p.requires_grad}
    if not own <= {"weight", "bias"}:
        return f"module '{name}' ({type(m).__name__}) has parameters {sorted(own)} besides weight and bias"
    return None


def stacked(rows: list[Tensor]) -> Tensor:
    """``torch.stack(rows)``, without copying a single row (a GPT head's sum is 154 MB)."""
    return rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(rows)


class Rule:
    """``LayerRule``'s defaults, for torch layer classes ``types`` (subclasses too): the class's own
    ``forward`` (not overridden by a subclass or on the instance), trainable ``weight`` and ``bias`` only,
    read by a forward hook; nothing refused at the step; no requirement on the input's dimensions; the
    reference sum from ``grads``' own sums; no tie. A family sets ``name``, ``types``, ``separable`` and
    ``grads``, and overrides what differs."""

    name = ""
    types: tuple[type, ...] = ()
    separable: tuple[type, ...] = ()

    def kind(self, c: type) -> bool:
        return c in self.types

    def claims(self, m: nn.Module) -> bool:
        return isinstance(m, self.types)

    def why_not(self, m: nn.Module, name: str) -> str | None:
        base = next(c for c in self.types if isinstance(m, c))
        if type(m).forward is not base.forward or "forward" in m.__dict__:  # the rules assume the standard one
            return f"module '{name}' ({type(m).__name__}) overrides {base.__name__}.forward"
        return weight_and_bias_only(m, name)

    def params(self, m: nn.Module) -> list[nn.Parameter]:
        return [p for p in (getattr(m, "weight", None), getattr(m, "bias", None)) if p is not None and p.requires_grad]

    def hooks(self, m: nn.Module, record: Callable) -> list:
        return [m.register_forward_hook(record)]

    def batch_rows(self, m: nn.Module, a: Tensor, out: Tensor, b: int) -> tuple[Tensor, Tensor]:
        return a, out

    def check_step(self, m: nn.Module, name: str) -> None:
        return None

    def input_dims(self, m: nn.Module) -> tuple[int, int | None] | None:
        return None

    def why_not_separable(self, m: nn.Module) -> str | None:
        return None

    def plan(self, m: nn.Module, a: Tensor, out: Tensor) -> tuple[int, bool] | None:
        return None

    def own_reference(self, m: nn.Module, ghost: bool) -> bool:
        return True

    def tie(self, m: nn.Module) -> str | None:
        return None

    def grads(self, m: nn.Module, a: Tensor, g: Tensor, ghost: bool) -> LayerGrads:
        raise NotImplementedError(f"the layer rule {self.name!r} has no grads")


class PerChannel(FormedRows):
    """The per-example gradients of a layer with one weight (and bias) value per channel or feature: the
    weight's ``(xhat * g)`` and the bias's ``g``, summed over the positions ``dims``, formed (``FormedRows``)."""

    def __init__(self, m: nn.Module, xhat: Tensor, dims: tuple[int, ...], g: Tensor) -> None:
        b = xhat.shape[0]
        parts = []
        weight, bias = trainable_pair(m)
        if weight:
            parts.append(((xhat * g).sum(dims) if dims else xhat * g).reshape(b, -1))
        if bias:
            parts.append((g.sum(dims) if dims else g).reshape(b, -1))
        self.form(parts)


class ChannelRule(Rule):
    """A layer whose output is ``weight * xhat + bias`` per channel or feature, ``xhat`` a function of its
    input alone (``normalised``): its per-example gradients formed (``PerChannel``)."""

    def normalised(self, m: nn.Module, a: Tensor) -> tuple[Tensor, tuple[int, ...]]:
        """``(xhat, dims)``: what the weight multiplies, and the dimensions of ``xhat`` that are positions
        (summed over) rather than channels or features."""
        raise NotImplementedError

    def grads(self, m: nn.Module, a: Tensor, g: Tensor, ghost: bool) -> LayerGrads:
        xhat, dims = self.normalised(m, a)
        return PerChannel(m, xhat, dims, g)
