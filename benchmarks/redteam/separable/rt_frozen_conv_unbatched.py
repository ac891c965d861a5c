"""A frozen (requires_grad=False) Conv1d fed a 2-D batch [B, L]: torch reads it as ONE unbatched
example with B channels, so every output row mixes all examples. separable.batched only checks the
inputs of layers with trainable parameters (the ones in BookKeeping's acts), so the proof holds and
the probe is skipped. (The same with a frozen Conv2d on a 3-D batch [B, H, W].)"""
import torch
from torch import nn
from _measure import engine

torch.manual_seed(0)
B, L = 8, 12
for kind in ("conv1d", "conv2d"):
    if kind == "conv1d":
        feat = nn.Conv1d(B, B, 3, padding=1)  # a fixed filter bank; its in_channels happen to equal B
        x = torch.randn(B, L)
    else:
        feat = nn.Conv2d(B, B, 3, padding=1)
        x = torch.randn(B, 4, 4)
    feat.requires_grad_(False)
    model = nn.Sequential(feat, nn.Tanh(), nn.Flatten(), nn.Linear(x[0].numel(), 10))
    y = torch.randint(0, 10, (B,))
    x[0] *= 30
    for path in ("fast", "auto"):
        e = engine(model, grad_path=path)
        if e.fast is None:
            print(kind, path, "rows path"); continue
        # removing an example makes the batch B-1 != in_channels: compare instead with a neighbour that
        # REPLACES one example (same B), the substitution neighbour
        from _measure import clipped_sum, PROBED
        import clipbias.grads.separable as sep
        PROBED.clear()
        try:
            full = clipped_sum(e, x, y)
        except Exception as err:
            print(f"frozen {kind} (grad_path={path}): why_not={sep.why_not(model)!r} probe_ran={bool(PROBED)} "
                  f"step refused: {type(err).__name__}: {str(err)[:90]}")
            continue
        probed = bool(PROBED)
        worst = 0.0
        for j in range(B):
            x2 = x.clone(); x2[j] = 0
            worst = max(worst, float((full - clipped_sum(e, x2, y)).norm()))
        print(f"frozen {kind} on an unbatched-looking input (grad_path={path}): why_not={sep.why_not(model)!r} "
              f"probe_ran={probed} replace-one sensitivity={worst:.3f} C (bound 2 C) "
              f"{'BROKEN' if worst > 2 + 1e-6 else 'ok'}")
