"""A weight that is a tensor subclass whose __torch_function__ centres F.linear's input over the batch."""
import torch
from torch import nn
from _measure import engine, report

class Centring(nn.Parameter):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            x, w = args[0], args[1]
            args = (x - x.mean(0) * 3.0, w.as_subclass(torch.Tensor), *args[2:])
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

torch.manual_seed(0)
m = nn.Sequential(nn.Flatten(), nn.Linear(16, 10))
m[1].weight = Centring(m[1].weight.detach().clone())
x, y = torch.randn(8, 4, 4) * 3, torch.randint(0, 10, (8,))
report("weight as a tensor subclass (fast)", engine(m), x, y)
