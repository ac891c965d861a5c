"""A summed loss_fn with a data-dependent initialisation: it sets a logit temperature from the first
batch it sees (``self.scale = out.detach().std()``, as ActNorm-style inits do). The fast path called the
loss once on the first step's whole output, to learn whether it returns per-example losses or the total,
so the temperature became a statistic of the first batch, and every later step's clipped contributions
depend on it: example j of step 1 moves the noiseless clipped sum of step 2 (a fixed batch E) by far more
than C (the bound for an example that is not in that step is 0; across both steps it is C a step).
Under the rows path (and now the fast path) the loss only ever sees one example at a time inside vmap,
and the first call sees zeros: the temperature is not a statistic of any private batch."""
import torch
from torch.nn import functional as F
from _measure import C, clipped_sum, engine
from clipbias.models import build_model

torch.manual_seed(0)
x, y = torch.randn(8, 1, 6, 6), torch.randint(0, 10, (8,))
x[0] *= 5000
xe, ye = torch.randn(64, 1, 6, 6), torch.zeros(64, dtype=torch.long)  # step 2: 64 examples of one class


class LazyTemperatureCE:
    def __init__(self):
        self.scale = None

    def __call__(self, out, t):
        if self.scale is None:
            self.scale = out.detach().std().clamp_min(1e-3)
        return F.cross_entropy(out / self.scale, t, reduction="sum")


def second_step(first):
    torch.manual_seed(1)
    e = engine(build_model("mlp", (1, 6, 6), 10), "fast", loss_fn=LazyTemperatureCE())
    clipped_sum(e, x[first], y[first])  # step 1
    return clipped_sum(e, xe, ye), e.fast.__self__ if hasattr(e.fast, "__self__") else None  # step 2


full, _ = second_step(list(range(8)))
worst = max(float((full - second_step([i for i in range(8) if i != j])[0]).norm()) for j in range(8)) / C
print(f"lazy temperature from the first batch: step-2 clipped sum moved by {worst:.3f} C by one step-1 example "
      f"({'BROKEN' if worst > 1e-6 else 'ok'}; an example not in step 2 should move it by 0)")
