"""A3: a forward that updates a buffer is refused and restored by comparing each buffer's `_version`.  Ways a
forward updates a buffer without bumping the version of the buffer object that was captured:
  (a) reassignment `self.running = 0.9 * self.running + 0.1 * stat` (out of place, a common running-mean idiom);
  (b) in place through `.data` (a new version counter);
  (c) a forward on the drawn batch under torch.no_grad() (e.g. a teacher / pseudo-label pass) is not guarded.
The released model's state_dict then holds a statistic of the private batch with no noise: we measure how far
the released buffer moves between neighbouring datasets (any nonzero move is an unbounded privacy loss)."""
import torch
from torch import nn
from common import D, dataset, one_step


class Running(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(D, 1, bias=False)
        nn.init.zeros_(self.lin.weight)
        self.register_buffer("running", torch.zeros(D))

    def forward(self, x):
        if self.training:
            stat = x.mean(0).detach()
            if self.how == "reassign":
                self.running = 0.9 * self.running + 0.1 * stat
            elif self.how == "data":
                self.running.data.mul_(0.9).add_(0.1 * stat)
            elif self.how in ("inplace", "nograd"):
                self.running.mul_(0.9).add_(0.1 * stat)
        return self.lin(x - self.running)


def loop_for(how):
    def loop(model, opt, loader, pe):
        for xb, yb in loader:
            opt.zero_grad()
            if how == "nograd":
                with torch.no_grad():
                    teacher = model(xb)            # train mode, no graph: a pseudo-label pass
            try:
                model(xb).sum().backward()
            except Exception as e:
                loop.refused = "forward: " + type(e).__name__
                return
            try:
                opt.step()
            except Exception as e:
                loop.refused = "step: " + type(e).__name__ + " (" + str(e)[:60] + ")"
            break
    loop.refused = None
    return loop


for how in ["inplace", "reassign", "data", "nograd"]:
    out = []
    for target in (True, False):
        m = Running(how if how != "nograd" else "nograd")
        loop = loop_for(how)
        w, cav = one_step(loop, *dataset(16, target), model=m)
        out.append((m._module.running.clone() if hasattr(m, "_module") else m.running.clone(), not cav, loop.refused))
    (ra, ca, fa), (rb, cb, fb) = out
    print(f"{how:9s} refused={fa}  released buffer moved by {float((ra - rb).norm()):.4f} (noise-free)  "
          f"certified(D, D') = {(ca, cb)}")
