"""Where a fast-path step's time goes on a GPU: synchronised timers around the fast path's methods,
then torch.profiler's top kernels by GPU time and by host time.

    python benchmarks/profile_gpu.py gpt cnn      # models: gpt (64M, B = 128), cnn (B = 256), resnet20-gn (B = 64)

DEV=cpu runs the same on the CPU. The timers synchronise the device around each method, so the
sections add up to more than an unsynchronised step; the profiler's table is of one more step.
"""
import functools, sys, time, torch
import clipbias.grads.fast as fast
from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.models import build_model
from clipbias.models.gpt import GPT, lm_loss
import os
dev = torch.device(os.environ.get("DEV", "cuda"))
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
T, N = {}, {}
def wrap(obj, name, key):
    f = getattr(obj, name)
    @functools.wraps(f)
    def g(*a, **k):
        sync(); t = time.perf_counter(); r = f(*a, **k); sync()
        T[key] = T.get(key, 0) + time.perf_counter() - t; N[key] = N.get(key, 0) + 1; return r
    setattr(obj, name, g)
for o, n in [(fast.BookKeeping, "_check_examples"), (fast.BookKeeping, "_backward"), (fast.BookKeeping, "_rules"),
             (fast.BookKeeping, "__call__"), (fast, "_rule"), (fast.BookKeeping, "_agree_in_float64"),
             (fast.BookKeeping, "_own"), (fast.RuntimeChecks, "check_graph"), (fast, "_close"), (DPEngine, "step")]:
    wrap(o, n, n)
def case(name):
    torch.manual_seed(0)
    if name == "gpt":
        m = GPT().to(dev); b = 128
        tok = torch.randint(0, m.vocab, (b, m.context + 1), device=dev); x, y = tok[:, :-1].contiguous(), tok[:, 1:].contiguous()
        kw = dict(loss_fn=lm_loss)
    else:
        b = 256 if name == "cnn" else 64
        m = build_model(name, (1, 28, 28), 10).to(dev); x = torch.randn(b, 1, 28, 28, device=dev); y = torch.randint(0, 10, (b,), device=dev); kw = {}
    eng = DPEngine(m, "dpsgd", n=60000, batch_size=float(b), steps=10**6, noise_multiplier=1.0, config=AlgoConfig(lr=0.01, clip=1.0),
                   noise_seed=0, max_physical_batch=b, accountant="rdp", grad_path="fast", **kw)
    idx = torch.arange(b)
    for _ in range(3): eng.step(x, y, idx)
    T.clear(); N.clear(); n = 4
    for _ in range(n): eng.step(x, y, idx)
    print(f"== {name} B={b}: per step (ms, calls)")
    for k, v in T.items(): print(f"   {k:20s} {v / n * 1e3:9.2f} {N[k] / n:6.1f}")
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == 'cuda' else [])) as p:
        eng.step(x, y, idx); sync()
    ka = p.key_averages()
    print(ka.table(sort_by="self_cuda_time_total" if dev.type == "cuda" else "cpu_time_total", row_limit=12, max_name_column_width=50))
    print(ka.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=50))
for c in sys.argv[1:]: case(c)
