"""Where the time of a cnn step goes on this CPU: step CPU times and the kernels that dominate them.

    python benchmarks/profile_fast.py            # ~1 min; one intra-op thread, CPU time (process_time)

CPU time of one thread, not wall time, so that a shared machine's load does not enter: min over 10
interleaved repetitions (after 2 warm-up) of one optimizer step at B = 256 (benchmarks/speed.py's arms:
non-private, dpsgd on the fast path, dpsgd on rows), with the model and input in the contiguous
NCHW layout and in channels_last (the cnn's default); then the kernels: max_pool2d of the cnn's first
pooled activation in both layouts and as the maximum of four shifted views (the same values), and the
unfold (im2col) of the two convolutions' inputs that the fast path's per-example conv norms need, by
F.unfold and by an as_strided view copied once (bit-identical, checked).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import speed  # noqa: E402

from clipbias.data.catalog import load_dataset  # noqa: E402
from clipbias.models import build_model  # noqa: E402


def cpu_ms(fn, n: int = 15) -> float:
    fn()
    best = float("inf")
    for _ in range(n):
        t0 = time.process_time()
        fn()
        best = min(best, time.process_time() - t0)
    return 1e3 * best


def strided_unfold(x: torch.Tensor, k: int, s: int, p: int) -> torch.Tensor:
    x = F.pad(x, (p, p, p, p))
    b, c, h, w = x.shape
    oh, ow = (h - k) // s + 1, (w - k) // s + 1
    st = x.stride()
    return x.as_strided((b, c, k, k, oh, ow), (st[0], st[1], st[2], st[3], st[2] * s, st[3] * s)) \
        .reshape(b, c * k * k, oh * ow)


def steps() -> None:
    ds = load_dataset("fashion-mnist")
    n, b = ds.num_train, 256
    arms = {}
    for cl in (False, True):
        for arm in ("nonprivate", "dpsgd-fast", "dpsgd"):
            torch.manual_seed(0)
            model = build_model("cnn", ds.input_shape, ds.num_classes)  # channels-last by default
            model = model.to(memory_format=torch.channels_last if cl else torch.contiguous_format)
            fn = speed._nonprivate(model, 0.1) if arm == "nonprivate" else speed._engine(model, arm, n, b, 0.1, b)
            arms[(arm, cl)] = fn
    gen = torch.Generator().manual_seed(1)
    times: dict = {k: [] for k in arms}
    for rep in range(12):
        idx = torch.randperm(n, generator=gen)[:b]
        x, y = ds.x_train[idx], ds.y_train[idx]
        for (arm, cl), fn in arms.items():
            xx = x.contiguous(memory_format=torch.channels_last) if cl else x
            t0 = time.process_time()
            fn(xx, y, idx)
            if rep >= 2:
                times[(arm, cl)].append(time.process_time() - t0)
    print("| arm | layout | CPU ms/step | x non-private, same layout |\n|---|---|---|---|")
    for (arm, cl), ts in times.items():
        base = min(times[("nonprivate", cl)])
        print(f"| {arm} | {'channels_last' if cl else 'NCHW'} | {1e3 * min(ts):.1f} | {min(ts) / base:.2f} |")


def kernels() -> None:
    x = torch.randn(256, 16, 14, 14)
    pool = torch.nn.MaxPool2d(2, stride=1)
    xc = x.contiguous(memory_format=torch.channels_last)

    def shifted():
        return torch.maximum(torch.maximum(x[..., :-1, :-1], x[..., 1:, :-1]),
                             torch.maximum(x[..., :-1, 1:], x[..., 1:, 1:]))
    assert torch.equal(shifted(), pool(x))
    print(f"\nmax_pool2d 2x2 stride 1 on [256, 16, 14, 14]: NCHW {cpu_ms(lambda: pool(x)):.2f} ms, channels_last "
          f"{cpu_ms(lambda: pool(xc)):.2f} ms, four shifted views {cpu_ms(shifted):.2f} ms")
    for name, shape, k, s, p in [("conv1", (256, 1, 28, 28), 8, 2, 3), ("conv2", (256, 16, 13, 13), 4, 2, 0)]:
        a = torch.randn(shape)
        assert torch.equal(F.unfold(a, k, padding=p, stride=s), strided_unfold(a, k, s, p))
        print(f"unfold of {name}'s input {list(shape)}: F.unfold {cpu_ms(lambda: F.unfold(a, k, padding=p, stride=s)):.2f}"
              f" ms, as_strided copy {cpu_ms(lambda: strided_unfold(a, k, s, p)):.2f} ms")


if __name__ == "__main__":
    torch.set_num_threads(1)
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    print(f"# {cpu}, torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, 1 thread")
    steps()
    kernels()
