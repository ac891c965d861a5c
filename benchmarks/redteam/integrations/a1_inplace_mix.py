"""A1: the loop transforms the drawn batch IN PLACE before (or after) the forward: `_same_inputs` compares the
recorded tensor with the drawn batch, which is the same (mutated) object, so it passes.  Mixing the rows (mixup
toward the batch mean) makes every example's gradient carry the target: sensitivity ~ |batch| * C."""
import torch
from common import effect, plain


def mix_inplace_before(model, opt, loader, pe):
    for xb, yb in loader:
        opt.zero_grad()
        xb.add_(xb.mean(0, keepdim=True))        # in-place "mixup with the batch mean"
        model(xb).sum().backward()
        opt.step()
        break


def mix_inplace_after(model, opt, loader, pe):
    for xb, yb in loader:
        opt.zero_grad()
        model(xb).sum().backward()
        xb.add_(xb.mean(0, keepdim=True))        # mutated after the forward, before step()
        opt.step()
        break


def noise_inplace(model, opt, loader, pe):   # augmentation with torch's public generator, in place
    for xb, yb in loader:
        opt.zero_grad()
        xb.add_(0.1 * torch.randn_like(xb))
        model(xb).sum().backward()
        opt.step()
        break


def mix_outofplace(model, opt, loader, pe):   # control: the same mix out of place is caught
    for xb, yb in loader:
        opt.zero_grad()
        model(xb + xb.mean(0, keepdim=True)).sum().backward()
        opt.step()
        break


for name, loop in [("plain (control)", plain), ("mix out of place (control)", mix_outofplace),
                   ("mix in place before forward", mix_inplace_before), ("mix in place after forward", mix_inplace_after),
                   ("randn_like noise in place", noise_inplace)]:
    d, cert, cav = effect(loop)
    print(f"{name:32s} effect = {d:7.3f} C   certified(D, D') = {cert}")
