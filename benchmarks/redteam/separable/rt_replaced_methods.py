"""Methods replaced after import that separable does not look at (it checks only an instance's own
`forward` and the torch types' class `forward`):
  1. a clipbias model's class forward replaced (MLP.forward monkeypatched to standardise the batch);
  2. ScatterLinear's helper `_features` replaced on the instance;
  3. a Linear's class `__call__`... (torch types: `nn.Tanh.__call__` replaced on the class);
  4. a Conv2d's `_conv_forward` replaced on the instance (Conv2d.forward calls it);
  5. torch.nn.functional.linear replaced after clipbias was imported (Linear.forward calls it).
In every case separable.why_not is None, the probe is skipped, and one example moves the clipped sum
by more than C. Each case is undone before the next."""
import torch
from torch import nn
from torch.nn import functional as F
from _measure import engine, report
from clipbias.models import build_model

torch.manual_seed(0)
x, y = torch.randn(8, 1, 6, 6), torch.randint(0, 10, (8,))
x[0] *= 50


def centred(t):
    return t - t.mean(0)


# 1. MLP.forward replaced on the class
MLP = type(build_model("mlp", (1, 6, 6), 10))
orig = MLP.forward
MLP.forward = lambda self, x: self.net(centred(x))
report("1. MLP.forward replaced on the class", engine(build_model("mlp", (1, 6, 6), 10), "auto"), x, y)
MLP.forward = orig

# 2. ScatterLinear._features replaced on the instance (the GroupNorm is bypassed)
m = build_model("scatter-linear", (1, 28, 28), 10)
feats = torch.randn(8, *m.input_shape); feats[0] *= 50
m._features = lambda t: centred(t.reshape(t.shape[0], *m.input_shape))
report("2. ScatterLinear._features replaced on the instance", engine(m, "auto"), feats, y)

# 3. nn.Tanh.__call__ replaced on the class
orig_call = nn.Tanh.__call__
nn.Tanh.__call__ = lambda self, t: torch.tanh(centred(t))
report("3. nn.Tanh.__call__ replaced on the class", engine(build_model("mlp", (1, 6, 6), 10), "auto"), x, y)
del nn.Tanh.__call__  # back to the inherited one

# 4. Conv2d._conv_forward replaced on the instance
m = build_model("cnn", (1, 16, 16), 10)
conv = m.features[0]
cf = conv._conv_forward
conv._conv_forward = lambda inp, w, b: cf(centred(inp), w, b)
xi = torch.randn(8, 1, 16, 16); xi[0] *= 50
report("4. Conv2d._conv_forward replaced on the instance", engine(m, "fast"), xi, y)

# 5. F.linear replaced after import
lin = F.linear
F.linear = lambda t, w, b=None: lin(centred(t), w, b)
report("5. torch.nn.functional.linear replaced after import", engine(build_model("mlp", (1, 6, 6), 10), "auto"), x, y)
F.linear = lin
