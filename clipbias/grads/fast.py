"""The fast path for norm-scaling algorithms: per-example norms and the clipped sum without rows.

When the per-example stage only rescales each gradient by a function of its norm (clip, normalise:
``dpsgd``, ``normalized``, the DiceSGD family, the non-private baselines), the update needs
``sum_i s_i g_i`` and ``||g_i||``, not the ``[b, d]`` matrix of rows. For a layer with input
activations ``a_i`` (``[L, k]``: L positions, k features; L = 1 for a plain Linear) and output
gradients ``b_i`` (``[L, o]``) the per-example weight gradient is ``G_i = b_i^T a_i``, so

* ``||G_i||^2`` is ``||a_i||^2 ||b_i||^2`` when L = 1, and otherwise either ``<a_i a_i^T, b_i b_i^T>``
  (the ghost norm, ``L^2`` per example) or ``||b_i^T a_i||^2`` directly (``o k`` per example),
  whichever is smaller (mixed ghost clipping, Bu et al. 2022);
* ``sum_i s_i G_i = (s * b)^T a`` over all positions: one matrix product (book-keeping, no second
  backward pass).

One ordinary forward and backward of the summed loss give every ``a_i`` (forward hooks) and ``b_i``
(``autograd.grad`` w.r.t. the layer outputs; the summed loss's gradient at example i's output is
example i's, since no module mixes examples: ``check_model``). Each layer's arithmetic is its rule's:
one module per layer family in ``grads.layers`` registers a ``LayerRule`` (``layers.base``: the
protocol), and this module reaches a layer only through the registry (``RULES.rule_for``, cached by the
module's type): Linear and transformers' Conv1D (``layers.linear``: the ghost norm's rounding bound,
``ghost_norm_bound``), Conv1d/2d/3d (``layers.conv``), the normalisations (``layers.norms``), Embedding
(``layers.embedding``), PReLU (``layers.prelu``), Hugging Face's ViTEmbeddings (``layers.vit``), and a
weight tied between an Embedding and a Linear or Conv1D (``layers.tied``). Any other trainable parameter,
or weight shared otherwise, makes ``why_unsupported`` say why, and the engine keeps the rows path.
Dropout in the engine's step draws row r's masks from example r's index and the run's key
(``clipbias.randomness.forward``), as the rows path does.

Soundness guards (per-layer norms must be per-example norms, and each example's clipped vector
must depend on that example alone, or the sensitivity is wrong): tied parameters other than an
Embedding's weight shared with one Linear/Conv1D, parameters other than a layer's own
``weight``/``bias`` and a layer ``forward`` overridden (by a subclass or on the instance) are refused
when the engine is built; at every step, before any state changes: a user
forward hook on a supported layer, a layer that runs twice or not at all, a layer whose first
dimension is not the batch, a layer output modified in place after the layer ran, and a forward that
updates a buffer (restored) are refused; every trainable parameter must enter the autograd graph
exactly once, inside its own layer's forward (a tied weight: once inside each of its two layers and
nowhere else; exact, structural); and secret random examples'
attributed gradients must equal their own: when the forward is deterministic, ``PROBES`` examples
each run alone (a batch of one; all in one vectorised forward and one backward), and a secret random
combination of their attributed gradients, each scaled to unit norm, must equal the same combination
of their own gradients; when it draws random numbers (dropout), one example run alone (a batch of
one) under the masks it draws in the batch (keyed per example, in the engine's step; rechecked in
float64 where float32 rounding parts them), or, outside the engine's step, recomputed in a batch of
copies of itself under the same draws. A model
whose rows see other examples' data (batch statistics, mixup, cross-example attention) fails these;
a mixing confined to a few examples is caught with probability (examples probed) x (examples
affected) / b per step. Where the model's structure proves that no module mixes examples
(``grads.separable``: torch's per-example layers and activations composed by ``nn.Sequential`` or a
reviewed clipbias model class, no hooks; checked every step) the attribution is exact and the probe
is skipped. The red-team cases are in ``tests/test_fastclip.py``."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import Tensor, nn

from ..data import batch
from ..data.batch import Batch
from ..errors import ConfigError, PathRefusal
from ..randomness import forward
from . import precision
from .precision import exact32, full_float32, unit_roundoff
from .precision import gamma as _gamma
from . import separable
from .fast_checks import MIN_PROBE_NORM, MIXED_RTOL, PROBES, RuntimeChecks, _trainable  # noqa: F401  (the API's names)
from .fast_losses import PerExampleLosses
from .layers import RULES, LayerGrads
from .layers.linear import float32_sum_route
from .layers.tied import tie_cross, why_not_tied
from .path import GradPath, StepBatch
from .rows import LossFn, ParamLayout, check_model, cross_entropy, micro_batch_sums


def _supported(m: nn.Module) -> bool:
    """A layer with a fast-path rule (``RULES``: a torch layer class or a subclass, a reviewed Hugging Face
    class exactly; their forward checked by ``why_unsupported``)."""
    return RULES.rule_for(m) is not None


def rule_kind(m: nn.Module) -> str | None:
    """The name of the layer class whose fast-path rule ``m`` would take, looked up along its class's
    bases (so that a class FSDP derives from a layer still counts), or None: the engine's check that
    no ``fully_shard`` unit is itself such a layer."""
    return RULES.kind_of(type(m))


def why_unsupported(model: nn.Module) -> str | None:
    """None when every trainable parameter belongs to a supported layer, else the reason."""
    owners: dict[int, list] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        for pname, p in m.named_parameters(recurse=False):
            if p.requires_grad:
                owners.setdefault(id(p), []).append((name, pname, m))
    for uses in owners.values():
        # a tied parameter's per-example gradient is the sum of its uses': per-layer norms would understate
        # it (and with it the sensitivity) unless the uses' cross terms are added (layers.tied)
        why = why_not_tied(uses) if len(uses) > 1 else None
        if why is not None:
            return why
    for name, m in model.named_modules():
        if not any(p.requires_grad for p in m.parameters(recurse=False)):
            continue
        rule = RULES.rule_for(m)
        if rule is None:
            return f"module '{name}' ({type(m).__name__}) has trainable parameters and no fast-path rule"
        why = rule.why_not(m, name)  # its forward, its parameters, the options it does not cover
        if why is not None:
            return why
    return None


FORMED_BYTES = 256 * 2**20
"""The per-example weight gradients a micro-batch forms, at most, over all its layers (``ghost_plan``):
a layer over several positions takes the ghost norm only where forming its ``b o k`` floats would
pass this budget and ``L^2 <= o k``. Formed rows cost fewer operations than the ghost norm's float64
bound and sums (and are exact rows): on the CPU the cnn's fast step at B = 1024 took 62 ms with its
second convolution's 32 MB formed against 86 ms on the ghost norm, resnet20-gn's at B = 128 129
against 210 ms (docs/results.md). The budget keeps a language model's large layers on the ghost
norm, where forming them would hold gigabytes."""


def ghost_plan(layers: list[nn.Module], acts: dict, outs: dict | list) -> set[nn.Module]:
    """The Linear/Conv layers whose rules take the ghost norm in this micro-batch (the others over
    several positions form their per-example gradients): in layer order, a layer whose rule may take the
    ghost norm (``LayerRule.plan``: ``L^2 <= o k``) and whose ``b o k`` formed floats would take the layers
    formed so far past ``FORMED_BYTES``. From the shapes alone (``acts``: every layer's input, ``outs``:
    its output or output gradient, by layer or in ``layers``' order)."""
    if not isinstance(outs, dict):
        outs = dict(zip(layers, outs))
    ghost, used = set(), 0
    for m in layers:
        plan = RULES.rule_for(m).plan(m, acts[m], outs[m])
        if plan is None:  # one-position layers form nothing, other layers nothing against the budget
            continue
        size, may_ghost = plan
        if may_ghost and used + size > FORMED_BYTES:
            ghost.add(m)
        else:
            used += size
    return ghost


def _own_reference(m: nn.Module, ghost: set) -> bool:
    """Whether a layer's rule gives the reference sum as a nearly free second row of its sums
    (``LayerRule.own_reference``: a norm layer, a Linear/Conv that forms its per-example gradients, or a
    one-position layer, whose float64 sums convert each cached block of inputs once for both rows, cheaper
    than autograd's float32 weight gradient, which reads the whole input again); ``ghost``: ``ghost_plan``'s."""
    return RULES.rule_for(m).own_reference(m, m in ghost)


def _rules_of(layers: list[nn.Module], acts: dict, outs: list, plan: set | None = None,
              ties: list[tuple[int, int]] = ()) -> list:
    """Every layer's rule (inputs ``acts``, output gradients ``outs`` in ``layers``' order), each
    Linear/Conv over several positions on formed gradients or the ghost norm as ``ghost_plan`` says
    (``plan``: its answer for these shapes, where the caller has it). ``ties``: pairs (Embedding,
    Linear/Conv1D) of indices into ``layers`` sharing their weight: twice the cross term of their
    per-example gradients and its rounding margin (``layers.tied.tie_cross``) are added to the Embedding rule's
    ``sq``, so that the rules' summed ``sq`` bounds the squared norm of the tied parameter's summed
    per-example gradient."""
    plan = ghost_plan(layers, acts, outs) if plan is None else plan
    rules = [_rule(m, acts[m], g, m in plan) for m, g in zip(layers, outs)]
    for e, j in ties:
        rules[e].sq = rules[e].sq + tie_cross(rules[e], rules[j])
        rules[e].tied = rules[j].tied = True  # their weight's sums in float64, added, then rounded once
    return rules


def _rule(m: nn.Module, a: Tensor, g: Tensor, ghost: bool) -> LayerGrads:
    # bfloat16 / float16 inputs and output gradients (autocast: DPEngine(autocast=...), or inside the model) widen
    # exactly to float32: every norm, factor and sum below then runs in float32 or float64, as for a float32
    # model (16-bit sums moved the release by 1.27 C at B = 256; float16 squares underflow at 2^-12)
    a, g = exact32(a), exact32(g)
    return RULES.rule_for(m).grads(m, a, g, ghost)


class _Combined:
    """One layer's ``c G'_i + (1 - c) G_i`` from its rules at two points on the same examples (DiSK,
    ``clipbias.algorithms.kalman_filter``): the squared norm through the cross term, the sums linear in both.

    The expansion ``c^2 ||F||^2 + (1 - c)^2 ||N||^2 + 2 c (1 - c) <F, N>`` cancels when the two
    gradients nearly cancel, and then its rounding can exceed the true norm: an example whose
    combination cancels in one coordinate and leaves 1e-8 of it in another got a computed norm of 0
    and a contribution of 9424 C at DiSK's defaults. Every term is a float64 sum of at most n
    products (``terms``: the longest of either rule), within ``gamma_n`` of the sum of their
    magnitudes, i.e. of ``||F||^2``, ``||N||^2`` and ``||F|| ||N||`` (Cauchy-Schwarz), and the
    combination adds a few roundings more; so the true squared norm is at most the computed one plus
    ``(gamma_n + gamma_8) (|c| ||F|| + |1 - c| ||N||)^2``, with the norms from ``far.sq``, ``near.sq``
    (sums of squares, or a ghost norm's upper bound) and the margin doubled for second-order terms.
    (A ghost rule's own bound already covers its cross term: ``2 coef (c^2 U^2 + (1 - c)^2 U'^2) >=
    4 |c (1 - c)| coef U U'``.)"""

    def __init__(self, far, near, c: float) -> None:
        self.far, self.near, self.c = far, near, c
        sq = c * c * far.sq + (1 - c) ** 2 * near.sq + 2 * c * (1 - c) * far.cross(near)
        n, u = max(far.terms, near.terms), unit_roundoff(far.sq)
        spread = (abs(c) * far.sq.clamp_min(0).sqrt() + abs(1 - c) * near.sq.clamp_min(0).sqrt()).square()
        self.sq = sq.clamp_min(0) + 2 * (_gamma(n, u) + _gamma(8, u)) * spread
        self.terms = n

    def sums(self, S: Tensor) -> list[Tensor]:
        return [self.c * f + (1 - self.c) * n for f, n in zip(self.far.sums(S), self.near.sums(S))]

    def one(self, i: int) -> list[Tensor]:
        return [self.c * f + (1 - self.c) * n for f, n in zip(self.far.one(i), self.near.one(i))]

    def combo(self, idx: list[int], w: list[float]) -> list[Tensor]:
        return [self.c * f + (1 - self.c) * n for f, n in zip(self.far.combo(idx, w), self.near.combo(idx, w))]


class BookKeeping(GradPath):
    """``(clipped sum, reference sum, losses, norms)`` of a batch for a norm-scaling stage; the fast path's
    ``grads.path.GradPath`` (kind ``"fast"``). It holds its run-time checks (``checks``: ``grads.fast_checks``)
    and its per-example losses (``losses``: ``grads.fast_losses``)."""

    kind = "fast"

    sum_precision = "float64"
    """``precision.SUM_PRECISIONS``: "float32" sums the ghost layers the proof covers from per-example float32
    gradients (``layers.linear.float32_sum_route``); the engine sets it with the noise scaled to match
    (``DPEngine(sum_precision=...)``). Each call records ``last_sum_routes`` ({layer index: "float32" |
    "float64"} over the ghost layers) and ``last_sum_delta`` (the micro-batch's proven inflation, 0 in float64)."""
    last_sum_routes: dict = {}
    last_sum_delta = 0.0

    def __init__(self, model: nn.Module, loss_fn: LossFn = cross_entropy) -> None:
        check_model(model)
        reason = why_unsupported(model)
        if reason is not None:
            raise ConfigError(reason)
        self.model, self.layout = model, ParamLayout.of(model)
        self.losses = PerExampleLosses(loss_fn)  # the [b] per-example losses of loss_fn (decided once how)
        self.layers = [m for m in model.modules() if _supported(m) and _trainable(m)]
        names = {id(p): n for n, p in model.named_parameters()}
        slot = {n: i for i, n in enumerate(self.layout.names)}
        self.slots = [[slot[names[id(p)]] for p in _trainable(m)] for m in self.layers]
        users: dict[int, list[int]] = {}  # the layers using each parameter (several: a tied weight)
        for j, m in enumerate(self.layers):
            for p in _trainable(m):
                users.setdefault(id(p), []).append(j)
        # (Embedding, Linear/Conv1D) sharing their weight, as why_unsupported allows: their cross term (layers.tied)
        self.ties = [tuple(sorted(js, key=lambda j: RULES.rule_for(self.layers[j]).tie(self.layers[j]) != "table"))
                     for js in users.values() if len(js) > 1]
        self.checks = RuntimeChecks(self)  # the structural checks, the graph proof and the probe of every step
        self.keep_output, self.last_out = False, None  # the step's own forward output (clipbias.PrivacyEngine)
        self._keyed_calls = 0  # keyed dropout calls of the last forward (_backward)

    loss_fn = property(lambda self: self.losses.loss_fn)
    _proofs = property(lambda self: self.checks.proofs)  # the graph proofs' memo (grads.proof.Proofs)

    # The probe's steps (grads.fast_checks), reached through these methods: tests and benchmarks wrap them
    def _check_examples(self, rules: list, sq: Tensor, x: Batch, y: Batch, params: list, rng: tuple | None) -> None:
        self.checks.check_examples(rules, sq, x, y, params, rng)

    def _own(self, x: Batch, y: Batch, probes: list[int], params: list, w: list[float], call=None) -> list[Tensor]:
        return self.checks.own(x, y, probes, params, w, call)

    def _agree_in_float64(self, x: Batch, y: Batch, probes: list[int], w: list[float], attributed32: list) -> bool:
        return self.checks.agree_in_float64(x, y, probes, w, attributed32)

    def _alone(self, x: Batch, y: Batch, i: int, call: Callable | None = None) -> list[Tensor]:
        return self.checks.alone(x, y, i, call)

    def _alone_in_float64(self, x: Batch, y: Batch, i: int, attributed32: list) -> bool:
        return self.checks.alone_in_float64(x, y, i, attributed32)

    def _counterfactual(self, x: Batch, y: Batch, i: int, rng: tuple) -> list[Tensor]:
        return self.checks.counterfactual(x, y, i, rng)

    def _probe_weights(self, sq: Tensor, probes: list[int]) -> tuple[list[float], float]:
        return self.checks.probe_weights(sq, probes)

    def sums(self, step: StepBatch):
        return micro_batch_sums(self, step)

    def book_keeping(self) -> BookKeeping:
        return self

    def output_source(self) -> BookKeeping:
        return self

    def __call__(self, x: Batch, y: Batch, scale: Callable[[Tensor], Tensor],
                 reference: bool, at: tuple[Callable, float] | None = None) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        """``at = (enter, c)``: the rows are ``c g(point) + (1 - c) g(x_t)`` (DiSK), ``enter()`` a context in
        which the model's weights are at the point: every layer's rules at both points, each point's
        checked as always, combined exactly (``_Combined``, its terms in float64: the expansion of the
        combination's norm cancels, and float32 terms would understate it)."""
        dtype, ref, cheap = None, None, None
        self.checks.scale = scale  # (the probe's float64 recheck reads the per-example bound C off it)
        if at is None:  # the reference sum: from the formed rows where a layer has them, else autograd's (below)
            losses, rules, ref = self._rules(x, y, reference=reference)
            # where _rules left a parameter's reference to the rows (None): that layer's sums take a ones row
            cheap = [all(ref[k] is None for k in slots) for slots in self.slots] if reference else None
            reference = False
        else:
            enter, c = at
            wide = c != 1.0
            if wide and self.ties:
                raise ConfigError("grad_path=\"fast\" with DiSK's two points: tied weights (an Embedding sharing its "
                                  "weight with a Linear) have no bound on the cross terms between the points; use "
                                  "grad_path=\"rows\"")
            with enter():
                losses, rules, _ = self._rules(x, y, wide)
            if wide:
                losses, near, _ = self._rules(x, y, wide)
                rules = [_Combined(f, n, c) for f, n in zip(rules, near)]
                dtype = self.layout.params(self.model)[0].dtype
        norms = torch.sqrt(sum(r.sq for r in rules))
        if not bool(torch.isfinite(norms).all()):  # the caller refuses the step, naming the examples
            return torch.zeros(0), None, losses, norms
        two = [reference or bool(cheap and cheap[j]) for j in range(len(rules))]
        S = torch.stack([scale(norms)] + ([torch.ones_like(norms)] if any(two) else []))
        # sum_precision="float32": the ghost layers the float32 route's proof covers sum per-example float32
        # gradients (layers.linear.float32_sum_route; sensitivity C (1 + delta), docs/privacy.md)
        self.last_sum_routes, self.last_sum_delta = float32_sum_route(rules, _bound_of(scale)) \
            if self.sum_precision == "float32" else ({}, 0.0)
        with full_float32():  # TF32 would round the rows to 2^-11 before the clip factors meet them
            pieces = [r.sums(S if t else S[:1]) for r, t in zip(rules, two)]
        proc = self._assemble([[t[0] for t in lp] for lp in pieces])
        if reference:
            ref = self._assemble([[t[1] for t in lp] for lp in pieces])
        elif cheap is not None:  # the formed rows' ones-row where cheap, autograd's gradient elsewhere
            parts = self._ordered([[t[1] for t in lp] if c else [None] * len(lp) for lp, c in zip(pieces, cheap)])
            ref = torch.cat([a if a is not None else b.reshape(-1) for a, b in zip(parts, ref)])
        if dtype is not None:  # the wide rules' sums back to the parameters' precision
            proc, ref = proc.to(dtype), None if ref is None else ref.to(dtype)
        return proc, ref, losses, norms.to(proc.dtype)  # float64 where a ghost norm's bound took part

    def _rules(self, x: Batch, y: Batch, wide: bool = False,
               reference: bool = False) -> tuple[Tensor, list, list | None]:
        """(losses, every layer's rule, reference sums or None) at the model's current weights, the
        examples' attribution checked; ``wide``: the rules computed in float64 from the layers' inputs
        and output gradients. ``reference``: the unclipped sum ``sum_i g_i``, for ghost layers and
        embeddings, from the same backward, as autograd's gradient of the summed loss (one float32
        weight-gradient product per such layer instead of a second book-keeping sum, which on a ghost
        layer runs in float64); the other layers' come from their rules in ``__call__`` (a second row
        of the sums, nearly free: ``_own_reference``), so no weight-gradient product is spent on them. Returned as one
        tensor per parameter in layout order, None where the rows give it. It feeds only error
        feedback's hidden buffer, which the sound DiceSGD bound allows to be anything
        (docs/privacy.md), so its rounding does not enter the guarantee."""
        check_model(self.model)
        _check_running_stats(self.model)
        params = self.layout.params(self.model)
        dev = params[0].device
        keyed = forward.active() is not None  # the engine's step: dropout keyed per example, public draws refused
        rng = forward.snapshot(dev) if keyed else _rng_state(dev)
        buffers = [(b, b._version, b.detach().clone()) for b in self.model.buffers()]
        self.losses.alone = True  # losses_alone: the summed loss_fn's gradient taken one example at a time
        with full_float32():  # the batch and the probes in the same (full) float32 arithmetic
            try:
                # the step's aten program (decided before separable's hooks exist), frozen layers' inputs too
                with self.checks.graph_watch(x, y) as program, separable.watch(self.model, known=self.layers) as inputs:
                    losses, acts, grads = self._backward(x, y, params=self._unformed_params if reference else None,
                                                         keep=self.keep_output)
                for m in self.layers:  # the trainable layers' inputs, as the hooks of the backward took them
                    inputs.setdefault(m, []).append(acts[m].dim())
            finally:  # a buffer changed by the forward is restored and refused, whatever else failed
                _check_buffers(self.model, buffers)
            if keyed:
                forward.check_generators(rng, dev)
                stochastic = self._keyed_calls > 0
            else:
                stochastic = not _same_rng(rng, _rng_state(dev))  # dropout (or any other draw) in the forward
            # with the reference, the plan _unformed_params made from the same shapes: the rules and the
            # split of the reference between rules and autograd rest on one decision
            rules = _rules_of(self.layers, {m: _widen(acts[m], wide) for m in self.layers},
                              [_widen(g, wide) for g in grads[:len(self.layers)]],
                              self._plan if reference and not wide else None, self.ties)
            sq = sum(r.sq for r in rules)
            # else the caller refuses the step; a model per-example by construction, under a loss of one
            # example at a time (a loss_fn returning per-example losses may combine them), needs no probe
            own_loss = self.loss_fn is cross_entropy or getattr(self.loss_fn, "per_example", False) \
                or self.losses.vector is False and self.losses.alone
            # a forward that drew only keyed dropout may be proven from its graph (grads.proof: its masks' rows are
            # each example's own); separable's structural proof assumes no draw at all
            proven = not stochastic and own_loss and separable.proven(self.model, inputs, batch.leaves(y)) or \
                (not stochastic or keyed) and self.checks.graph_proven(program, x, y, own_loss)
            if bool(torch.isfinite(sq).all()) and not proven:
                self._check_examples(rules, sq, x, y, params, rng if stochastic else None)
        ref = None
        if reference:  # layout order; None for the parameters of layers whose rules give it
            got = dict(zip(map(id, self._unformed), grads[len(self.layers):]))
            ref = [got.get(id(p)) for p in params]
        return losses, rules, ref

    def _unformed_params(self, acts: dict, outs: dict) -> list[Tensor]:
        """After the forward: the trainable parameters of the layers whose rules do not give the
        reference sum themselves (``_own_reference``), which the reference sum takes from autograd; kept
        in ``self._unformed`` (and the ghost plan in ``self._plan``) for ``_rules``."""
        self._plan = plan = ghost_plan(self.layers, acts, outs)
        unformed = [not _own_reference(m, plan) for m in self.layers]
        for e, j in self.ties:  # autograd's reference of a tied weight is both layers': theirs all from it
            unformed[e] = unformed[j] = unformed[e] or unformed[j]
        seen: set[int] = set()
        self._unformed = [p for m, u in zip(self.layers, unformed) if u for p in _trainable(m)
                          if id(p) not in seen and not seen.add(id(p))]
        return self._unformed


    def _backward(self, x: Batch, y: Batch, call: Callable | None = None, check_graph: bool = True,
                  params: list | Callable[[dict, dict], list] | None = None, keep: bool = False) -> tuple:
        """One forward and one backward of the summed loss, to the layer outputs only (no parameter
        gradients unless ``params`` are given: then their gradients follow the layers' in the list):
        the per-example losses (detached), every layer's input and output gradient. Refuses, before
        anything changes, a model the rules would misread. ``call`` runs the model (default: the
        model itself; the float64 recheck passes it widened weights)."""
        acts: dict[nn.Module, Tensor] = {}
        outs: dict[nn.Module, Tensor] = {}
        ins: dict[nn.Module, object] = {}
        versions: dict[nn.Module, int] = {}
        _check_hooks(self.layers)
        rules = {m: RULES.rule_for(m) for m in self.layers}

        def hook(m: nn.Module, inp: tuple, out: Tensor) -> None:
            if m in acts:  # a layer used twice: its per-example gradient sums both uses
                raise PathRefusal("fast", f"`grad_path='fast'`: a {type(m).__name__} layer runs twice in one forward "
                                  f"pass (shared weights); per-layer norms would understate the per-example "
                                  f"gradient. Use `grad_path='rows'`")
            a, out = rules[m].batch_rows(m, inp[0], out, b)  # an Embedding's ids shared by the batch: expanded
            acts[m], outs[m], ins[m], versions[m] = a.detach(), out, inp[0].grad_fn, out._version
            return out

        b = batch.size(x)
        handles: list = []
        try:
            for m in self.layers:  # a ViTEmbeddings' output gradient is taken at its dropout's input (layers.vit)
                handles += rules[m].hooks(m, hook)
            with torch.enable_grad():
                # keyed dropout: row r's masks from example r's index; the step's autocast (DPEngine(autocast=...))
                # around the model's own forward (not the float64 recheck's: ``call``)
                mixed = precision.forward_autocast() if call is None else contextlib.nullcontext()
                with forward.one_pass() as seen, mixed:
                    losses = self.losses(self._kept(batch.call(call or self.model, x), keep), y, b)
                self._keyed_calls = seen.calls
                self.checks.check_layers(acts, outs, b)
                changed = [m for m in self.layers if outs[m]._version != versions[m]]
                if changed:  # the backward would differentiate through the later in-place op
                    raise PathRefusal("fast", f"`grad_path='fast'`: the output of a {type(changed[0]).__name__} layer "
                                      f"is modified in place after the layer ran (ReLU(inplace=True) or h *= c, say); "
                                      f"use the out-of-place operation, or `grad_path='rows'`")
                if check_graph:  # off only for the float64 recheck, whose leaves are copies
                    self.checks.check_graph(losses, outs, ins)
                # the outputs' graph edges, not the outputs: a language model's logits (the head's output,
                # 1.65 GB for a 64M GPT at B = 128) are then freed once the loss has read them, as in a
                # non-private step, instead of being held through the backward
                if callable(params):  # which parameters, decided from the layers' shapes (the reference sum)
                    params = params(acts, outs)
                targets = [_edge(outs.pop(m)) for m in self.layers]
                scale = precision.loss_scale() if call is None else 1.0  # float16: against underflow
                grads = torch.autograd.grad(losses.sum() * scale if scale != 1.0 else losses.sum(),
                                            targets + (params or []))
        finally:
            for h in handles:
                h.remove()
        if scale != 1.0:  # a power of two: divided out exactly (widened to float32 first)
            grads = [exact32(g, scale) for g in grads]
        return exact32(losses.detach()), acts, list(grads)

    def _kept(self, out, keep: bool):
        """``out``, and its detached copy in ``last_out`` when ``keep`` (the step's output, handed to the user's
        loop instead of a second forward; kept only then, so a language model's logits are otherwise freed
        once the loss has read them)."""
        if keep:
            self.last_out = batch.detached(out)
        return out


    def _rules_at(self, acts: dict, grads: list) -> list:
        """Every layer's rule from its inputs ``acts`` and output gradients ``grads`` (``_rules_of``)."""
        return _rules_of(self.layers, acts, grads, ties=self.ties)

    def _assemble(self, per_layer: list[list[Tensor]]) -> Tensor:
        """Per-layer, per-parameter flat pieces concatenated in ``ParamLayout`` order."""
        return torch.cat(self._ordered(per_layer))

    def _ordered(self, per_layer: list[list[Tensor]]) -> list[Tensor]:
        parts: list[Tensor | None] = [None] * len(self.layout.names)
        for slots, pieces in zip(self.slots, per_layer):
            for s, t in zip(slots, pieces):  # a tied parameter: the sum of its layers' pieces
                parts[s] = t if parts[s] is None else parts[s] if t is None else parts[s] + t
        for e, _ in self.ties:  # the tied weight's float64 sums, added above, rounded once to its precision
            s = self.slots[e][0]
            if parts[s] is not None:
                parts[s] = parts[s].to(self.layers[e].weight.dtype)
        return parts


def _bound_of(scale: Callable) -> float | None:
    """The per-example bound C of the stage whose ``scale`` it is (``s_i ||g_i|| <= C``: a clip's ``c``, a
    normalisation's ``bound``), or None where ``scale`` is not a stage's method."""
    stage = getattr(scale, "__self__", None)
    c = getattr(stage, "c", getattr(stage, "bound", None))
    return float(c) if isinstance(c, (int, float)) and not isinstance(c, bool) else None


def _edge(t: Tensor):
    """What ``torch.autograd.grad`` needs to return the gradient with respect to ``t`` without
    keeping ``t`` alive: its gradient edge (torch >= 2.2), else ``t`` itself."""
    get = getattr(torch.autograd.graph, "get_gradient_edge", None)
    return get(t) if get is not None else t


def _widen(t: Tensor, wide: bool) -> Tensor:
    """``t`` in float64 where ``wide`` and it holds floating-point values (an embedding's indices stay)."""
    return t.double() if wide and t.is_floating_point() else t


def _rng_state(device: torch.device) -> tuple:
    return (torch.get_rng_state(),) + ((torch.cuda.get_rng_state(device),) if device.type == "cuda" else ())


def _same_rng(a: tuple, b: tuple) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b))


def _check_hooks(layers: list) -> None:
    """Forward hooks of the user on a supported layer (or global ones) can change its output after
    the layer ran, which the rules would take for the layer's: refused. Pre-hooks are fine (the
    layer sees what they return)."""
    hooked = [m for m in layers if m._forward_hooks] or (layers if nn.modules.module._global_forward_hooks else [])
    if hooked:
        raise PathRefusal("fast", f"`grad_path='fast'`: a forward hook is registered on a {type(hooked[0]).__name__} "
                          f"layer (or globally): it may change the layer's output after the layer ran. Remove it, or "
                          f"use `grad_path='rows'`")


def _check_running_stats(model: nn.Module) -> None:
    """Before the forward, every module's rule refuses what would make it unsound (``LayerRule.check_step``:
    an InstanceNorm tracking running statistics updates them from the batch in a training forward, refused
    by name; ``_check_buffers`` would refuse any buffer the forward changes)."""
    for name, m in model.named_modules():
        rule = RULES.rule_for(m)
        if rule is not None:
            rule.check_step(m, name)


def _check_buffers(model: nn.Module, before: list) -> None:
    """A forward that updates a buffer (a running statistic) computes a statistic of the private
    batch that would be released without noise: restored and refused."""
    changed = [b for b, v, _ in before if b._version != v]
    if changed:
        with torch.no_grad():
            for b, _, copy in before:
                b.copy_(copy)
        names = [n for n, b in model.named_buffers() if any(b is c for c in changed)]
        raise ConfigError(f"`grad_path='fast'`: the forward pass updates buffer(s) {names} from the batch: a statistic "
                          f"of the private data would be released without noise (the DP guarantee does not cover "
                          f"it). Make it a constant, or remove it")


