"""Globals of the reviewed model modules rebound after import: the reviewed forwards call them, but
separable snapshotted only torch's namespaces (and the reviewed classes' own methods):
  1. clipbias.models.resnet._shortcut_a (resnet20-gn's shortcut) replaced by one centring the batch;
  2. clipbias.models.resnet.F rebound to a namespace whose relu centres the batch;
  3. clipbias.models.gpt.F rebound to a namespace whose gelu adds the batch mean (GPT, lm_loss).
With the weaker check separable.why_not was None, the probe was skipped, and one example moved the
clipped sum by more than C. Each case is undone before the next."""
import types

import torch
from torch.nn import functional as F
from _measure import engine, report
import clipbias.models.gpt as G
import clipbias.models.resnet as R
from clipbias.models import build_model
from clipbias.models.gpt import GPT, lm_loss

torch.manual_seed(0)


def centred(t):
    return t - t.mean(0)


def namespace(**over):
    ns = types.SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("__")})
    ns.__dict__.update(over)
    return ns


m = build_model("resnet20-gn", (1, 8, 8), 10)
x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 10, (6,))
x[0] *= 50

# 1. resnet's _shortcut_a replaced in its module
orig = R._shortcut_a
R._shortcut_a = lambda t, planes, stride: orig(centred(t), planes, stride)
report("1. clipbias.models.resnet._shortcut_a replaced", engine(m, "fast"), x, y)
R._shortcut_a = orig

# 2. resnet's module-level F rebound
R.F = namespace(relu=lambda t: F.relu(centred(t)))
report("2. clipbias.models.resnet.F rebound", engine(m, "fast"), x, y)
R.F = F

# 3. gpt's module-level F rebound (the MLP's gelu)
g = GPT(vocab=50, context=8, width=16, layers=1, heads=2)
tok, tgt = torch.randint(0, 50, (6, 8)), torch.randint(0, 50, (6, 8))
G.F = namespace(gelu=lambda t, approximate="none": F.gelu(t, approximate=approximate) + 50 * t.mean(0))
report("3. clipbias.models.gpt.F rebound (GPT, lm_loss)", engine(g, "fast", loss_fn=lm_loss), tok, tgt)
G.F = F
