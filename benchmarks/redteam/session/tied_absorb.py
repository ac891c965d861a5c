"""Red team, tied weights (fast path): one example whose Embedding and head gradients cancel sits in
the float32 accumulators with a value ~1e7 C (its computed norm is only the float64 cross-term
margin), and the other examples' embedding rows at the same token are added to it in float32 and
rounded away.  Measured: the change of the released clipped sum when that one example is removed, in
units of C (same clip factors for the others: their norms do not depend on the batch)."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3]))  # this checkout's clipbias
import torch  # noqa: E402
from torch import nn  # noqa: E402

from clipbias.grads.fast import BookKeeping  # noqa: E402
from clipbias.step import clip_scale  # noqa: E402

torch.manual_seed(0)


class Cancel(nn.Module):  # tests/test_tied.py's _Cancel: logits = W (W[t] + z)
    def __init__(self, vocab=3, width=1):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        tok, z = x
        return self.head(self.emb(tok) + z)


def run(nb=64, C=1.0):
    m = Cancel()
    with torch.no_grad():
        m.emb.weight.copy_(torch.tensor([[1.0], [0.5], [0.25]]))
    bk = BookKeeping(m, lambda out, Y: (out * Y).sum((1, 2)))
    W = m.emb.weight.detach()
    t = 0
    # example A: z = -2 W[t]: E_A = y W[t], G_A = -y W[t] at row t: the summed gradient is exactly 0
    zA, YA = (-2 * W[t]).reshape(1, 1, 1), torch.zeros(1, 1, 3)
    YA[0, 0, t] = 1e4
    # examples B: token t, weight on logit 1: E_B = y W[1] at row t (0.5 y), G_B = y (W[t] + z) at row 1
    # (z = -W[t]: G_B = 0), so B's gradient is 0.5 y at W[t]; y chosen so it is just under half an ulp of A's value
    tokB = torch.full((nb, 1), t)
    zB = (-W[t]).expand(nb, 1, 1).clone()

    def release(with_a, yb):
        YB = torch.zeros(nb, 1, 3)
        YB[:, 0, 1] = yb
        tok = torch.cat([torch.full((1, 1), t), tokB]) if with_a else tokB
        z = torch.cat([zA, zB]) if with_a else zB
        Y = torch.cat([YA, YB]) if with_a else YB
        proc, _, _, norms = bk(((tok, z),), Y, lambda n: clip_scale(n, C), False)
        return proc.double(), norms

    p, norms = release(True, 1.0)
    a_value = float(clip_scale(norms, C)[0]) * 1e4 * float(W[t, 0])  # A's clipped embedding value
    ulp = 2.0 ** (torch.tensor(a_value).log2().floor().item() - 23)
    yb = 0.49 * ulp / 0.5  # B's clipped gradient: 0.49 ulp (< C: norms of B are 0.5 yb, unclipped if <= C)
    assert 0.5 * yb <= C
    p1, n1 = release(True, yb)
    p0, n0 = release(False, yb)
    assert torch.equal(n1[1:], n0)  # the others' norms (so their clip factors) do not depend on A
    change = float((p1 - p0).norm()) / C
    print(f"A's computed norm {float(n1[0]):.3e}, its clipped value in the float32 sum {a_value:.3e} C, "
          f"ulp {ulp:g} C; {nb} other examples at 0.49 ulp each")
    print(f"released sum with A {p1.tolist()}, without A {p0.tolist()}")
    print(f"removing A changes the release by {change:.2f} C")
    return change


if __name__ == "__main__":
    change = run(int(sys.argv[1]) if len(sys.argv) > 1 else 64)
    print("BROKEN" if change > 1 + 1e-4 else "holds")
