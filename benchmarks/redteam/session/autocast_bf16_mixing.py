"""Red team, mixed precision: a model that mixes examples only in 16-bit arithmetic, by less than the
probe's 25 % (MIXED_RTOL) under autocast. In bfloat16 every example's hidden activations are shifted
by 0.1 when the batch holds a canary (x[0] > 50); in float64 (the probe's recheck) and float32 nothing
is shifted.  Measured: (1) does DPEngine(autocast=bfloat16, grad_path="fast") take the steps (no
refusal) and report the run certified; (2) the change of the clipped sum handed to the noise stage
when the canary is removed, in units of C (the canary's own clipped contribution is at most C)."""
import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # this checkout's clipbias
import torch  # noqa: E402
from torch import nn  # noqa: E402

from clipbias.config import AlgoConfig  # noqa: E402
from clipbias.engine import DPEngine  # noqa: E402
from clipbias.errors import ConfigError  # noqa: E402

B, C, SHIFT = 64, 1.0, 0.1


class HalfMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 3)

    def forward(self, x):
        h = torch.tanh(self.l1(x))
        if h.dtype == torch.bfloat16:  # only in 16 bits: the float64 recheck sees a per-example model
            canary = (x[:, 0] > 50).any().to(h.dtype)  # one bit of the whole batch
            h = h + SHIFT * canary
        return self.l2(h)


def clipped_sum(x, y, keep, seed=0):
    torch.manual_seed(1)
    eng = DPEngine(HalfMixer(), "dpsgd", n=4 * B, batch_size=B, steps=4, noise_multiplier=1.0, accountant="rdp",
                   grad_path="fast", autocast=torch.bfloat16, config=AlgoConfig(lr=0.1, clip=C), noise_seed=3)
    got, finish = [], eng.pipeline.finish
    eng.pipeline.finish = lambda p, r: (got.append(p.detach().clone()), finish(p, r))[1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng.step(x[keep], y[keep], torch.nonzero(keep).flatten())
    return got[0].double(), eng


def main(trials=5):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, 8, generator=g) * 3
    y = torch.zeros(B, dtype=torch.long)  # one label: the others' gradients align
    x[0, 0] = 100.0  # the canary
    keep = torch.ones(B, dtype=torch.bool)
    drop = keep.clone()
    drop[0] = False
    worst, refused = 0.0, 0
    for t in range(trials):  # the probe's examples and weights are secret random: several tries
        try:
            p1, eng = clipped_sum(x, y, keep)
            p0, _ = clipped_sum(x, y, drop)
        except ConfigError as e:
            refused += 1
            print("refused:", str(e)[:120])
            continue
        worst = max(worst, float((p1 - p0).norm()) / C)
    print(f"steps refused {refused}/{trials}; removing the canary moves the clipped sum by {worst:.2f} C (B = {B})")
    # a whole run: certified?
    torch.manual_seed(2)
    eng = DPEngine(HalfMixer(), "dpsgd", n=4 * B, batch_size=B, steps=3, noise_multiplier=1.0, accountant="rdp",
                   grad_path="fast", autocast=torch.bfloat16, config=AlgoConfig(lr=0.1, clip=C))  # OS-keyed
    X = torch.randn(4 * B, 8, generator=g) * 3
    X[:4, 0] = 100.0
    Y = torch.zeros(4 * B, dtype=torch.long)
    try:
        for _ in range(3):
            idx = eng.sampler.sample()
            eng.step(X[idx], Y[idx], idx)
        print("run of 3 sampled steps (4 canaries in 256): certified =", eng.privacy().certified)
    except ConfigError as e:
        print("run refused:", str(e)[:160])
    return worst


if __name__ == "__main__":
    main()
