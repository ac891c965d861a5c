"""D1: random draws the keyed forward does not intercept.  Every aten op whose schema takes a Generator is
listed, called inside a private step's forward (rows path and fast path) through its Python binding, with a
generator object of the model's own (public seed, position-assigned draws), and we record whether the step is
refused.  An op that is not refused draws public randomness by batch position in a certified run."""
import os, sys, warnings
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
import torch
from torch import nn
from clipbias.config import AlgoConfig
from clipbias.engine import DPEngine
from clipbias.errors import ConfigError

G = lambda: torch.Generator().manual_seed(1234)   # the model's own generator: public seed
CASES = {
    "torch.rand(generator=)": lambda h: h * torch.rand(h.shape, generator=G()),
    "Tensor.bernoulli_(generator=)": lambda h: h * torch.empty_like(h).bernoulli_(0.5, generator=G()),
    "stochastic depth (empty().bernoulli_)": lambda h: h * torch.empty(h.shape[0], 1).bernoulli_(0.8) / 0.8,
    "torch.ops.aten.bernoulli.p(generator=)": lambda h: h * torch.ops.aten.bernoulli.p(h, 0.5, generator=G()),
    "torch.ops.aten.rand (global gen)": lambda h: h * torch.ops.aten.rand.default(list(h.shape)),
    "torch._C._nn.rrelu_with_noise(generator=)": lambda h: torch._C._nn.rrelu_with_noise(h, torch.empty_like(h), 0.1, 0.3, True, G()),
    "torch.distributions.Normal.rsample": lambda h: h + torch.distributions.Normal(0.0, 1.0).rsample(h.shape),
    "F.dropout in an autograd.Function": None,  # filled below
    "torch.ops.aten.native_dropout": lambda h: torch.ops.aten.native_dropout.default(h, 0.5, True)[0],
    "F.dropout under torch._C.DisableTorchFunction": None,
    "numpy default_rng (documented as unseen)": None,
}


class DropFn(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(h):
        return nn.functional.dropout(h, 0.5, True)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output)

    @staticmethod
    def backward(ctx, g):
        h, out = ctx.saved_tensors
        return g * (out != 0).to(g.dtype) * 2


CASES["F.dropout in an autograd.Function"] = lambda h: DropFn.apply(h)


def _disabled(h):
    with torch._C.DisableTorchFunction():
        return torch.bernoulli(torch.full_like(h, 0.5), generator=G()) * h


CASES["F.dropout under torch._C.DisableTorchFunction"] = _disabled
import numpy as np
RNG = np.random.default_rng(0)
CASES["numpy default_rng (documented as unseen)"] = lambda h: h * torch.from_numpy(RNG.random(tuple(h.shape)) < 0.5).float()


class Net(nn.Module):
    def __init__(self, f):
        super().__init__()
        self.a, self.b, self.f = nn.Linear(4, 8), nn.Linear(8, 2), f

    def forward(self, x):
        return self.b(self.f(self.a(x)))


x, y = torch.randn(32, 4), torch.randint(0, 2, (32,))
for name, f in CASES.items():
    res = []
    for path in ("rows", "fast"):
        torch.manual_seed(0)
        eng = DPEngine(Net(f), "dpsgd", n=32, batch_size=8, steps=2, noise_multiplier=1.0,
                       config=AlgoConfig(lr=0.1), grad_path=path if path == "rows" else "auto")
        if path == "fast":  # force the book-keeping path where the model allows it
            try:
                eng = DPEngine(Net(f), "dpsgd", n=32, batch_size=8, steps=2, noise_multiplier=1.0,
                               config=AlgoConfig(lr=0.1), grad_path="fast")
            except ConfigError as e:
                res.append("fast n/a"); continue
        idx = eng.sampler.sample()
        while len(idx) == 0:
            eng.sampler.settle(); idx = eng.sampler.sample()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                eng.step(x[idx], y[idx], idx)
            res.append(f"{path}: NOT refused, certified={eng.privacy().certified}")
        except ConfigError as e:
            res.append(f"{path}: refused [{str(e)[:90]}]")
        except Exception as e:
            res.append(f"{path}: error {type(e).__name__}: {str(e)[:50]}")
    print(f"{name:48s} " + " | ".join(res))
