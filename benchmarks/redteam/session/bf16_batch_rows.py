"""Red team, mixed precision: does an example's bfloat16 activation or input gradient depend on the
batch it sits in (its size, its other rows)?  Under CPU autocast, for batch sizes 1, 7, 63, 64, 65,
256, 257, the first example's forward output and the gradient reaching its input through a Linear,
a Conv2d, LayerNorm and SDPA (no dropout), compared bit for bit with the batch of one. Prints the
largest relative difference seen per layer (0 = bit-identical)."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

torch.manual_seed(0)
SIZES = (1, 7, 63, 64, 65, 256, 257)


class Attn(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], x.shape[1], 3, 2, -1).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)


LAYERS = {
    "linear": (nn.Linear(512, 384), lambda n, g: torch.randn(n, 512, generator=g)),
    "linear3d": (nn.Linear(96, 200), lambda n, g: torch.randn(n, 17, 96, generator=g)),
    "conv2d": (nn.Conv2d(16, 32, 3, padding=1), lambda n, g: torch.randn(n, 16, 12, 12, generator=g)),
    "layernorm": (nn.LayerNorm(384), lambda n, g: torch.randn(n, 384, generator=g) * 5 + 1),
    "sdpa": (Attn(), lambda n, g: torch.randn(n, 24, 64, generator=g)),
}


def first_row(m, x, dt):
    x = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=dt):
        out = m(x)
    gout = torch.ones_like(out)
    gout[0] = torch.linspace(-1, 1, out[0].numel()).view_as(out[0]).to(out.dtype)
    (gin,) = torch.autograd.grad(out, x, gout)
    return out[0].detach().float(), gin[0].float()


def main(dt=torch.bfloat16):
    worst = {}
    for name, (m, make) in LAYERS.items():
        g = torch.Generator().manual_seed(1)
        big = make(max(SIZES), g)
        o1, g1 = first_row(m, big[:1], dt)
        w = 0.0
        for n in SIZES[1:]:
            for other in (big[:n], torch.cat([big[:1], torch.randn_like(big[1:n]) * 100])):  # other rows, huge
                o, gi = first_row(m, other, dt)
                w = max(w, float((o - o1).abs().max() / o1.abs().max()), float((gi - g1).abs().max() / g1.abs().max()))
        worst[name] = w
        print(f"{name}: largest relative change of example 0's {dt} values across batches: {w:.3g}")
    return worst


if __name__ == "__main__":
    main(torch.bfloat16)
    main(torch.float16)  # CPU only here: no CUDA device was lent to this session (cuBLAS may pick kernels by M)
