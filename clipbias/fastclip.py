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
wrong): tied parameters are refused when the engine is built; a layer that runs twice in one forward
pass, or a trainable layer that does not run, is refused at the step; and every step checks that the
book-keeping sum of the per-example gradients, weighted by secret random weights, equals autograd's
batch gradient (a parameter read outside its layer's forward breaks that equality), and one secret
random example's attributed gradient equals its own gradient (the model run on that example alone,
as the rows path computes it; when that differs, e.g. under dropout, its gradient through the batch
graph), refusing before any state changes.
"""

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


def _flat(grads: tuple, params: list) -> Tensor:
    return torch.cat([(t if t is not None else torch.zeros_like(p)).reshape(-1) for t, p in zip(grads, params)])


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
        losses, acts, grads, total, w = self._backward(x, y, params)
        rules = [_rule(m, acts[m], g) for m, g in zip(self.layers, grads)]
        norms = torch.sqrt(sum(r.sq for r in rules))
        S = torch.stack([w, scale(norms)] + ([torch.ones_like(norms)] if reference else []))
        sums = self._assemble([r.sums(S) for r in rules], dim=1)
        self._check_complete(sums[0], _flat(total, params))
        self._check_example(rules, x, y, losses, params)
        return sums[1], (sums[2] if reference else None), losses.detach(), norms

    def _losses(self, out: Tensor, y: Tensor) -> Tensor:
        return (F.cross_entropy(out, y, reduction="none") if self.loss_fn is cross_entropy else
                torch.vmap(lambda o, t: self.loss_fn(o.unsqueeze(0), t.unsqueeze(0)))(out, y))

    def _backward(self, x: Tensor, y: Tensor, params: list) -> tuple:
        """One forward and one backward of ``sum_i w_i loss_i`` (w: secret random weights): the
        per-example losses (graph kept), every layer's input and output gradient divided by w,
        autograd's parameter gradients, and w."""
        acts: dict[nn.Module, Tensor] = {}
        outs: dict[nn.Module, Tensor] = {}

        def hook(m: nn.Module, inp: tuple, out: Tensor) -> None:
            if m in acts:  # a layer used twice: its per-example gradient sums both uses
                raise ConfigError(f"--grad-path fast: a {type(m).__name__} layer runs twice in one forward "
                                  f"pass (shared weights); per-layer norms would understate the per-example "
                                  f"gradient. Use --grad-path rows")
            acts[m], outs[m] = inp[0].detach(), out

        handles = [m.register_forward_hook(hook) for m in self.layers]
        try:
            with torch.enable_grad():
                losses = self._losses(self.model(x), y)
                self._check_layers(acts, outs, len(x))
                # secret random weights: the sum check cannot be met by gradients that cancel over
                # the batch or by rows that are not examples
                w = 0.5 + torch.rand(len(x), generator=self._check_gen, dtype=losses.dtype).to(losses.device)
                found = torch.autograd.grad((losses * w).sum(), [outs[m] for m in self.layers] + params,
                                            allow_unused=True, retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        grads = [g / w.view(-1, *([1] * (g.dim() - 1))) for g in found[:len(self.layers)]]
        return losses, acts, grads, found[len(self.layers):], w

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

    def _assemble(self, per_layer: list[list[Tensor]], dim: int = 0) -> Tensor:
        """Per-layer, per-parameter pieces concatenated in ``ParamLayout`` order."""
        parts: list[Tensor | None] = [None] * len(self.layout.names)
        for slots, pieces in zip(self.slots, per_layer):
            for s, t in zip(slots, pieces):
                parts[s] = t
        return torch.cat(parts, dim=dim)

    @staticmethod
    def _check_complete(weighted: Tensor, batch: Tensor) -> None:
        """The soundness check of every step: the book-keeping sum ``sum_i w_i g_i`` of the per-example
        gradients, for secret random weights w, must equal autograd's gradient of ``sum_i w_i loss_i``
        (to 1e-5 relative). A parameter also used outside its layer's forward (read directly by the
        model), rows that are not examples, or per-example gradients that cancel over the batch break
        it: per-layer norms would understate the per-example norms, and with them the sensitivity.
        Residual (docs/results.md): an outside use whose contribution is below the tolerance."""
        if float((weighted - batch).norm()) > 1e-5 * float(batch.norm()) + 1e-7:
            raise ConfigError("--grad-path fast: the per-layer gradients do not add up to the model's gradient "
                              "(a parameter is used outside its layer's forward, e.g. read directly by the "
                              "model); per-layer norms would understate the per-example norms. Use --grad-path rows")

    def _check_example(self, rules: list, x: Tensor, y: Tensor, losses: Tensor, params: list) -> None:
        """Every step, one secret random example's gradient as the per-layer rules attribute it must
        equal its own gradient (to 1e-4 relative): first the model run on that example alone (what
        the rows path computes; costs 1/b of a step), and only if that differs (dropout draws other
        masks) its gradient through the batch graph (a second backward). A layer whose rows are not
        one per example in batch order (e.g. a sequence-first layout) mixes examples, which the
        summed check cannot see; a mixing confined to a few examples is caught with probability
        (examples affected) / b per step."""
        i = int(torch.randint(len(x), (1,), generator=self._check_gen))
        fast = self._assemble([r.one(i) for r in rules])
        with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []), torch.enable_grad():
            alone = _flat(torch.autograd.grad(self._losses(self.model(x[i:i + 1]), y[i:i + 1]).sum(), params,
                                              allow_unused=True), params)
        if _close(fast, alone):
            return
        with torch.enable_grad():
            through = _flat(torch.autograd.grad(losses[i], params, allow_unused=True), params)
        if not _close(fast, through):
            raise ConfigError(f"--grad-path fast: example {i}'s gradient as the per-layer rules attribute it differs "
                              f"from its true gradient: the model's layers do not see one row per example in batch "
                              f"order (e.g. a sequence-first layout). Use --grad-path rows")


def _close(a: Tensor, b: Tensor) -> bool:
    return float((a - b).norm()) <= 1e-4 * float(b.norm()) + 1e-7
