"""A loss_fn returning the batch's total is evaluated one example at a time under ``torch.vmap`` and the
probe is skipped; but
  1. to learn that it returns a total, the first step called it once on the whole batch's output, and
     what it registered there ran in that step's backward: ``out.register_hook(lambda g: g / g.norm())``
     (normalising the logits' gradient) divided every example's gradient by the batch's norm;
  2. saved-tensor hooks entered inside the loss run in the backward outside vmap, on the whole batch's
     tensors: an unpack adding the batch mean to a saved tensor mixed every step (the forward's own
     saved-tensor hooks were already refused; the loss's were not seen).
With the weaker check the probe was skipped and one example moved the clipped sum by more than C.
Now the first call sees copies off the step's graph, and saved-tensor hooks are disabled inside the
vmapped loss (a loss that enters them is evaluated with them, and the step is probed)."""
import torch
from torch.nn import functional as F
from _measure import engine, report
from clipbias.models import build_model

torch.manual_seed(0)
x, y = torch.randn(8, 1, 6, 6), torch.randint(0, 10, (8,))
x[0] *= 50


def model():
    torch.manual_seed(1)
    return build_model("mlp", (1, 6, 6), 10)


def normalised_logit_grad(out, t):
    if out.requires_grad:
        out.register_hook(lambda g: g / g.norm())
    return F.cross_entropy(out, t, reduction="sum")


report("1. register_hook in a summed loss", engine(model(), "fast", loss_fn=normalised_logit_grad), x, y)


def unpack_mixing(t):
    return t + 10 * t.mean(0) if t.is_floating_point() and t.dim() >= 1 and t.shape[0] == len(x) else t


def hooked_loss(out, t):
    with torch.autograd.graph.saved_tensors_hooks(lambda s: s, unpack_mixing):
        return (3 * out.tanh()).pow(2).sum() + F.cross_entropy(out, t, reduction="sum")


report("2. saved-tensor hooks inside a summed loss", engine(model(), "fast", loss_fn=hooked_loss), x, y)
