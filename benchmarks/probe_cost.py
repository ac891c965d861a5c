"""Cost of the fast path's soundness probe on the cnn (1x28x28, B = 256, 4 probes): the probes'
combined gradient with each example alone in one vmapped forward and one backward (what
`BookKeeping._own` does), as one batch of the 4 (cheaper, but a model whose rows depend on one
example of the batch reproduces them in any sub-batch holding it), and 4 batches of one in a loop.
Min and median of 100 interleaved repeats. Usage::

    PYTHONPATH=$PWD python benchmarks/probe_cost.py
"""

from __future__ import annotations

import time

import torch

from clipbias.models import build_model
from clipbias.grads.fast import BookKeeping
torch.manual_seed(0)
m = build_model("cnn", (1, 28, 28), 10)
bk = BookKeeping(m)
x, y = torch.randn(256, 1, 28, 28), torch.randint(0, 10, (256,))
params = bk.layout.params(m)
probes, w = [3, 77, 150, 201], [0.3, 0.5, 0.7, 0.9]


def vmapped():
    return bk._own(x, y, probes, params, w)


def one_batch():
    idx = torch.tensor(probes)
    return torch.autograd.grad((bk.losses(m(x[idx]), y[idx], 4) * torch.tensor(w)).sum(), params)


def loop():
    losses = torch.cat([bk.losses(m(x[i:i + 1]), y[i:i + 1], 1) for i in probes])
    return torch.autograd.grad((losses * torch.tensor(w)).sum(), params)


ref = loop()
assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-7) for a, b in zip(vmapped(), ref))
res = {f.__name__: [] for f in (vmapped, one_batch, loop)}
for _ in range(100):
    for f in (vmapped, one_batch, loop):
        t = time.perf_counter()
        f()
        res[f.__name__].append(time.perf_counter() - t)
for k, v in res.items():
    v.sort()
    print(f"{k}: min {1e3 * v[0]:.2f} ms, median {1e3 * v[len(v) // 2]:.2f} ms")
