"""Saved-tensor hooks around the step whose unpack adds the batch mean to every saved tensor with the
batch's first dimension (so the backward of every layer mixes examples). The structural proof does not
see it (documented). Does the probe (forced with a loss_fn that is not the default object)?"""
import torch
from torch import nn
from torch.nn import functional as F
from _measure import engine, report

B = 8
def unpack(t):
    return t + t.mean(0) if t.dim() >= 1 and t.shape[0] == B and t.dim() == 2 and t.shape[1] == 16 else t


torch.manual_seed(0)
x, y = torch.randn(B, 12), torch.randint(0, 10, (B,))
x[0] *= 50
model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 10))
with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
    report("saved-tensor hooks (proof)", engine(model, "fast"), x, y, drop=[0])
    report("saved-tensor hooks (probe forced)", engine(model, "fast", loss_fn=lambda o, t: F.cross_entropy(o, t, reduction="none")), x, y, drop=[0])
