"""Public forwards clipped per row (``public_clip``): the gradient of a call on data the loader did not draw
(a DCGAN's generated batch), summed over its rows with each row's gradient clipped to the clipping norm, as the
private rows' are. It depends on no private example, so it costs no privacy either way; clipped, it keeps the
balance between a loss's private and public terms that clipping the private term alone upsets (the DCGAN's
``errD_real + errD_fake``: Opacus clips each position's two gradients together, which keeps it too; with the
public term exact, early training follows it: docs/results.md, "Opacus's own examples"). The rows' gradients
are computed again from the call's inputs (``torch.func``): a model that draws dropout in a public call gets
fresh masks there, so its clipped rows are those of another draw than the outputs the loop saw (public either
way)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..data import batch
from ..grads.rows import FuncGradients, output_gradient


def clipped_rows(model: nn.Module, inputs: Any, out_grads: Any, clip: float) -> list[Tensor]:
    """``(1 / m) sum_j clip(m g_j, clip)`` for the ``m`` rows of one public call: ``g_j`` row j's gradient of the
    loop's loss (``J_j^T`` times the gradient the loop's backward left in row j's outputs), times ``m`` as the
    private rows' (``loss_reduction="mean"``: each row's gradient of its own loss), clipped, and divided by ``m``
    again, so that where no row is clipped it is the call's exact gradient. One tensor per trainable parameter,
    in ``ParamLayout`` order. ``inputs`` as the model was called (a tensor, a tuple, a dict); ``out_grads`` one
    tensor per floating output, one row per input row."""
    m = batch.size(inputs)
    grads = FuncGradients(model, output_gradient, check=False)
    rows, _ = grads.per_param(inputs, batch.tree_map(lambda g: g * m, out_grads))
    norms = torch.sqrt(sum(r.reshape(m, -1).double().pow(2).sum(1) for r in rows))
    scale = (clip / norms.clamp_min(1e-30)).clamp(max=1.0).to(rows[0].dtype) / m
    return [torch.einsum("m,m...->...", scale.to(r.dtype), r) for r in rows]
