"""Inputs whose rows share memory (sliding windows from Tensor.unfold, a common time-series idiom)
through a non-idempotent in-place activation as the model's first module: torch's overlap check
says "too hard" for such strides and writes each shared element once per row that covers it, so
example i's activations depend on how many other windows of the batch overlap it. Also: _compiled_call_impl."""
import torch
from torch import nn
from _measure import engine, clipped_sum, PROBED
from clipbias.grads import separable

torch.manual_seed(0)
k, B = 6, 8
series = torch.randn(200) * 3
windows = series.unfold(0, k, 1)  # [195, k], strides (1, 1): row i overlaps rows i-5..i+5
y = torch.randint(0, 10, (B,))
model = nn.Sequential(nn.SiLU(inplace=True), nn.Linear(k, 10))
e = engine(model, "auto")
print("fast path:", e.fast is not None, "why_not:", separable.why_not(model))
if e.fast is None:
    raise SystemExit("grad_path=auto chose the rows path")
# the batch: B consecutive windows (a view that overlaps itself); its neighbour: window 3 left out
# (the same windows gathered by index: a copy, no overlap, on a fresh series each time)
def batch(idx):
    s = series.clone()
    w = s.unfold(0, k, 1)
    return w[idx[0]:idx[-1] + 1] if idx == list(range(idx[0], idx[-1] + 1)) else w[idx]
PROBED.clear()
full = clipped_sum(e, batch(list(range(10, 10 + B))), y)
print("probe ran:", bool(PROBED))
worst = 0.0
for j in range(B):
    keep = [10 + i for i in range(B) if i != j]
    s = series.clone(); w = s.unfold(0, k, 1)
    xs = w[keep]  # copy
    worst = max(worst, float((full - clipped_sum(e, xs, y[[i for i in range(B) if i != j]])).norm()))
print(f"overlapping windows + SiLU(inplace=True): sensitivity {worst:.3f} C")

# control: the same batch as a contiguous copy (no overlap) keeps the bound
full_copy = clipped_sum(e, series.clone().unfold(0, k, 1)[10:10 + B].contiguous(), y)
worst = 0.0
for j in range(B):
    keep = [10 + i for i in range(B) if i != j]
    worst = max(worst, float((full_copy - clipped_sum(e, series.clone().unfold(0, k, 1)[keep], y[[i for i in range(B) if i != j]])).norm()))
print(f"control, contiguous copy of the same batch: sensitivity {worst:.3f} C")
view = series.clone().unfold(0, k, 1)[10:10 + B]
before = view.clone()
model(view)
print("the in-place activation changed the caller's batch:", not torch.equal(before, view),
      "; row 0 now differs from SiLU(row 0) by", float((view[0] - nn.functional.silu(before[0])).abs().max()))
