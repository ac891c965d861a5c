"""Per-step cost of the data loop alone (no gradient work): a bare `sampler.sample(); x[idx]` loop against
PoissonLoader.epoch over TensorData, one Fashion-MNIST-sized epoch (n = 60000, B = 256, 234 steps)."""
import time, torch
from torch import nn
from clipbias.engine.core import DPEngine
from clipbias.sampling.loader import PoissonLoader, TensorData
torch.set_num_threads(1)
x, y = torch.randn(60000, 1, 28, 28), torch.randint(0, 10, (60000,))
def eng():
    return DPEngine(nn.Linear(4, 2), "dpsgd", n=60000, batch_size=256, epochs=5, noise_multiplier=1.0, noise_seed=0)
best = {}
for rep in range(3):
    e = eng(); t = time.perf_counter()
    for _ in range(len(e.sampler)):
        idx = e.sampler.sample(); xb, yb = x[idx], y[idx]
    best["old"] = min(best.get("old", 9), (time.perf_counter() - t) / len(e.sampler))
    e = eng(); t = time.perf_counter()
    for xb, yb, idx in PoissonLoader(e, TensorData(x, y)).epoch(): pass
    best["loader"] = min(best.get("loader", 9), (time.perf_counter() - t) / len(e.sampler))
print({k: f"{v*1e3:.3f} ms/step" for k, v in best.items()}, f"overhead {(best['loader']-best['old'])*1e3:.3f} ms/step")
