"""Banded noise when a caller skips the steps that raise (``NonFiniteGradientError``) and goes on.

``DPEngine.step`` raises before changing any state when a per-example gradient is not finite, so a
training loop may catch the error and continue with the next Poisson batch. The sampler has then
drawn the failed step's batch and moves to the next step's class, while the banded noise stage has
not moved: the next batch is released at the failed step's position. Every failure shifts the
classes against the noise positions by one, so an example's participations are no longer b apart in
the releases and its blocks overlap; the accounting (rate b q, ceil(T / b) compositions) no longer
describes the run.

This script runs the real engine (b = 4, q = 1/4: every example joins every step of its class) on
Dirac canaries (one coordinate each) and one example in each class but class 0 whose gradient is NaN
(present in both worlds), with a loop that skips failed steps. It records, for each canary, the noise positions at
which it was released, and computes its exact Gaussian sensitivity ``||C e_S||`` (the releases are
y = C x + std Z, the canary's rows x = (C / B) e_S in its coordinate): with every example included at
its steps, the mechanism given the classes is the Gaussian mechanism with mu = ||C e_S|| C / (B std);
the accounting assumes mu <= sqrt(#blocks) / z. It prints the worst canary's mu against the accounted
mu, and the epsilon (delta 1e-5) of each.

    PYTHONPATH=. .venv/bin/python benchmarks/bands_skipped_steps.py

Before the engine tied batches to their steps it printed: worst canary released at all 32 positions,
mu 2.47 against the accounted 0.707, epsilon of the class mixture 10.83 against the claim 2.94. Now a
failed step gives its batch back to the sampler (the retry gets the same batch, the same class) and
``step`` refuses a batch of another class: the loop makes no progress past the poisoned steps, and the
worst canary is released once (mu 0.25, epsilon of the mixture 0.28).
"""

import math

import numpy as np
import torch

from clipbias.algorithms.bands import coefficients
from clipbias.audit.white_box import Coordinates
from clipbias.engine.core import DPEngine
from clipbias.errors import NonFiniteGradientError
from clipbias.privacy.pld import gaussian_exact_epsilon

B_ANDS, M, POISON, T, Z = 4, 200, 12, 32, 4.0
n = M + POISON
x = torch.zeros(n, M)
x[torch.arange(M), torch.arange(M)] = 1.0
engine = DPEngine(Coordinates(M), "dpsgd", n=n, batch_size=n / B_ANDS, steps=T, noise_multiplier=Z, noise_seed=0,
                  loss_fn=lambda out, y: out.sum(), grad_path="rows", bands=B_ANDS)
# the poison: one extra example in each class but class 0 gets a NaN gradient (the others stay 0);
# the steps of classes 1 .. b-1 then fail, and class 0's batches are released at consecutive positions
labels = engine.sampler.labels
for cls in range(1, B_ANDS):
    x[M + int(np.flatnonzero(labels[M:] == cls)[0]), 0] = float("nan")
positions = {i: [] for i in range(M)}
failed = 0
while engine.steps_taken < T and failed < 10 * T:
    idx = engine.sampler.sample()
    at = engine.steps_taken
    try:
        engine.step(x[idx], torch.zeros(len(idx), dtype=torch.long), idx)
    except NonFiniteGradientError:  # skip the batch and go on
        failed += 1
        continue
    for i in idx.tolist():
        if i < M:
            positions[i].append(at)
c = np.array(coefficients(B_ANDS, engine.config.momentum))
C = sum(ck * np.eye(T, k=-k) for k, ck in enumerate(c))
worst, accounted = 0.0, 0.0
for i, s in positions.items():
    if s:
        e = np.zeros(T)
        e[s] = 1.0
        mu = np.linalg.norm(C @ e) / Z
        if mu > worst:
            worst, accounted, where = mu, math.sqrt(math.ceil(T / B_ANDS)) / Z, s
print(f"b = {B_ANDS}, T = {T} releases, z = {Z}, {failed} failed steps skipped")
print(f"worst canary released at positions {where}")
print(f"mu of its releases {worst:.3f} (epsilon {gaussian_exact_epsilon(1 / worst, 1, 1e-5):.2f}); accounted "
      f"mu {accounted:.3f} (epsilon {gaussian_exact_epsilon(1 / accounted, 1, 1e-5):.2f}); "
      f"engine's claim {engine.privacy(T).epsilon:.2f}")

# the canary's class is uniform and secret: with probability 1 / b it is class 0 (released at the positions
# above), else its steps all failed; the epsilon at delta 1e-5 of that mixture against the run without it
# (the add direction: delta(eps) = P'(L > e^eps) - e^eps P(L > e^eps), L = (1 - 1/b) + exp(mu X - mu^2/2) / b
# increasing in the Gaussian coordinate X of the canary's direction)
from scipy.special import ndtr  # noqa: E402


def delta_of(eps: float) -> float:
    cut = (math.log(B_ANDS * (math.exp(eps) - (1 - 1 / B_ANDS))) + worst ** 2 / 2) / worst
    with_canary = ndtr(worst - cut) / B_ANDS + (1 - 1 / B_ANDS) * ndtr(-cut)
    return float(with_canary - math.exp(eps) * ndtr(-cut))


lo, hi = 0.0, 50.0
for _ in range(60):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if delta_of(mid) > 1e-5 else (lo, mid)
print(f"epsilon of the class mixture (delta 1e-5): {hi:.2f}")
