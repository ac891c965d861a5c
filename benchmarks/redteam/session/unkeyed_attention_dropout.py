"""Red team, keyed SDPA: paths where torch's own (unkeyed) attention dropout could still run inside the
private forward.  Each model below is stepped once by DPEngine (fast and rows paths); the outcome is
'refused' (ConfigError / refusal: nothing released) or 'ran' -- and where it ran, whether torch's
global generator moved (an unkeyed draw) and whether the step's clipped sum is reproducible across two
engines with the same key but a different torch seed (keyed: equal)."""
import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from clipbias.config import AlgoConfig  # noqa: E402
from clipbias.engine import DPEngine  # noqa: E402
from clipbias.errors import ClipbiasError  # noqa: E402

D, L, B = 8, 5, 6


class Base(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.qkv, self.out = nn.Linear(D, D), nn.Linear(D, 3 * D), nn.Linear(D, 3)

    def heads(self, x):
        q, k, v = self.qkv(torch.tanh(self.inp(x))).view(x.shape[0], L, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        return q, k, v

    def finish(self, o):
        return self.out(o.transpose(1, 2).flatten(2).mean(1))


class AtenMath(Base):
    def forward(self, x):
        q, k, v = self.heads(x)
        return self.finish(torch.ops.aten._scaled_dot_product_attention_math(q, k, v, None, 0.5, False)[0])


class AtenFlashCPU(Base):
    def forward(self, x):
        q, k, v = self.heads(x)
        return self.finish(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.5, False)[0])


class CausalWithDropout(Base):
    def forward(self, x):
        q, k, v = self.heads(x)
        return self.finish(F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True))


class MHA(nn.Module):
    def __init__(self, need_weights, batch_first=True):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.mha = nn.MultiheadAttention(D, 2, dropout=0.5, batch_first=batch_first)
        self.out, self.nw, self.bf = nn.Linear(D, 3), need_weights, batch_first

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if not self.bf:
            h = h.transpose(0, 1)
        o, _ = self.mha(h, h, h, need_weights=self.nw)
        if not self.bf:
            o = o.transpose(0, 1)
        return self.out(o.mean(1))


def clipped(model_fn, path, torch_seed):
    torch.manual_seed(0)
    m = model_fn().train()
    eng = DPEngine(m, "dpsgd", n=24, batch_size=B, steps=2, noise_multiplier=1.0, accountant="rdp", grad_path=path,
                   config=AlgoConfig(lr=0.1, clip=1.0), noise_seed=3)
    got, finish = [], eng.pipeline.finish
    eng.pipeline.finish = lambda p, r: (got.append(p.detach().clone()), finish(p, r))[1]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, L, D, generator=g), torch.randint(0, 3, (B,), generator=g)
    torch.manual_seed(torch_seed)
    before = torch.random.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng.step(x, y, torch.arange(B))
    return got[0], not torch.equal(before, torch.random.get_rng_state())


def main():
    cases = {"aten._scaled_dot_product_attention_math p=0.5": AtenMath,
             "aten._scaled_dot_product_flash_attention_for_cpu p=0.5": AtenFlashCPU,
             "F.sdpa is_causal + dropout": CausalWithDropout,
             "nn.MultiheadAttention need_weights=True": lambda: MHA(True),
             "nn.MultiheadAttention need_weights=False": lambda: MHA(False),
             "nn.MultiheadAttention seq-first": lambda: MHA(False, batch_first=False)}
    unkeyed = 0
    for name, fn in cases.items():
        for path in ("fast", "rows"):
            try:
                a, moved = clipped(fn, path, 1)
                b, _ = clipped(fn, path, 2)
                same = torch.equal(a, b)
                unkeyed += moved or not same
                print(f"{name} [{path}]: ran; torch generator moved: {moved}; same sum under another torch seed: {same}")
            except ClipbiasError as e:
                print(f"{name} [{path}]: refused ({type(e).__name__}: {str(e)[:70]})")
            except Exception as e:  # noqa: BLE001
                print(f"{name} [{path}]: error {type(e).__name__}: {str(e)[:70]}")
    print("unkeyed runs:", unkeyed)
    return unkeyed


if __name__ == "__main__":
    main()
