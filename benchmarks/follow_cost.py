"""What following the loop's own loss costs (docs/integrations.md, "The loss your loop computes is the loss
trained"): the Opacus interface's step on clipbias's ``cnn`` (Tramer & Boneh's, the layer shapes of Opacus's
MNIST example) at B = 256, without ``criterion``
(the loop's loss is traced and followed: the forward the loop calls runs without a graph, the private step
runs its own) against ``criterion=nn.CrossEntropyLoss()`` (from the second batch the forward takes the step:
no second forward). The two arms interleaved in one process, the median time of a whole loop iteration
(``zero_grad``, forward, loss, ``backward``, ``step``) after two warm-up steps.

    PYTHONPATH=. python benchmarks/follow_cost.py [--steps 14] [--threads 2] [--batch-size 256]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from clipbias import PrivacyEngine
from clipbias.models import build_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    x, y = torch.randn(64 * a.batch_size, 1, 28, 28), torch.randint(0, 10, (64 * a.batch_size,))

    def arm(criterion):
        torch.manual_seed(0)
        m = build_model("cnn", (1, 28, 28), 10)
        model, opt, loader = PrivacyEngine().make_private(
            module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
            data_loader=DataLoader(TensorDataset(x, y), batch_size=a.batch_size), noise_multiplier=1.0,
            max_grad_norm=1.0, criterion=criterion)
        return model, opt, iter(loader), []
    arms = {"follow (no criterion)": arm(None), "criterion=CrossEntropyLoss": arm(nn.CrossEntropyLoss())}
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(a.steps):
        for model, opt, it, times in arms.values():
            xb, yb = next(it)
            t = time.perf_counter()
            opt.zero_grad()
            loss_fn(model(xb), yb).backward()
            opt.step()
            times.append(time.perf_counter() - t)
    med = {k: sorted(v[3][2:])[len(v[3][2:]) // 2] for k, v in arms.items()}
    print(f"{platform.processor() or platform.machine()}, {a.threads} threads, B = {a.batch_size}, "
          f"{a.steps - 2} timed steps per arm")
    for k, v in med.items():
        print(f"{k:28s} {v * 1e3:7.1f} ms / step")
    f, c = med.values()
    print(f"follow / criterion: {f / c:.2f}x")


if __name__ == "__main__":
    main()
