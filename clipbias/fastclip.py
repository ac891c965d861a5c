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
rank), ``nn.Conv2d`` (``groups=1``, zero padding), weights and biases, and the affine parameters of
``nn.GroupNorm`` and ``nn.LayerNorm`` (per-example gradients computed directly from the normalised
input: one value per channel or feature). Any other trainable
parameter makes ``BookKeeping.supports`` false and the engine keeps the rows path (and says why).
Dropout draws one mask per batch here instead of per example: the same distribution.

Soundness guards (per-layer norms must never understate a per-example norm, or the sensitivity is
wrong): tied parameters are refused when the engine is built; a layer that runs twice in one forward
pass, or a trainable layer that does not run, is refused at the step; and every step checks that the
book-keeping sum of the per-example gradients equals autograd's batch gradient (a parameter read
outside its layer's forward breaks that equality), refusing before any state changes.
"""

from __future__ import annotations

import secrets
from typing import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .errors import ConfigError
from .grads import LossFn, ParamLayout, check_model, cross_entropy

_SUPPORTED = (nn.Linear, nn.Conv2d, nn.GroupNorm, nn.LayerNorm)
_NORMS = (nn.GroupNorm, nn.LayerNorm)


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
        own = [p for p in m.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        if not isinstance(m, _SUPPORTED):
            return f"module '{name}' ({type(m).__name__}) has trainable parameters and no fast-path rule"
        if isinstance(m, nn.Conv2d) and (m.groups != 1 or m.padding_mode != "zeros" or isinstance(m.padding, str)):
            return f"module '{name}' (Conv2d) uses groups, a non-zero padding mode or string padding"
    return None


class BookKeeping:
    """``(clipped sum, reference sum, losses, norms)`` of a batch for a norm-scaling stage."""

    def __init__(self, model: nn.Module, loss_fn: LossFn = cross_entropy) -> None:
        check_model(model)
        reason = why_unsupported(model)
        if reason is not None:
            raise ValueError(reason)
        self.model, self.loss_fn, self.layout = model, loss_fn, ParamLayout.of(model)
        self.layers = [m for m in model.modules() if isinstance(m, _SUPPORTED)
                       and any(p.requires_grad for p in m.parameters(recurse=False))]
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.slots = {self.names[id(p)]: i for i, p in enumerate(self.layout.params(model))}
        self._check_gen = torch.Generator().manual_seed(secrets.randbits(63))

    def __call__(self, x: Tensor, y: Tensor, scale: Callable[[Tensor], Tensor],
                 reference: bool) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
        check_model(self.model)
        acts: dict[nn.Module, Tensor] = {}
        outs: dict[nn.Module, Tensor] = {}

        def hook(m: nn.Module, inp: tuple, out: Tensor) -> None:
            if m in acts:  # a layer used twice: its per-example gradient sums both uses
                raise ConfigError(f"--grad-path fast: a {type(m).__name__} layer runs twice in one forward "
                                  f"pass (shared weights); per-layer norms would understate the per-example "
                                  f"gradient. Use --grad-path rows")
            acts[m], outs[m] = inp[0].detach(), out

        handles = [m.register_forward_hook(hook) for m in self.layers]
        params = self.layout.params(self.model)
        try:
            with torch.enable_grad():
                out = self.model(x)
                losses = (F.cross_entropy(out, y, reduction="none") if self.loss_fn is cross_entropy else
                          torch.vmap(lambda o, t: self.loss_fn(o.unsqueeze(0), t.unsqueeze(0)))(out, y))
                missing = [m for m in self.layers if m not in outs]
                if missing:
                    raise ConfigError(f"--grad-path fast: the {type(missing[0]).__name__} layer holding trainable "
                                      f"parameters did not run in the forward pass; use --grad-path rows")
                b = len(x)
                bad = [m for m in self.layers if acts[m].shape[:1] != (b,) or outs[m].shape[:1] != (b,)]
                if bad:  # tokens folded into the batch, a sequence-first layout, a batch-shared input
                    raise ConfigError(f"--grad-path fast: a {type(bad[0]).__name__} layer sees a first dimension of "
                                      f"{acts[bad[0]].shape[0]}, not the batch of {b}: its rows are not one per "
                                      f"example, so per-layer norms would not be per-example norms. Use --grad-path rows")
                # secret random weights: the check below compares sum_i w_i g_i, which gradients that
                # cancel over the batch, or rows that are not examples, cannot satisfy by construction
                w = 0.5 + torch.rand(b, generator=self._check_gen, dtype=losses.dtype).to(losses.device)
                found = torch.autograd.grad((losses * w).sum(), [outs[m] for m in self.layers] + params,
                                            allow_unused=True, retain_graph=True)
                # one secret random example's gradient by plain autograd: the attribution check below
                probe = int(torch.randint(b, (1,), generator=self._check_gen))
                alone = torch.autograd.grad(losses[probe], params, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        grads = [g / w.view(-1, *([1] * (g.dim() - 1))) for g in found[:len(self.layers)]]
        total = found[len(self.layers):]
        per_layer = [self._layer(m, acts[m], g) for m, g in zip(self.layers, grads)]
        norms = torch.sqrt(sum(sq for _, _, sq in per_layer))
        self._check_complete(self._sums(per_layer, w), total, params)
        self._check_example(self._sums(per_layer, torch.nn.functional.one_hot(torch.tensor(probe), b).to(w)),
                            alone, params, probe)
        proc = self._sums(per_layer, scale(norms))
        ref = self._sums(per_layer, torch.ones_like(norms)) if reference else None
        return proc, ref, losses.detach(), norms

    @staticmethod
    def _check_complete(weighted: Tensor, total: tuple, params: list) -> None:
        """The soundness check of every step: the book-keeping sum ``sum_i w_i g_i`` of the per-example
        gradients, for secret random weights w, must equal autograd's gradient of ``sum_i w_i loss_i``
        (to 1e-5 relative). A parameter also used outside its layer's forward (read directly by the
        model), rows that are not examples, or per-example gradients that cancel over the batch break
        it: per-layer norms would understate the per-example norms, and with them the sensitivity.
        Residual (docs/results.md): an outside use whose contribution is below the tolerance."""
        batch = torch.cat([(t if t is not None else torch.zeros_like(p)).reshape(-1) for t, p in zip(total, params)])
        if float((weighted - batch).norm()) > 1e-5 * float(batch.norm()) + 1e-7:
            raise ConfigError("--grad-path fast: the per-layer gradients do not add up to the model's gradient "
                              "(a parameter is used outside its layer's forward, e.g. read directly by the "
                              "model); per-layer norms would understate the per-example norms. Use --grad-path rows")

    @staticmethod
    def _check_example(fast: Tensor, alone: tuple, params: list, i: int) -> None:
        """Every step, one secret random example's gradient as the fast path attributes it must equal
        its gradient by plain autograd (to 1e-4 relative): a layer whose rows are not one per example
        in batch order (e.g. a sequence-first layout with as many positions as examples) mixes
        examples, which the summed checks cannot see. A mixing confined to a few examples is caught
        with probability (examples affected) / B per step."""
        true = torch.cat([(t if t is not None else torch.zeros_like(p)).reshape(-1) for t, p in zip(alone, params)])
        if float((fast - true).norm()) > 1e-4 * float(true.norm()) + 1e-7:
            raise ConfigError(f"--grad-path fast: example {i}'s gradient as the per-layer rules attribute it differs "
                              f"from its true gradient: the model's layers do not see one row per example in batch "
                              f"order (e.g. a sequence-first layout). Use --grad-path rows")

    def _layer(self, m: nn.Module, a: Tensor, g: Tensor) -> tuple[nn.Module, tuple, Tensor]:
        """(module, (activations [b, k, L], output grads [b, o, L], per-example weight gradients
        [b, o, k] or None), per-example squared norm [b])."""
        if isinstance(m, _NORMS):
            return self._affine(m, a, g)
        b = g.shape[0]
        if isinstance(m, nn.Conv2d):
            a = F.unfold(a, m.kernel_size, m.dilation, m.padding, m.stride)  # [b, k, L]
            g = g.flatten(2)                                                  # [b, o, L]
        else:
            a = a.reshape(b, -1, a.shape[-1]).transpose(1, 2)
            g = g.reshape(b, -1, g.shape[-1]).transpose(1, 2)
        k, L, o = a.shape[1], a.shape[2], g.shape[1]
        per_example = None
        if L == 1:
            sq = a.square().sum((1, 2)) * g.square().sum((1, 2))
        elif L * L <= o * k:  # ghost norm: <a_i^T a_i, g_i^T g_i> over positions
            sq = (torch.bmm(a.transpose(1, 2), a) * torch.bmm(g.transpose(1, 2), g)).sum((1, 2))
        else:  # the per-example weight gradient of this layer is the smaller object: keep it for the sum
            per_example = torch.bmm(g, a.transpose(1, 2))
            sq = per_example.square().sum((1, 2))
        if m.bias is not None and m.bias.requires_grad:
            sq = sq + g.sum(2).square().sum(1)
        return m, (a, g, per_example), sq

    @staticmethod
    def _affine(m: nn.Module, a: Tensor, g: Tensor) -> tuple[nn.Module, tuple, Tensor]:
        """GroupNorm/LayerNorm: the per-example gradients of the affine weight and bias are small
        (one value per channel or normalised feature): computed directly from the normalised input."""
        b = a.shape[0]
        if isinstance(m, nn.GroupNorm):
            xhat = F.group_norm(a, m.num_groups, eps=m.eps)
            dims = tuple(range(2, a.dim()))  # positions: per-channel sums
        else:
            xhat = F.layer_norm(a, m.normalized_shape, eps=m.eps)
            dims = tuple(range(1, a.dim() - len(m.normalized_shape)))  # leading positions
        gw = (xhat * g).sum(dims) if dims else xhat * g
        gb = g.sum(dims) if dims else g
        sq = gw.reshape(b, -1).square().sum(1) * bool(m.weight is not None and m.weight.requires_grad)
        if m.bias is not None and m.bias.requires_grad:
            sq = sq + gb.reshape(b, -1).square().sum(1)
        return m, ("affine", gw, gb), sq

    def _sums(self, per_layer: list, s: Tensor) -> Tensor:
        """``sum_i s_i g_i`` flattened in ``ParamLayout`` order."""
        parts: list[Tensor | None] = [None] * len(self.slots)
        for m, (a, g, per_example), _ in per_layer:
            if isinstance(a, str):  # GroupNorm/LayerNorm: per-example affine gradients
                if m.weight is not None and m.weight.requires_grad:
                    parts[self.slots[self.names[id(m.weight)]]] = torch.einsum("b,bf->f", s, g.reshape(len(s), -1))
                if m.bias is not None and m.bias.requires_grad:
                    parts[self.slots[self.names[id(m.bias)]]] = torch.einsum(
                        "b,bf->f", s, per_example.reshape(len(s), -1))
                continue
            if m.weight.requires_grad:
                w = (torch.einsum("b,bok->ok", s, per_example) if per_example is not None
                     else torch.einsum("bol,bkl->ok", g * s.view(-1, 1, 1), a))
                parts[self.slots[self.names[id(m.weight)]]] = w.reshape(-1)
            if m.bias is not None and m.bias.requires_grad:
                parts[self.slots[self.names[id(m.bias)]]] = torch.einsum("b,bo->o", s, g.sum(2))
        return torch.cat(parts)
