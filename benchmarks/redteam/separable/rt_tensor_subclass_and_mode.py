"""Two things outside the model's modules that rewrite what its layers compute:
  1. the batch given as a torch.Tensor subclass whose __torch_function__ centres F.linear's input on the
     batch mean (every op on it, inside the model, goes through it);
  2. a TorchFunctionMode doing the same, active around engine.fast (e.g. around engine.step).
Before the fix, separable proved both per-example and skipped the probe. Whether the probe (vmap over
batches of one) would have caught them is printed too (by forcing the probe: a loss_fn that is not the
default object)."""
import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from _measure import engine, report


class Centred(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x = args[0].as_subclass(torch.Tensor)
            args = (x - x.mean(0),) + tuple(args[1:])
        return super().__torch_function__(func, types, args, kwargs)


class CentreMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            args = (args[0] - args[0].mean(0),) + tuple(args[1:])
        return func(*args, **kwargs)


def per_example_ce(out, y):
    return F.cross_entropy(out, y, reduction="none")


torch.manual_seed(0)
x, y = torch.randn(8, 12), torch.randint(0, 10, (8,))
x[0] *= 50
model = nn.Sequential(nn.Linear(12, 10))
report("1. Centred tensor subclass as the batch", engine(model, "fast"), x.as_subclass(Centred), y)
report("1'. the same with the probe forced", engine(model, "fast", loss_fn=per_example_ce), x.as_subclass(Centred), y)
with CentreMode():
    report("2. a TorchFunctionMode around the step", engine(model, "fast"), x, y)
    report("2'. the same with the probe forced", engine(model, "fast", loss_fn=per_example_ce), x, y)
