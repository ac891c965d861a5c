"""Shared harness for the red-team reproducers: the noiseless clipped sum the fast path releases,
on a batch and on its neighbours (one example removed), through the public DPEngine."""
from __future__ import annotations


import clipbias.grads.fast as fast
from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.grads import separable

C = 1.0
PROBED: list[int] = []
_orig = fast.BookKeeping._check_examples


def _counted(self, *a):
    PROBED.append(1)
    return _orig(self, *a)


fast.BookKeeping._check_examples = _counted


def engine(model, grad_path="fast", **kw):
    return DPEngine(model, "dpsgd", n=1000, batch_size=8.0, steps=100, noise_multiplier=1.0,
                    config=AlgoConfig(lr=0.1, clip=C), grad_path=grad_path, **kw)


def clipped_sum(e, x, y):
    scale = e.pipeline.per_sample[0].scale
    proc, _, _, _ = e.fast(x, y, scale, reference=False)
    return proc.detach().double()


def sensitivity(e, x, y, drop=None):
    """max over removed examples j of ||sum(D) - sum(D - j)|| / C, and whether the probe ran."""
    PROBED.clear()
    full = clipped_sum(e, x, y)
    probed = bool(PROBED)
    worst = 0.0
    for j in (range(len(x)) if drop is None else drop):
        keep = [i for i in range(len(x)) if i != j]
        worst = max(worst, float((full - clipped_sum(e, x[keep], y[keep])).norm()) / C)
    return worst, probed


def report(name, e, x, y, drop=None):
    if e.fast is None:
        print(f"{name}: grad_path=auto chose the rows path (separable.why_not={separable.why_not(e.model)!r})")
        return None, None
    try:
        s, probed = sensitivity(e, x, y, drop)
    except Exception as err:  # the probe (or the model itself) refused the step
        print(f"{name}: separable.why_not={separable.why_not(e.model)!r} probe_ran={bool(PROBED)} "
              f"step refused: {type(err).__name__}: {str(err)[:100]}")
        return None, bool(PROBED)
    print(f"{name}: separable.why_not={separable.why_not(e.model)!r} probe_ran={probed} "
          f"sensitivity={s:.3f} C ({'BROKEN' if s > 1.0 + 1e-6 else 'ok'})")
    return s, probed
