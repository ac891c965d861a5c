"""Banded noise when an exception (a KeyboardInterrupt) lands in the ``finally`` block of ``DPEngine.step``.

Once the noisy update exists, ``step`` applies it and then, in ``finally``, runs
``optimizer.zero_grad``, ``pipeline.commit``, ``rows.commit``, ``steps_taken += 1``. An exception between
those statements leaves the counters inconsistent after the update was applied to the model (released):

* D: raised in ``optimizer.zero_grad`` (before ``pipeline.commit``): the noise draw counter and
  ``steps_taken`` stay at t, the batch is not given back. A loop that goes on (catching the class refusals of
  ``check_band_class``) releases batch t + b at noise position t with the SAME noise draw Z_t and the same
  band memory: the difference of the two applied updates is c_0 (v - v') without noise.
* E: raised in ``rows.commit`` (after ``pipeline.commit``): the noise position is t + 1, ``steps_taken`` t.
  The class check then accepts class t mod b at noise position t + 1: an example's participations are
  released at adjacent positions and its blocks overlap (exact Gaussian mu above the accounted one).

Without bands (b = 1) the first case is the same: the next batch is released with the draw Z_t (no
class check refuses it), so the hazard is the ``finally`` block's, not the banded stage's.

The interrupts are injected by wrapping ``engine.optimizer.zero_grad`` / ``engine.rows.commit`` (an
interrupt at that instant); the loop is the ordinary ``sample -> step`` loop that catches ClipbiasError /
KeyboardInterrupt and continues.

    PYTHONPATH=. .venv/bin/python benchmarks/bands_interrupt_in_commit.py

Before the fix it printed a draw used twice (the two updates differed in exactly the 9 examples their
batches did not share: the noise cancelled) and, for E, a canary at positions [2, 3, 7, 11, 15] with mu
0.608 against 0.500. Now ``step`` records the release (noise draw, rows, step count) before it applies
the update, and refuses to step an engine whose step count and noise draws disagree: no draw is used
twice and every release is of its position's class.
"""

import math

import numpy as np
import torch

from clipbias.algorithms.bands import coefficients
from clipbias.audit.white_box import Coordinates
from clipbias.engine.core import DPEngine
from clipbias.errors import ClipbiasError

B_ANDS, M, T, Z = 4, 64, 16, 4.0


def run(where: str, bands: int = B_ANDS):
    x = torch.zeros(M, M)
    x[torch.arange(M), torch.arange(M)] = 1.0
    e = DPEngine(Coordinates(M), "dpsgd", n=M, batch_size=M / (2 * B_ANDS), steps=T, noise_multiplier=Z, noise_seed=0,
                 loss_fn=lambda out, y: out.sum(), grad_path="rows", bands=bands)
    target = e.optimizer if where == "zero_grad" else e.rows
    name = "zero_grad" if where == "zero_grad" else "commit"
    real, calls = getattr(target, name), [0]

    def hit(*a, **k):
        calls[0] += 1
        if calls[0] == 3:  # the third step
            raise KeyboardInterrupt
        return real(*a, **k)

    setattr(target, name, hit)
    fin, out = e.pipeline.finish, []

    def tap(*a):  # the noisy update g_t the optimizer receives (post-processing of the release y_t)
        out.append(fin(*a).detach().clone())
        return out[-1]

    e.pipeline.finish = tap
    released, refused = [], 0  # (noise position, batch indices, model after)
    while e.steps_taken < T and refused < 100:
        idx = e.sampler.sample()
        pos = e.pipeline.noise.draws
        try:
            e.step(x[idx], torch.zeros(len(idx), dtype=torch.long), idx)
        except KeyboardInterrupt:
            pass  # the update was applied to the model: released
        except ClipbiasError:
            refused += 1
            continue
        released.append((pos, idx, out[-1]))
    return e, released, refused


for where in ("zero_grad", "rows.commit"):
    e, rel, refused = run(where)
    labels = e.sampler.labels
    pos = [p for p, _, _ in rel]
    wrong = [(p, sorted(set(labels[i].tolist()))) for p, i, _ in rel if len(i) and set(labels[i].tolist()) != {p % B_ANDS}]
    print(f"interrupt in {where}: {refused} batches refused, steps_taken {e.steps_taken}, noise draws "
          f"{e.pipeline.noise.draws}; noise positions reused: {sorted({p for p in pos if pos.count(p) > 1})}; "
          f"releases of another class than position mod b: {wrong[:3]}")
    twice = [(i, u) for p, i, u in rel if pos.count(p) > 1]
    if twice:
        (i1, u1), (i2, u2) = twice[:2]
        d = (u1 - u2).abs()
        print(f"  the two updates at the reused position: batches of {len(i1)} and {len(i2)} examples, "
              f"{len(set(i1.tolist()) ^ set(i2.tolist()))} in one only; their difference has {int((d > 1e-9).sum())} "
              f"nonzero coordinates (values {sorted({round(float(v), 9) for v in d[d > 1e-9]})}, noise std {e.pipeline.noise.std:.3g}), the noise cancelled"
              f" exactly: membership read without noise")
    Tn = e.pipeline.noise.draws
    c = np.array(coefficients(B_ANDS, e.config.momentum))
    C = sum(ck * np.eye(Tn, k=-k) for k, ck in enumerate(c))
    worst, at = 0.0, []
    for i in range(M):
        s = [p for p, idx, _ in rel if i in idx.tolist()]
        ev = np.zeros(Tn)
        ev[s] = 1.0
        mu = math.inf if len(s) != len(set(s)) else float(np.linalg.norm(C @ ev) / Z)
        if mu > worst:
            worst, at = mu, s
    print(f"  worst canary released at noise positions {at}: mu {worst:.3f} (inf: one noise draw used twice) "
          f"against the accounted sqrt(ceil(T/b))/z = {math.sqrt(math.ceil(T / B_ANDS)) / Z:.3f}")

e, rel, _ = run("zero_grad", bands=1)
pos = [p for p, _, _ in rel]
twice = [(i, u) for p, i, u in rel if pos.count(p) > 1]
if len(twice) < 2:
    print(f"b = 1, interrupt in zero_grad: noise positions {pos[:6]}...; no noise draw used twice")
else:
    (i1, u1), (i2, u2) = twice[:2]
    d = (u1 - u2).abs()
    print(f"b = 1, interrupt in zero_grad: noise positions {pos[:6]}...; the two updates with one draw differ in "
          f"{int((d > 1e-9).sum())} coordinates, the batches in {len(set(i1.tolist()) ^ set(i2.tolist()))} examples")
