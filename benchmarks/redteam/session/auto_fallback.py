"""Red team, grad_path="auto": the fast path refused at the first step after earlier micro-batches
already ran (adaptive clipping's count staged, dropout drawn), then the rows path takes the step.
Compared with grad_path="rows" under the same noise seed: weights, clip, noise draws, sampler position,
steps and epsilon after 2 steps must be equal (one release, one draw, one count, one batch). Then a
canary that first appears at step 2: the fast path must refuse (no fall-back after the first step)."""
import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
import torch  # noqa: E402
from torch import nn  # noqa: E402

from clipbias.config import AlgoConfig  # noqa: E402
from clipbias.engine import DPEngine  # noqa: E402
from clipbias.errors import ConfigError  # noqa: E402


class CanaryMixer(nn.Module):
    """Per example except in a (micro-)batch holding a canary (x[0] > 50): every row sees the batch mean."""

    def __init__(self):
        super().__init__()
        self.l1, self.drop, self.l2 = nn.Linear(6, 8), nn.Dropout(0.2), nn.Linear(8, 3)

    def forward(self, x):
        h = self.drop(torch.tanh(self.l1(x)))
        if bool((x[:, 0] > 50).any()):
            h = h + 0.3 * h.mean(0, keepdim=True)
        return self.l2(h)


def run(path, X, Y, steps=2):
    torch.manual_seed(0)
    eng = DPEngine(CanaryMixer(), "adaptive", n=len(X), batch_size=16, steps=4, noise_multiplier=1.0,
                   accountant="rdp", grad_path=path, config=AlgoConfig(lr=0.1, clip=0.5), noise_seed=5,
                   max_physical_batch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            idx = eng.sampler.sample()
            eng.step(X[idx], Y[idx], idx)
    w = torch.cat([p.detach().flatten() for p in eng.model.parameters()])
    return eng, w


def main():
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    X[:, 0] = X[:, 0].clamp(max=5)
    X[::3, 0] = 100.0  # canaries spread: some micro-batch of the first batch holds one
    ea, wa = run("auto", X, Y)
    er, wr = run("rows", X, Y)
    print("auto fell back:", ea.grad_path_fallback)
    diff = float((wa - wr).abs().max())
    same = dict(weights=diff, steps=(ea.steps_taken, er.steps_taken),
                sampler=(ea.sampler.next_step, er.sampler.next_step),
                eps=(ea.privacy().epsilon, er.privacy().epsilon))
    print(same)
    # a canary first at step 2: auto decided fast at step 1 -> refusal, not a fall-back
    X2 = X.clone()
    X2[:, 0] = X2[:, 0].clamp(max=5)
    torch.manual_seed(0)
    eng = DPEngine(CanaryMixer(), "adaptive", n=64, batch_size=16, steps=4, noise_multiplier=1.0, accountant="rdp",
                   grad_path="auto", config=AlgoConfig(lr=0.1, clip=0.5), noise_seed=5, max_physical_batch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idx = eng.sampler.sample()
        eng.step(X2[idx], Y[idx], idx)
        path1 = "fast" if eng.fast is not None else "rows"
        idx = eng.sampler.sample()
        X2[idx, 0] = 100.0
        try:
            eng.step(X2[idx], Y[idx], idx)
            print("step 2 with canaries: taken on", "fast" if eng.fast is not None else "rows",
                  "fallback:", eng.grad_path_fallback)
        except ConfigError as e:
            print(f"step 1 on {path1}; step 2 refused (no later fall-back): {str(e)[:90]}; steps {eng.steps_taken}")
    return diff


if __name__ == "__main__":
    main()
