"""The fast path's run-time checks (an object ``grads.fast.BookKeeping`` holds: ``checks``): that the layers the rules read
ran once each, on batch-first rows, that every trainable parameter enters the graph only inside its own
layer (exact, structural), and the secret probe that random examples' attributed gradients equal their own
(``_check_examples``). What each refuses, and why, is in ``grads.fast``'s module docstring."""

from __future__ import annotations

import contextlib
import math
import secrets
from typing import Callable

import torch
from torch import Tensor, nn

from ..data import batch
from ..data.batch import Batch
from ..errors import ConfigError, PathRefusal
from ..randomness import forward
from . import precision, proof, separable
from .layers import RULES
from .precision import row_norms
from .rows import cross_entropy

PROBES = 4
"""Examples probed per step (deterministic forward)."""

FLOOR = 2.0 ** -20
"""Under dropout, the float32 attribution is compared with the float64 one relative to at least ``FLOOR`` times the
per-example bound C (``alone_in_float64``)."""

MIN_PROBE_NORM = 1e-30
"""Attributed norms below this weigh a probe as if they were this (``_probe_weights``)."""

_MIXING = ("`grad_path='fast'`: the gradient of example(s) {i} as the per-layer rules attribute it differs from its "
           "own gradient (the example(s) {alone}): the model lets examples see each other (batch statistics, "
           "mixup, cross-example attention, a sequence-first layout), so per-layer norms are not per-example "
           "norms. Use `grad_path='rows'`")

MIXED_RTOL = 0.25
"""How far, under autocast, the rules' 16-bit attribution may lie from the float64 one (``_agree_in_float64``;
5e-2 for float32): bfloat16 forwards and backwards put the cnn's 3.5-4.6 % from it, a 2-layer GPT's 0.4 %."""

_MIXED_HINT = ("; or, under autocast, the 16-bit forward and backward lost more than 25 % of these examples' "
               "gradient against float64 (float16 output gradients flushed to zero: raise loss_scale)")

def _batched_dims(m: nn.Module, default: int) -> int:
    """The exact number of dimensions of the layer's batched input where its rule fixes one (a Conv's, an
    InstanceNorm's: one dimension less is one unbatched example), else ``default``."""
    dims = RULES.rule_for(m).input_dims(m)
    return dims[0] if dims is not None and dims[0] == dims[1] else default


def _trainable(m: nn.Module) -> list[nn.Parameter]:
    """The layer's trainable parameters in the order its rule returns them (``LayerRule.params``: weight,
    bias; a ViTEmbeddings': ``layers.vit.PARAMS``)."""
    return RULES.rule_for(m).params(m)


class RuntimeChecks:
    """The checks of every fast-path step, of the ``BookKeeping`` that holds them (``host``: its ``model``,
    ``layout``, ``layers``, ``slots``, ``loss_fn``, per-example ``losses``, ``_backward``, ``_ordered`` and
    ``_rules_at``). Their state: the probes' secret randomness (``rng``, the OS CSPRNG) and the graph proofs'
    memo (``proofs``). The probe's steps are reached through the host's methods of the same names (``_own``,
    ``_alone``, ``_alone_in_float64``, ``_counterfactual``, ``_agree_in_float64``), which tests wrap."""

    def __init__(self, host) -> None:
        self.host = host
        self.rng = secrets.SystemRandom()  # the probes: unpredictable, from the OS CSPRNG
        self.proofs = proof.Proofs()
        self.scale: Callable | None = None  # the step's norm-scaling factors (``BookKeeping.__call__``)

    def check_graph(self, losses: Tensor, outs: dict, ins: dict) -> None:
        """The soundness check of every step, exact and structural: every trainable parameter enters
        the autograd graph of the losses exactly once, inside its own layer's forward (reachable from
        the layer's output without passing its input). Then the parameter's gradient is the
        layer-local ``g^T a`` the rules attribute, and per-layer norms are the per-example norms. A
        parameter read anywhere else (directly by the model, a second layer, a reparametrisation
        before the layer) would make them understate the sensitivity: refused. A tied weight
        (``self.host.ties``) enters once inside each of its layers and nowhere else. O(graph nodes)."""
        uses = _leaf_uses([losses.grad_fn], stop=set())
        users: dict[int, int] = {}  # the layers holding each parameter now (a fully_shard model's are swapped in)
        for m in self.host.layers:
            for p in _trainable(m):
                users[id(p)] = users.get(id(p), 0) + 1
        for m, slots in zip(self.host.layers, self.host.slots):
            local = _leaf_uses([outs[m].grad_fn], stop={ins[m]} if ins[m] is not None else set())
            for p in _trainable(m):  # a tied weight: once inside each of its layers (self.host.ties), nowhere else
                if uses.get(id(p), 0) != users[id(p)] or local.get(id(p), 0) != 1:
                    name = self.host.layout.names[slots[_trainable(m).index(p)]]
                    raise PathRefusal(
                        "fast", f"`grad_path='fast'`: parameter '{name}' enters the forward pass {uses.get(id(p), 0)} "
                        f"time(s), {local.get(id(p), 0)} of them inside its {type(m).__name__} layer: a use "
                        f"outside its layer's forward (read directly by the model, say) would make per-layer "
                        f"norms understate the per-example norms. Use `grad_path='rows'`")

    def check_layers(self, acts: dict, outs: dict, b: int) -> None:
        missing = [m for m in self.host.layers if m not in outs]
        if missing:
            raise PathRefusal("fast", f"`grad_path='fast'`: the {type(missing[0]).__name__} layer holding trainable "
                              f"parameters did not run in the forward pass; use `grad_path='rows'`")
        bad = [m for m in self.host.layers if acts[m].shape[:1] != (b,) or outs[m].shape[:1] != (b,)]
        if bad:  # tokens folded into the batch, a sequence-first layout, a batch-shared input
            raise PathRefusal("fast", f"`grad_path='fast'`: a {type(bad[0]).__name__} layer sees a first dimension of "
                              f"{acts[bad[0]].shape[0]}, not the batch of {b}: its rows are not one per "
                              f"example, so per-layer norms would not be per-example norms. Use `grad_path='rows'`")
        unbatched = [m for m in self.host.layers if acts[m].dim() != _batched_dims(m, acts[m].dim())]
        if unbatched:  # e.g. a Conv1d given [b, L]: the batch read as one example's channels
            m = unbatched[0]
            raise ConfigError(f"grad_path=\"fast\": a {type(m).__name__} layer receives a {acts[m].dim()}-D input, "
                              f"which it reads as one example without a batch dimension: its rows are not one per "
                              f"example. Give it a {_batched_dims(m, 0)}-D input, or use grad_path=\"rows\"")

    @contextlib.contextmanager
    def graph_watch(self, x: Batch, y: Batch):
        """Records the step's forward for the graph proof (``grads.proof``), its loss too where that is one
        plain call (cross-entropy, a ``per_example`` loss or one found to return per-example losses), and
        yields the program; yields None where the proof is not tried: a model per-example by its structure
        (``grads.separable``: no probe either way), a model that is itself a trainable layer, a 16-bit
        forward (autocast: the probe's float64 comparison also bounds the 16-bit rounding), or after
        ``proof.GIVE_UP`` steps in a row not proven (retried every ``proof.RETRY`` steps)."""
        host = self.host
        if not proof.ENABLED or host.model in host.layers or precision.active_mixed() is not None \
                or separable.why_not(host.model) is None or not self.proofs.recording():
            yield None
            return
        cover = host.loss_fn is cross_entropy or getattr(host.loss_fn, "per_example", False) or \
            host.losses.vector is True
        labels = batch.leaves(y) if cover else []
        with proof.watch(host.model, host.layers, batch.size(x), labels, until_loss=cover) as prog:
            if cover:  # the recording ends with the losses (the backward is not recorded)
                host.losses.observer = prog.end
            try:
                yield prog
            finally:
                host.losses.observer = None

    def graph_proven(self, program: proof.Program | None, x: Batch, y: Batch, own_loss: bool) -> bool:
        """Whether the step's recorded program proves that no operation lets examples see each other (then the
        probe is skipped): the loss recorded with it, or one example's at a time by construction
        (``own_loss``); the labels plain tensors (a subclass's ``__torch_function__`` would run inside the
        loss). A step whose forward drew random numbers gets here only where they were the engine's keyed
        dropout (``BookKeeping._rules``; the proof takes each mask as the batch's, one row per example)."""
        if program is None:
            return False
        if not all(type(t) is Tensor for t in batch.leaves(y)):
            self.proofs.refuse("the labels are a tensor subclass")
            return False
        if program.losses is None and not own_loss:
            self.proofs.refuse("the loss returns per-example losses that were not recorded (its first step)")
            return False
        return self.proofs.proven(program, lambda: self.record_alone(x, y, program))

    def record_alone(self, x: Batch, y: Batch, step: proof.Program) -> proof.Program:
        """The first example's forward (and loss, where the step's was recorded) as a batch of one, recorded: the
        program the probe would run for it, which the proof compares with the batch's."""
        taken: dict = {}  # a tensor both input and label (a language model's ids) taken once, as in the step
        xi, yi = (batch.tree_map(lambda t: taken.setdefault(id(t), t[:1]), v) for v in (x, y))
        loss = step.losses is not None
        with proof.watch(self.host.model, self.host.layers, 1, batch.leaves(yi) if loss else [], until_loss=loss,
                         shared=step.shared) as prog, \
                torch.enable_grad(), precision.forward_autocast(), forward.only(0):
            try:  # (in the engine's step: the first example's own keyed masks, under the step's call numbers)
                with forward.one_pass():
                    out = batch.call(self.host.model, xi)
                    if loss:
                        prog.end(self.host.losses(out, yi, 1))
            except Exception as err:  # noqa: BLE001  (a model that cannot run one example alone: the probe decides)
                prog.why = f"the model cannot run one example alone: {type(err).__name__}: {err}"
        return prog

    def check_examples(self, rules: list, sq: Tensor, x: Batch, y: Batch, params: list, rng: tuple | None) -> None:
        """Every step, secret random examples' gradients as the per-layer rules attribute them must
        equal their own gradients (to 1e-4). A deterministic forward: ``PROBES`` examples, each run
        through the model alone (``_own``), and one secret random combination of their gradients is
        compared (``_probe_weights``). A forward that draws random numbers
        (dropout; ``rng`` is the state before it): one secret random example. In the engine's step (masks
        keyed per example) it is run alone, a batch of one under its own masks (``_alone``: 1/b of the
        step's forward and backward), and its attribution must equal that gradient, its own by definition,
        in float32 or else in float64 (``_alone_in_float64``: float32 kernels round a batch of one and a
        batch of b apart). A row that depends on the batch's size or on its position in it differs alone.
        Outside the engine's step (torch's generator, which draws by batch position) its attribution is
        recomputed in a counterfactual batch where every other row is a copy of it, with the same random
        draws, and must equal that. A model whose rows see other examples' data (batch
        statistics, mixup, cross-example attention, a sequence-first layout) changes the probes'
        gradients. A mixing confined to a few examples is caught with probability (examples probed)
        x (examples affected) / b per step (docs/results.md)."""
        b = batch.size(x)
        if rng is not None and forward.active() is not None:  # the engine's step: masks keyed per example
            # one example alone; ``PROBES`` on a proven step's secret spot probe (``proof.SPOT``), which meets a
            # model that leaks only where it expects no probe: there a leak into a few rows is caught more often
            for i in self.rng.sample(range(b), min(PROBES if self.proofs.spotted else 1, b)):
                mine = self.host._ordered([r.one(i) for r in rules])
                if not (_close(mine, self.host._alone(x, y, i), params, 1e-4) or self.host._alone_in_float64(x, y, i, mine)):
                    raise PathRefusal("fast", _MIXING.format(i=i, alone="run alone under its own dropout masks"))
            return
        if rng is not None:
            i = self.rng.randrange(b)
            mine = self.host._ordered([r.one(i) for r in rules])
            if not _close(mine, self.host._counterfactual(x, y, i, rng), params, 1e-4):  # torch's generator: copies
                raise PathRefusal("fast", _MIXING.format(i=i, alone="among copies of itself"))
            return
        probes = self.rng.sample(range(b), min(PROBES, b))
        w, scale = self.probe_weights(sq, probes)
        fast = self.host._ordered([r.combo(probes, w) for r in rules])
        if precision.active_mixed() is not None:  # a 16-bit forward: a batch and one example alone round apart by
            agree = self.host._agree_in_float64(x, y, probes, w, fast)  # ~2^-8, so the float64 recheck decides at once
        else:
            agree = _close(fast, self.host._own(x, y, probes, params, w), params, 1e-4, scale) or \
                self.host._agree_in_float64(x, y, probes, w, fast)
        if not agree:
            raise PathRefusal("fast", _MIXING.format(i=", ".join(map(str, probes)), alone="each run alone")
                              + (_MIXED_HINT if precision.active_mixed() is not None else ""))

    def probe_weights(self, sq: Tensor, probes: list[int]) -> tuple[list[float], float]:
        """The probes' secret weights ``w_k = u_k / ||g_k||`` (``u_k`` uniform in [1, 2] from the OS
        CSPRNG, ``||g_k||`` the attributed norm, from the rules' summed squares ``sq``) and the comparison's scale ``sum_k w_k ||g_k||``.
        Each probe enters at unit size, so a mismatch of one example is measured relative to its own
        gradient (at most 8x more loosely than comparing it alone), whatever the others' sizes; the
        weights are secret and continuous, so mismatches of several examples cannot be arranged to
        cancel. Norms below ``MIN_PROBE_NORM`` count as that (the weight stays finite in float32 and
        the loss it scales does not overflow; such an example's gradient moves no sum)."""
        norms = _attributed_norms(sq, probes)
        w = [(1.0 + self.rng.random()) / max(nk, MIN_PROBE_NORM) for nk in norms]
        return w, sum(wk * nk for wk, nk in zip(w, norms))

    def own(self, x: Batch, y: Batch, probes: list[int], params: list, w: list[float],
             call: Callable | None = None) -> list[Tensor]:
        """``sum_k w_k grad L_k``, per parameter, with every probe run through the model alone (a batch
        of one), all of them in one vectorised forward (``vmap`` over the probes, the model seeing
        batches of one) and one backward. Not as one batch of the probes: a model whose rows depend on
        a few examples of the batch (every row shifted when it holds a canary, a statistic of its
        largest input) computes the same rows in any sub-batch that holds those examples, and with
        ``PROBES`` of b examples probed it passed 4 steps in b (4 in 5 at b = 5) with the clipped sum
        moved by up to 7.6 C. Where the model cannot run under ``vmap`` (data-dependent Python
        control flow, an op without a batching rule) the probes run one at a time. A forward that
        unwraps ``vmap``'s batched tensor (private functorch API) sees the other probes, as in one
        batch of them; it is no stronger than a forward that keeps a batch statistic in a Python
        attribute for the probe's forward, which no probe catches. ``call`` runs the model (default:
        itself)."""
        dev, call = params[0].device, call or self.host.model
        idx = torch.tensor(probes, device=dev)
        xs, ys = batch.take(x, idx), batch.take(y, idx)
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), torch.enable_grad():
            try:
                out = torch.vmap(lambda xi: batch.call(call, batch.unsqueeze(xi)))(xs)
                out = batch.tree_map(lambda t: t.flatten(0, 1), out)  # [k, 1, ...] -> [k, ...]
                losses = self.host.losses(out, ys, len(probes))
            except Exception:  # no vmap for this forward (a RuntimeError), or an output vmap cannot return
                # (a ValueError: e.g. a dict subclass such as Hugging Face's ModelOutput): the probes one at a
                # time, where a real error of the model surfaces again
                losses = torch.cat([self.host.losses(batch.call(call, batch.take(xs, slice(k, k + 1))),
                                                 batch.take(ys, slice(k, k + 1)), 1) for k in range(len(probes))])
            weights = torch.tensor(w, dtype=losses.dtype, device=losses.device)
            grads = torch.autograd.grad((losses * weights).sum(), params, allow_unused=True)
        return [g if g is not None else torch.zeros_like(p) for g, p in zip(grads, params)]

    def agree_in_float64(self, x: Batch, y: Batch, probes: list[int], w: list[float],
                          attributed32: list[Tensor]) -> bool:
        """The probes' combined attribution in the batch and their combined gradient with each
        run alone, both recomputed in float64 (the model's parameters, buffers and floating inputs
        widened; the model itself unchanged), agree to 1e-4, and the float32 attribution
        ``attributed32`` is within 5e-2 of the float64 one. Decides a float32 mismatch: an
        ill-conditioned example (a GroupNorm group of nearly equal values, a ReLU at its kink) can
        make two float32 computations of the same gradient differ by 1e-3 (up to 6e-3 seen on
        resnet20-gn trained on Fashion-MNIST), while float64 rounding is ~1e-12 of that and a real
        mixing of examples stays. The second condition catches a model that mixes examples in
        float32 only, as far as 5e-2 of the gradient; below that such a model, written to evade the
        check, passes (docs/results.md); under autocast the 16-bit attribution is compared at
        ``MIXED_RTOL``. False when the model cannot run in float64 (the float32 mismatch then stands)."""
        call, leaves, xw = self.widened(x)
        try:
            _, acts, grads = self.host._backward(xw, y, call=call, check_graph=False)
            rules = self.host._rules_at(acts, grads)
            attributed = self.host._ordered([r.combo(probes, w) for r in rules])
            together = self.host._own(xw, y, probes, leaves, w, call=call)
        except (RuntimeError, ConfigError):  # an op without float64 support, a dtype clash inside the model
            return False
        scale = sum(wk * nk for wk, nk in zip(w, _attributed_norms(sum(r.sq for r in rules), probes)))
        return _close(attributed, together, leaves, 1e-4, scale) and _close(
            [t.to(a.dtype) for t, a in zip(attributed32, attributed)], attributed, leaves,
            MIXED_RTOL if precision.active_mixed() is not None else 5e-2)

    def widened(self, x: Batch) -> tuple[Callable, list[Tensor], Batch]:
        """The model's float64 twin for a recheck: a call running the model on its parameters and buffers
        widened to float64 (the model itself unchanged), those parameters as gradient leaves in layout
        order, and ``x`` with its floating tensors widened."""
        wide = {n: t.detach().double() if t.is_floating_point() else t
                for n, t in [*self.host.model.named_parameters(), *self.host.model.named_buffers()]}
        leaves = [wide[n].requires_grad_() for n in self.host.layout.names]

        def call(*args, **kwargs):
            return torch.func.functional_call(self.host.model, wide, args, kwargs)
        return call, leaves, batch.tree_map(lambda t: t.double() if t.is_floating_point() else t, x)

    def alone(self, x: Batch, y: Batch, i: int, call: Callable | None = None) -> list[Tensor]:
        """Example i's gradient with the example alone, a batch of one, under the keyed masks it draws in the
        step (``forward.only``: the masks are functions of the key, the step, the call and the example's
        index, laid out by the per-example shape, so the same as its row's in the batch). A model that
        cannot run one example alone is refused (under ``grad_path="auto"`` the rows path takes it)."""
        xi, yi = (batch.take(v, slice(i, i + 1)) for v in (x, y))
        try:
            with forward.only(i):
                _, acts, grads = self.host._backward(xi, yi, call=call, check_graph=call is None)
        except PathRefusal:
            raise
        except Exception as err:  # the model's own error on a batch of one (e.g. an output squeezed to a scalar)
            raise PathRefusal("fast", f"`grad_path='fast'`: the model cannot compute one example alone (a batch of "
                              f"one), which the fast path's check of each step needs: {type(err).__name__}: "
                              f"{err}. Use `grad_path='rows'`") from err
        return self.host._ordered([r.one(0) for r in self.host._rules_at(acts, grads)])

    def alone_in_float64(self, x: Batch, y: Batch, i: int, attributed32: list[Tensor]) -> bool:
        """Under dropout in the engine's step: example i's attribution in the batch and its gradient alone,
        both recomputed in float64 under the same keyed masks, agree to 1e-4, and the float32 attribution
        lies within 5e-2 of the float64 one (``MIXED_RTOL`` under autocast), as ``_agree_in_float64`` decides
        for a deterministic forward. A row that depends on the batch's size or on its position in the batch
        differs alone in float64 as in float32: refused. False when the model cannot run in float64."""
        call, leaves, xw = self.widened(x)
        try:
            _, acts, grads = self.host._backward(xw, y, call=call, check_graph=False)
            attributed = self.host._ordered([r.one(i) for r in self.host._rules_at(acts, grads)])
            alone = self.host._alone(xw, y, i, call=call)
        except (RuntimeError, ConfigError):  # an op without float64 support, a dtype clash inside the model
            return False
        # the float32 attribution within 5e-2 of the float64 one, relative to that gradient or, for an example whose
        # gradient is far below the clip (a saturated softmax's 1e-14, where float32 is 59 % off: an honest model
        # was refused), to ``FLOOR`` C: a model that mixed only in float32 would move a row by < 5e-2 FLOOR C
        return _close(attributed, alone, leaves, 1e-4) and _close(
            [t.to(a.dtype) for t, a in zip(attributed32, attributed)], attributed, leaves,
            MIXED_RTOL if precision.active_mixed() is not None else 5e-2, FLOOR * self.bound(leaves[0].device))

    def bound(self, device: torch.device) -> float:
        """The step's per-example bound, C for a clip (``n f(n)`` at a huge norm ``n``, ``f`` the stage's scaling
        factors); 0 where that is not a finite positive number (then the comparisons are relative only)."""
        try:
            c = float(self.scale(torch.tensor([1e30], dtype=torch.float64, device=device))[0]) * 1e30
        except Exception:  # noqa: BLE001  (no scale, or one that takes no such norm: relative comparisons only)
            return 0.0
        return c if math.isfinite(c) and 0 < c < 1e20 else 0.0

    def counterfactual(self, x: Batch, y: Batch, i: int, rng: tuple) -> list[Tensor]:
        """Example i's attributed gradient in the batch whose every row is example i, under the
        random draws of the real step: in the engine's step every row draws example i's keyed masks
        (``forward.same_example``), elsewhere torch's generator is restored from ``rng`` (and continues
        as before)."""
        xi, yi = (batch.tree_map(lambda t: t[i:i + 1].expand_as(t).contiguous(), v) for v in (x, y))
        if forward.active() is not None:
            with forward.same_example(i):
                _, acts, grads = self.host._backward(xi, yi)
            return self.host._ordered([r.one(i) for r in self.host._rules_at(acts, grads)])
        dev = self.host.layout.params(self.host.model)[0].device
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            _set_rng(rng, dev)
            _, acts, grads = self.host._backward(xi, yi)
        return self.host._ordered([r.one(i) for r in self.host._rules_at(acts, grads)])


def _attributed_norms(sq: Tensor, probes: list[int]) -> list[float]:
    """The probes' attributed gradient norms from the rules' summed squared norms ``sq`` (bounds for ghost layers)."""
    return torch.sqrt(sq[torch.tensor(probes, device=sq.device)]).tolist()


def _set_rng(state: tuple, device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state[1], device)


def _leaf_uses(roots: list, stop: set) -> dict[int, int]:
    """``{id(parameter): number of graph edges into it}`` below ``roots``, not passing ``stop``."""
    uses: dict[int, int] = {}
    seen, stack = set(), [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node in seen or node in stop:
            continue
        seen.add(node)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if hasattr(nxt, "variable"):  # AccumulateGrad: a leaf tensor (a parameter)
                uses[id(nxt.variable)] = uses.get(id(nxt.variable), 0) + 1
            else:
                stack.append(nxt)
    return uses


def _close(got: list[Tensor], want: tuple, params: list, rtol: float, scale: float = 0.0) -> bool:
    """``||got - want|| <= rtol max(||want||, scale) + 1e-30`` over all parameters (``want``'s None: no gradient),
    parameter by parameter: no concatenated copy. Relative: an absolute slack (it was 1e-7) let a
    model that mixes every example through when its gradients were ~1e-9, with the clip at that
    scale (one example moved the sum by 1.40 C)."""
    diffs, refs = [], []
    for g, t, p in zip(got, want, params):
        t = t.reshape(-1) if t is not None else torch.zeros(p.numel(), dtype=g.dtype, device=g.device)
        d = (g - t).reshape(1, -1)
        # an exact match counts 0 (row_norms' bound adds ~1e-19, which failed a gradient of exactly 0: an example
        # dropped out whole); float32 blocks, float64 combination: a float64 vector_norm is 20x slower (GPT probes)
        diffs.append(torch.where(d.any(), row_norms(d)[0], 0.0))
        refs.append(row_norms(t.reshape(1, -1))[0])
    diff, ref = torch.linalg.vector_norm(torch.stack(diffs + refs).view(2, -1), dim=1).tolist()  # one sync
    # finite both: an infinite own gradient made inf <= 1e-4 inf true, and a model that mixes examples
    # through a factor b / (b - 1) (infinite for the probe's batch of one) passed
    return math.isfinite(diff) and math.isfinite(ref) and diff <= rtol * max(ref, scale) + 1e-30
