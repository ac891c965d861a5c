"""(b), (d), (e) The engine's accounting of BLT noise over a longer run, after a resume, and around failed steps.

(b) Delta(t) and the engine's epsilon at t = 1 .. 10 T for the strategy planned for T = 40 (k = 4, z = 1,
momentum 0.9); the largest Delta(t) for t <= T. (d) A run of 40 planned steps resumed after 10 as an extended
run of 80 (allowed at a given z): the strategy of the noise and of the accounting after the load, and the epsilon
at 80 steps against what the new engine's own strategy would claim; a load that fails after the noise stage
loaded (a sampler state of another n); a BLT state loaded by a banded ("optimized") engine and the reverse.
(e) A batch drawn for the next step, stepped at this one; a step that fails after its noise was computed.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/redteam/blt/rt_resume.py
"""

from __future__ import annotations

import os
import warnings

import torch
from torch import nn

os.environ.setdefault("CLIPBIAS_CACHE", "off")

from clipbias import privacy  # noqa: E402
from clipbias.step import Stage  # noqa: E402
from clipbias.config import AlgoConfig  # noqa: E402
from clipbias.engine import DPEngine  # noqa: E402


def engine(steps: int, strategy: str = "blt", seed: int | None = None) -> DPEngine:
    torch.manual_seed(0)
    return DPEngine(nn.Linear(3, 2), "dpsgd", n=64, batch_size=16, steps=steps, bands=4, bands_strategy=strategy,
                    noise_multiplier=1.0, config=AlgoConfig(lr=0.1, clip=1.0, momentum=0.9), noise_seed=seed)


def steps(e: DPEngine, count: int, x, y) -> None:
    for _ in range(count):
        idx = e.sampler.sample()
        e.step(x[idx], y[idx], idx)


def main() -> None:
    warnings.simplefilter("ignore")
    x, y = torch.randn(64, 3), torch.randint(0, 2, (64,))
    a = engine(40)
    print("(b) t | Delta(t) | epsilon (delta 1e-5)")
    for t in (1, 10, 20, 39, 40, 41, 60, 80, 200, 400):
        print(f"    {t} | {a.spec.blt_sensitivity(t):.6f} | {a.privacy(t).epsilon:.4f}")
    print(f"    max Delta(t), t <= 40: {max(a.spec.blt_sensitivity(t) for t in range(1, 41)):.17g}")
    steps(a, 10, x, y)
    state = a.state_dict()
    b = engine(80)
    own = b.privacy(80).epsilon
    b.load_state_dict(state)
    print(f"(d) resumed as 80 steps: noise strategy is the saved one: {b.pipeline.noise.blt == a.noise_shape}; "
          f"accounting's: {b.spec.blt == a.spec.blt}; epsilon(80) {b.privacy(80).epsilon:.4f} "
          f"(= account(saved spec, 80) {privacy.account(a.spec, 80, 1e-5).epsilon:.4f}; the new engine's own "
          f"strategy would claim {own:.4f}); Delta_saved(80) = {b.spec.blt_sensitivity(80):.4f}")
    steps(b, 70, x, y)
    print(f"    after the 80 steps: epsilon {b.privacy().epsilon:.4f}")
    c = engine(80)
    try:
        c.load_state_dict({**state, "sampler": {**state["sampler"], "n": 65}})
    except Exception as ex:  # noqa: BLE001
        print(f"    a load failing after the noise loaded: {type(ex).__name__}; strategy back to the engine's own: "
              f"{c.pipeline.noise.blt == c.noise_shape and c.spec.blt[0] == c.noise_shape.scale}; "
              f"epsilon(80) {c.privacy(80).epsilon:.4f}")
    for src, dst in (("blt", "optimized"), ("optimized", "blt")):
        try:
            engine(40, dst).load_state_dict(engine(40, src).state_dict())
            print(f"    a {src} state into a {dst} engine: LOADED")
        except Exception as ex:  # noqa: BLE001
            print(f"    a {src} state into a {dst} engine: refused, {type(ex).__name__}: {str(ex)[:90]}")
    e = engine(40, seed=1)
    e.sampler.sample()
    nxt = e.sampler.sample()
    try:
        e.step(x[nxt], y[nxt], nxt)
        print("(e) a batch of class 1 at step 0: TAKEN")
    except Exception as ex:  # noqa: BLE001
        print(f"(e) a batch of class 1 at step 0: refused, {type(ex).__name__}")
    ref, e = engine(40, seed=1), engine(40, seed=1)
    steps(ref, 3, x, y)
    steps(e, 2, x, y)
    fail = [True]

    class Post(Stage):
        def __call__(self, v):
            if fail[0]:
                fail[0] = False
                raise RuntimeError("post stage failed")
            return v

    e.pipeline.post = Post()
    try:
        steps(e, 1, x, y)
    except RuntimeError:
        pass
    draws = e.pipeline.noise.draws
    steps(e, 1, x, y)
    same = all(torch.equal(p, q) for p, q in zip(e.model.parameters(), ref.model.parameters()))
    print(f"    a step failing after its noise: draws after the failure {draws} (= steps taken {2}); the retried run "
          f"equals the uninterrupted one: {same}")


if __name__ == "__main__":
    main()
