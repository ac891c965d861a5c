"""How far float32 summation moves a sum of clipped rows beyond the row added or removed: the
residual both gradient paths share (docs/privacy.md, "Floating point in the fast path").

B rows of norm C = 1, nearly aligned (the worst case for the partial sums' magnitude), summed as the
rows path sums them (``s @ f``); for 16 rows k, ``||(S(D) - S(D - k)) - row_k||`` in float64 is the
rounding's share of the difference. Prints the worst per batch size; ~10 s::

    python benchmarks/float_sum.py
"""

import torch

torch.manual_seed(0)
for B, d in [(256, 4096), (2048, 4096), (8192, 4096)]:
    base = torch.randn(d)
    base /= base.norm()
    f = base + 0.05 * torch.randn(B, d) / d ** 0.5
    f = f / f.norm(dim=1, keepdim=True)
    s = torch.ones(B)
    worst = 0.0
    for k in range(0, B, B // 16):
        keep = torch.ones(B, dtype=torch.bool)
        keep[k] = False
        diff = ((s @ f).double() - (s[keep] @ f[keep]).double()) - f[k].double()
        worst = max(worst, float(diff.norm()))
    err = float(((s @ f).double() - f.double().sum(0)).norm())
    print(f"B {B}: |float32 sum - exact| {err:.2e} C; worst |(S(D) - S(D')) - row| {worst:.2e} C")
