"""D2: a mask drawn by `torch.ops.aten.bernoulli.p(..., generator=g)` with the model's own torch.Generator
(public seed) is neither refused by name (the mode's list holds torch.* / Tensor.* / F.* bindings, not aten
OpOverloads) nor after the fact (the global generators do not move).  On the rows path vmap hands example r of
the micro-batch row r of the draw: the mask goes by batch POSITION, the attack of docs/privacy.md
("Forward-pass randomness").  Measured: adding one example in front of n others moves the clipped sum by
far more than C.  Same key in both worlds (noise cancels)."""
import os, sys, warnings
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
import torch
from torch import nn
from clipbias.config import AlgoConfig
from clipbias.engine import DPEngine

n = 16


class Masked(nn.Module):
    def __init__(self, aten: bool):
        super().__init__()
        self.lin, self.aten = nn.Linear(n + 1, 1, bias=False), aten
        nn.init.zeros_(self.lin.weight)

    def forward(self, x):
        g = torch.Generator().manual_seed(99)   # the model's own generator
        if self.aten:
            m = torch.ops.aten.bernoulli.p(torch.ones(x.shape[0], 1), 0.5, generator=g)
        else:
            m = nn.functional.dropout(torch.ones(x.shape[0], 1), 0.5, True) * 0.5   # keyed dropout (control)
        return self.lin(x * m)


def released_sum(with_target: bool, aten: bool):
    # example j: e_j, index j; the target is example 0 (in front).  World D' is the same indexed dataset without
    # the target (its other examples keep their indices, as the keyed coupling requires): the batch without row 0
    x = torch.eye(n + 1)
    eng = DPEngine(Masked(aten), "dpsgd", n=len(x), batch_size=len(x), steps=1, noise_multiplier=1.0,
                   config=AlgoConfig(lr=1.0, clip=1.0, momentum=0.0), loss_fn=lambda o, y: o.sum(),
                   noise_seed=5, grad_path="rows")
    idx = eng.sampler.sample()
    if not with_target:
        idx = idx[1:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng.step(x[idx], torch.zeros(len(idx), dtype=torch.long), idx)
    w = eng.model.lin.weight.detach().reshape(-1)
    return -w * len(x), eng.privacy()  # (D' is measured off the sampler: only D's certification is read)


for aten in (False, True):
    a, rep = released_sum(True, aten)
    b, _ = released_sum(False, aten)
    d = (a - b)
    d[0] = 0  # the target's own contribution (<= C) aside: what moved is the others'
    label = "aten.bernoulli, own generator" if aten else "nn.functional.dropout (keyed, control)"
    print(f"{label:40s} others' clipped sum moved by {float(d.norm()):.3f} C (+ the target's own <= 1 C); "
          f"caveats besides the seed: {len(rep.caveats) - 1}")
