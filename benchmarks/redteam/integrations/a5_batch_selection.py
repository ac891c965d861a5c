"""A5: batch selection.  `_drawn_by_sampler` accepts the sampler's LAST batch; nothing records batches that were
drawn and then passed over.  A loop that skips (Opacus loader: `if len(x) < k: continue`) or redraws
(DPEngine: `while len(idx) < k: idx = sampler.sample()`) keeps only batches of its choosing and stays certified,
but the released steps are no longer Poisson samples at rate q: the target's inclusion probability among the
released steps is q' = q P(Bin(n-1, q) >= k-1) / P(Bin(n, q) >= k) > q.  On the worst-case dataset (every other
example's gradient 0, the target's C) a released step is exactly the subsampled Gaussian at rate q', so
eps(q', T) is a lower bound on the true epsilon, against the reported eps(q, T)."""
import os, sys, math, warnings
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import clipbias
from clipbias.config import AlgoConfig
from clipbias.engine import DPEngine

n, B, k, T, z = 40, 4, 4, 200, 1.0
q = B / n


def binom_tail(m, p, j):
    return sum(math.comb(m, i) * p ** i * (1 - p) ** (m - i) for i in range(j, m + 1))


q_sel = q * binom_tail(n - 1, q, k - 1) / binom_tail(n, q, k)

# 1) the Opacus loop that skips small batches: certified?
x, y = torch.randn(n, 3), torch.zeros(n, dtype=torch.long)
torch.manual_seed(0)
m = nn.Linear(3, 2)
pe = clipbias.PrivacyEngine()
model, opt, loader = pe.make_private(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                     data_loader=DataLoader(TensorDataset(x, y), batch_size=B),
                                     noise_multiplier=z, max_grad_norm=1.0)
seen = 0
while pe.steps < T:
    for xb, yb in loader:
        if len(xb) < k:
            continue                                # "skip the tiny batches"
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        seen += 1
        if pe.steps >= T:
            break
rep = pe.privacy_report(1e-5)
print(f"Opacus loop skipping batches with < {k} rows: {pe.steps} steps, certified = {rep.certified}, "
      f"reported eps = {rep.epsilon:.3f}")

# 2) DPEngine redraw loop: empirical inclusion rate of example 0 among the released steps
eng = DPEngine(nn.Linear(3, 2), "dpsgd", n=n, batch_size=B, steps=4000, noise_multiplier=z, config=AlgoConfig(lr=0.1))
hits = draws = 0
for _ in range(4000):
    idx = eng.sampler.sample()
    while len(idx) < k:
        idx = eng.sampler.sample()
    hits += int((idx == 0).any()); draws += 1
    eng.sampler.settle()
print(f"inclusion rate of an example among selected batches: empirical {hits / draws:.4f}, exact q' = {q_sel:.4f}, "
      f"accounted q = {q:.4f} (x{q_sel / q:.2f})")


def eps(rate):
    e = DPEngine(nn.Linear(3, 2), "dpsgd", n=n, batch_size=rate * n, steps=T, noise_multiplier=z,
                 config=AlgoConfig(lr=0.1))
    return e.privacy(T).epsilon


print(f"T = {T}, z = {z}, delta = 1e-5: reported eps(q) = {eps(q):.3f}; worst-case dataset true eps >= eps(q') = "
      f"{eps(q_sel):.3f}")
