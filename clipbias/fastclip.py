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
example i's, since no module mixes examples: ``check_model``). Supported: ``nn.Linear`` (any input
rank), ``nn.Conv1d``/``nn.Conv2d`` (``groups=1``, zero padding), weights and biases; ``nn.Embedding``
(the per-example gradient's nonzero rows are example i's output gradients summed per distinct token:
norm and sum from those, ``O(L d)`` per example; ``padding_idx`` rows get no gradient;
``max_norm``, ``scale_grad_by_freq`` and ``sparse`` are refused); and the affine parameters of
``nn.GroupNorm`` and ``nn.LayerNorm`` (per-example gradients computed directly from the normalised
input: one value per channel or feature). Any other trainable parameter makes ``why_unsupported``
say why, and the engine keeps the rows path. Dropout draws one mask per batch here instead of per
example: the same distribution.

Soundness guards (per-layer norms must never understate a per-example norm, or the sensitivity is
wrong): tied parameters, parameters other than a layer's own ``weight``/``bias`` and subclasses that
override a supported layer's ``forward`` are refused when the engine is built; at every step, before
any state changes, a layer that runs twice in one forward pass, a trainable layer that does not run,
or a layer whose first dimension is not the batch is refused; every trainable parameter must enter the
autograd graph exactly once, inside its own layer's forward (an exact, structural check: a parameter
read outside its layer is refused); and one secret random example's attributed gradient must equal
its own gradient (the model run on that example alone, as the rows path computes it; when that
differs, e.g. under dropout, its gradient through the batch graph): a layer whose rows are not one
per example in batch order is refused."""

from __future__ import annotations

import secrets
from typing import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .errors import ConfigError
from .grads import LossFn, ParamLayout, check_model, cross_entropy

_SUPPORTED = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.GroupNorm, nn.LayerNorm)
_NORMS = (nn.GroupNorm, nn.LayerNorm)
_CONV = (nn.Conv1d, nn.Conv2d)


def why_unsupported(model: nn.Module) -> str | None:
    """None when every trainable parameter belongs to a supported layer, else the reason."""
    owners: dict[int, str] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            if p.requires_grad and owners.setdefault(id(p), name) != name:
                # a tied parameter's per-example gradient is the sum of both uses: per-layer norms
                # would understate it (and with it the sensitivity)
                return f"parameter shared by modules '{owners[id(p)]}' and '{name}' (tied weights)"
    for name, m in model.named_modules():
        if not any(p.requires_grad for p in m.parameters(recurse=False)):
            continue
        if not isinstance(m, _SUPPORTED):
            return f"module '{name}' ({type(m).__name__}) has trainable parameters and no fast-path rule"
        base = next(c for c in _SUPPORTED if isinstance(m, c))
        if type(m).forward is not base.forward:  # the rules assume the layer's standard function
            return f"module '{name}' ({type(m).__name__}) overrides {base.__name__}.forward"
        own = {n for n, p in m.named_parameters(recurse=False) if p.requires_grad}
        if not own <= {"weight", "bias"}:  # e.g. weight_norm's weight_g / weight_v
            return f"module '{name}' ({type(m).__name__}) has parameters {sorted(own)} besides weight and bias"
        if isinstance(m, _CONV) and (m.groups != 1 or m.padding_mode != "zeros" or isinstance(m.padding, str)):
            return f"module '{name}' ({type(m).__name__}) uses groups, a non-zero padding mode or string padding"
        if isinstance(m, nn.Embedding) and (m.max_norm is not None or m.scale_grad_by_freq or m.sparse):
            return (f"module '{name}' (Embedding) uses max_norm (rewrites the weights in the forward pass), "
                    f"scale_grad_by_freq (scales by counts over the whole batch) or sparse gradients")
    return None


def _trainable(m: nn.Module) -> list[nn.Parameter]:
    """The layer's trainable parameters in the order the rules return them: weight, bias."""
    return [p for p in (getattr(m, "weight", None), getattr(m, "bias", None)) if p is not None and p.requires_grad]


class _Matrix:
    """Linear/Conv: example i's weight gradient is ``g_i^T a_i`` over its L positions (rows
    ``a [b, L, k]``, ``g [b, L, o]``); the squared norm by the cheaper of the ghost norm (``L^2``)
    and the per-example gradient (``o k``), kept for the sums when it is the one computed."""

    def __init__(self, m: nn.Module, a: Tensor, g: Tensor) -> None:
        b = g.shape[0]
        if isinstance(m, _CONV):
            if isinstance(m, nn.Conv1d):  # as a Conv2d of height 1
                a = F.unfold(a.unsqueeze(2), (1, *m.kernel_size), (1, *m.dilation), (0, *m.padding), (1, *m.stride))
            else:
                a = F.unfold(a, m.kernel_size, m.dilation, m.padding, m.stride)
            a, g = a.transpose(1, 2), g.flatten(2).transpose(1, 2)
        else:
            a, g = a.reshape(b, -1, a.shape[-1]), g.reshape(b, -1, g.shape[-1])
        self.a, self.g, self.pe = a, g, None
        L, k, o = a.shape[1], a.shape[2], g.shape[2]
        self.w, self.bias = m.weight.requires_grad, m.bias is not None and m.bias.requires_grad
        if L == 1:
            sq = a.square().sum((1, 2)) * g.square().sum((1, 2))
        elif L * L <= o * k:  # ghost norm: <a_i a_i^T, g_i g_i^T> over positions
            sq = (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum((1, 2))
        else:  # the per-example weight gradient is the smaller object: keep it for the sums
            self.pe = torch.bmm(g.transpose(1, 2), a)
            sq = self.pe.square().sum((1, 2))
        self.sq = (sq * self.w) + (g.sum(1).square().sum(1) if self.bias else 0)

    def sums(self, S: Tensor) -> list[Tensor]:
        """``[n, numel]`` per parameter: ``sum_i S[j, i] grad_i`` for every row j of ``S [n, b]``."""
        out = []
        if self.w:
            if self.pe is not None:
                out.append(S @ self.pe.flatten(1))
            else:
                b, L, k = self.a.shape
                gt = self.g.reshape(b * L, -1).t()
                out.append(torch.stack([(gt @ (self.a * s.view(-1, 1, 1)).reshape(b * L, k)).reshape(-1)
                                        for s in S]))
        if self.bias:
            out.append(S @ self.g.sum(1))
        return out

    def one(self, i: int) -> list[Tensor]:
        """Example i's gradient, one flat tensor per parameter."""
        return ([(self.g[i].t() @ self.a[i]).reshape(-1)] if self.w else []) + ([self.g[i].sum(0)] if self.bias else [])


class _Affine:
    """GroupNorm/LayerNorm: the per-example gradients of the affine weight and bias are small (one
    value per channel or normalised feature): computed directly from the normalised input."""

    def __init__(self, m: nn.Module, a: Tensor, g: Tensor) -> None:
        b = a.shape[0]
        if isinstance(m, nn.GroupNorm):
            xhat, dims = F.group_norm(a, m.num_groups, eps=m.eps), tuple(range(2, a.dim()))
        else:
            xhat = F.layer_norm(a, m.normalized_shape, eps=m.eps)
            dims = tuple(range(1, a.dim() - len(m.normalized_shape)))  # leading positions
        parts = []
        if m.weight is not None and m.weight.requires_grad:
            parts.append(((xhat * g).sum(dims) if dims else xhat * g).reshape(b, -1))
        if m.bias is not None and m.bias.requires_grad:
            parts.append((g.sum(dims) if dims else g).reshape(b, -1))
        self.rows = parts
        self.sq = sum(r.square().sum(1) for r in parts)

    def sums(self, S: Tensor) -> list[Tensor]:
        return [S @ r for r in self.rows]

    def one(self, i: int) -> list[Tensor]:
        return [r[i] for r in self.rows]


class _Embed:
    """Embedding: example i's weight gradient has one nonzero row per distinct token it holds (the
    sum of its output gradients at that token's positions): those rows give the norm and the sums."""

    def __init__(self, m: nn.Embedding, idx: Tensor, g: Tensor) -> None:
        b, v = g.shape[0], m.num_embeddings
        idx, g = idx.reshape(b, -1), g.reshape(b, idx[0].numel(), -1)
        if m.padding_idx is not None:  # the padding row gets no gradient
            g = g * (idx != m.padding_idx).unsqueeze(-1).to(g.dtype)
        key = (torch.arange(b, device=idx.device).unsqueeze(1) * v + idx).reshape(-1)
        uniq, inv = torch.unique(key, return_inverse=True)
        self.rows = g.new_zeros(len(uniq), g.shape[-1]).index_add_(0, inv, g.reshape(-1, g.shape[-1]))
        self.owner, self.token, self.shape = uniq // v, uniq % v, m.weight.shape
        self.sq = g.new_zeros(b).index_add_(0, self.owner, self.rows.square().sum(1))

    def _place(self, token: Tensor, rows: Tensor) -> Tensor:
        return rows.new_zeros(self.shape).index_add_(0, token, rows).reshape(-1)

    def sums(self, S: Tensor) -> list[Tensor]:
        return [torch.stack([self._place(self.token, self.rows * s[self.owner].unsqueeze(1)) for s in S])]

    def one(self, i: int) -> list[Tensor]:
        mine = self.owner == i
        return [self._place(self.token[mine], self.rows[mine])]


def _rule(m: nn.Module, a: Tensor, g: Tensor):
    return (_Affine if isinstance(m, _NORMS) else _Embed if isinstance(m, nn.Embedding) else _Matrix)(m, a, g)


class BookKeeping:
    """``(clipped sum, reference sum, losses, norms)`` of a batch for a norm-scaling stage."""

    def __init__(self, model: nn.Module, loss_fn: LossFn = cross_entropy) -> None:
        check_model(model)
        reason = why_unsupported(model)
        if reason is not None:
            raise ValueError(reason)
        self.model, self.loss_fn, self.layout = model, loss_fn, ParamLayout.of(model)
        self.layers = [m for m in model.modules() if isinstance(m, _SUPPORTED) and _trainable(m)]
        names = {id(p): n for n, p in model.named_parameters()}
        slot = {n: i for i, n in enumerate(self.layout.names)}
        self.slots = [[slot[names[id(p)]] for p in _trainable(m)] for m in self.layers]
        self._check_gen = torch.Generator().manual_seed(secrets.randbits(63))

    def __call__(self, x: Tensor, y: Tensor, scale: Callable[[Tensor], Tensor],
                 reference: bool) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        check_model(self.model)
        params = self.layout.params(self.model)
        losses, acts, grads = self._backward(x, y)
        rules = [_rule(m, acts[m], g) for m, g in zip(self.layers, grads)]
        norms = torch.sqrt(sum(r.sq for r in rules))
        if not bool(torch.isfinite(norms).all()):  # the caller refuses the step, naming the examples
            return torch.zeros(0), None, losses.detach(), norms
        self._check_example(rules, x, y, losses, params)
        S = torch.stack([scale(norms)] + ([torch.ones_like(norms)] if reference else []))
        pieces = [r.sums(S) for r in rules]
        proc = self._assemble([[t[0] for t in lp] for lp in pieces])
        ref = self._assemble([[t[1] for t in lp] for lp in pieces]) if reference else None
        return proc, ref, losses.detach(), norms

    def _losses(self, out: Tensor, y: Tensor) -> Tensor:
        return (F.cross_entropy(out, y, reduction="none") if self.loss_fn is cross_entropy else
                torch.vmap(lambda o, t: self.loss_fn(o.unsqueeze(0), t.unsqueeze(0)))(out, y))

    def _backward(self, x: Tensor, y: Tensor) -> tuple:
        """One forward and one backward of the summed loss, to the layer outputs only (no parameter
        gradients): the per-example losses (graph kept for the checks), every layer's input and
        output gradient. Refuses, before anything changes, a model the rules would misread."""
        acts: dict[nn.Module, Tensor] = {}
        outs: dict[nn.Module, Tensor] = {}
        ins: dict[nn.Module, object] = {}

        def hook(m: nn.Module, inp: tuple, out: Tensor) -> None:
            if m in acts:  # a layer used twice: its per-example gradient sums both uses
                raise ConfigError(f"--grad-path fast: a {type(m).__name__} layer runs twice in one forward "
                                  f"pass (shared weights); per-layer norms would understate the per-example "
                                  f"gradient. Use --grad-path rows")
            acts[m], outs[m], ins[m] = inp[0].detach(), out, inp[0].grad_fn

        handles = [m.register_forward_hook(hook) for m in self.layers]
        try:
            with torch.enable_grad():
                losses = self._losses(self.model(x), y)
                self._check_layers(acts, outs, len(x))
                self._check_graph(losses, outs, ins)
                grads = torch.autograd.grad(losses.sum(), [outs[m] for m in self.layers], retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        return losses, acts, list(grads)

    def _check_graph(self, losses: Tensor, outs: dict, ins: dict) -> None:
        """The soundness check of every step, exact and structural: every trainable parameter enters
        the autograd graph of the losses exactly once, inside its own layer's forward (reachable from
        the layer's output without passing its input). Then the parameter's gradient is the
        layer-local ``g^T a`` the rules attribute, and per-layer norms are the per-example norms. A
        parameter read anywhere else (directly by the model, a second layer, a reparametrisation
        before the layer) would make them understate the sensitivity: refused. O(graph nodes)."""
        uses = _leaf_uses([losses.grad_fn], stop=set())
        for m, slots in zip(self.layers, self.slots):
            local = _leaf_uses([outs[m].grad_fn], stop={ins[m]} if ins[m] is not None else set())
            for p in _trainable(m):
                if uses.get(id(p), 0) != 1 or local.get(id(p), 0) != 1:
                    name = self.layout.names[slots[_trainable(m).index(p)]]
                    raise ConfigError(
                        f"--grad-path fast: parameter '{name}' enters the forward pass {uses.get(id(p), 0)} "
                        f"time(s), {local.get(id(p), 0)} of them inside its {type(m).__name__} layer: a use "
                        f"outside its layer's forward (e.g. read directly by the model) would make per-layer "
                        f"norms understate the per-example norms. Use --grad-path rows")

    def _check_layers(self, acts: dict, outs: dict, b: int) -> None:
        missing = [m for m in self.layers if m not in outs]
        if missing:
            raise ConfigError(f"--grad-path fast: the {type(missing[0]).__name__} layer holding trainable "
                              f"parameters did not run in the forward pass; use --grad-path rows")
        bad = [m for m in self.layers if acts[m].shape[:1] != (b,) or outs[m].shape[:1] != (b,)]
        if bad:  # tokens folded into the batch, a sequence-first layout, a batch-shared input
            raise ConfigError(f"--grad-path fast: a {type(bad[0]).__name__} layer sees a first dimension of "
                              f"{acts[bad[0]].shape[0]}, not the batch of {b}: its rows are not one per "
                              f"example, so per-layer norms would not be per-example norms. Use --grad-path rows")

    def _assemble(self, per_layer: list[list[Tensor]]) -> Tensor:
        """Per-layer, per-parameter flat pieces concatenated in ``ParamLayout`` order."""
        return torch.cat(self._ordered(per_layer))

    def _ordered(self, per_layer: list[list[Tensor]]) -> list[Tensor]:
        parts: list[Tensor | None] = [None] * len(self.layout.names)
        for slots, pieces in zip(self.slots, per_layer):
            for s, t in zip(slots, pieces):
                parts[s] = t
        return parts

    def _check_example(self, rules: list, x: Tensor, y: Tensor, losses: Tensor, params: list) -> None:
        """Every step, one secret random example's gradient as the per-layer rules attribute it must
        equal its own gradient (to 1e-4 relative): first the model run on that example alone (what
        the rows path computes; costs 1/b of a step), and only if that differs (dropout draws other
        masks) its gradient through the batch graph (a second backward). A layer whose rows are not
        one per example in batch order (e.g. a sequence-first layout) mixes examples, which the
        summed check cannot see; a mixing confined to a few examples is caught with probability
        (examples affected) / b per step."""
        i = int(torch.randint(len(x), (1,), generator=self._check_gen))
        fast = self._ordered([r.one(i) for r in rules])
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []), torch.enable_grad():
            alone = torch.autograd.grad(self._losses(self.model(x[i:i + 1]), y[i:i + 1]).sum(), params,
                                        allow_unused=True)
        if _close(fast, alone, params, 1e-4):
            return
        with torch.enable_grad():
            through = torch.autograd.grad(losses[i], params, allow_unused=True)
        if not _close(fast, through, params, 1e-4):
            raise ConfigError(f"--grad-path fast: example {i}'s gradient as the per-layer rules attribute it differs "
                              f"from its true gradient: the model's layers do not see one row per example in batch "
                              f"order (e.g. a sequence-first layout). Use --grad-path rows")


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


def _close(got: list[Tensor], want: tuple, params: list, rtol: float) -> bool:
    """``||got - want|| <= rtol ||want|| + 1e-7`` over all parameters (``want``'s None: no gradient),
    parameter by parameter: no concatenated copy."""
    diff = ref = 0.0
    for g, t, p in zip(got, want, params):
        t = t.reshape(-1) if t is not None else torch.zeros(p.numel(), dtype=g.dtype, device=g.device)
        diff += float(torch.linalg.vector_norm(g - t)) ** 2
        ref += float(torch.linalg.vector_norm(t)) ** 2
    return diff ** 0.5 <= rtol * ref ** 0.5 + 1e-7
