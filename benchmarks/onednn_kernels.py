"""The oneDNN kernels of one cnn step (B = 256): which implementation ran for each convolution and
reorder, and for how long, in a non-private step and a fast-path `dpsgd` step.

    python benchmarks/onednn_kernels.py
    ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/onednn_kernels.py   # as oneDNN runs on an AVX2-only CPU

oneDNN reads ``ONEDNN_MAX_CPU_ISA`` once, when torch first uses it, so one process sees one ISA:
run the script once per setting. The listing is oneDNN's own verbose log of the sixth step of each
arm (after five warm-up steps), one line per primitive: kind, implementation, propagation, shape
(oneDNN's problem string), milliseconds. It is what showed why the cnn's ratios to a non-private step
differ between AVX2 and AVX-512 machines (docs/results.md, "Speed and memory").
"""

from __future__ import annotations

import contextlib
import io
import os
import sys

import torch

from clipbias.cli._common import tune_allocator
from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.models import build_model


def _step_of(arm: str, b: int = 256):
    torch.manual_seed(0)
    x, y = torch.randn(b, 1, 28, 28), torch.randint(0, 10, (b,))
    model = build_model("cnn", (1, 28, 28), 10)
    if arm == "nonprivate":
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

        def step():
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return step
    eng = DPEngine(model, "dpsgd", n=60000, batch_size=float(b), steps=10**6, noise_multiplier=1.0,
                   config=AlgoConfig(lr=0.1, clip=1.0, momentum=0.9), max_physical_batch=b, grad_path="fast")
    idx = torch.arange(b)
    return lambda: eng.step(x, y, idx)


def _verbose_lines(step) -> list[list[str]]:
    """oneDNN writes its log to the process's stdout (C stdio), so it is captured at file-descriptor level."""
    for _ in range(5):
        step()
    sys.stdout.flush()
    r, w = os.pipe()
    saved = os.dup(1)
    os.dup2(w, 1)
    try:
        with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
            step()
    finally:
        os.dup2(saved, 1)
        os.close(w)
        os.close(saved)
    with os.fdopen(r) as f:
        text = f.read()
    return [line.split(",") for line in text.splitlines() if ",primitive,exec," in line]


def main() -> None:
    torch.set_num_threads(2)
    tune_allocator()
    print(f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'DEFAULT')}, "
          f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()} ATen kernels, 2 threads")
    for arm in ("nonprivate", "dpsgd-fast"):
        with contextlib.redirect_stderr(io.StringIO()):
            rows = _verbose_lines(_step_of(arm))
        total = sum(float(r[-1]) for r in rows)
        print(f"\n== {arm}: {len(rows)} oneDNN primitives, {total:.2f} ms")
        for r in rows:
            print(f"  {r[5]:<12} {r[6]:<30} {r[7]:<18} {float(r[-1]):7.3f} ms  {r[-2]}")


if __name__ == "__main__":
    main()
