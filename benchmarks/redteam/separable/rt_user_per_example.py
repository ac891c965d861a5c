"""A user's model class copied from clipbias's LogReg, keeping its `PER_EXAMPLE = True` line, whose
forward standardises the inputs with the batch's statistics: separable accepts any class declaring
PER_EXAMPLE in its body, so the probe is skipped and one example moves the clipped sum by many C."""
import math
import torch
from torch import nn
from _measure import engine, report


class MyLogReg(nn.Module):
    PER_EXAMPLE = True  # forward composes its children example by example (reviewed; grads.separable)

    def __init__(self, input_shape, num_classes):
        super().__init__()
        self.fc = nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, x):
        x = x.flatten(1)
        return self.fc((x - x.mean(0)) / (x.std(0) + 1e-5))  # batch standardisation: mixes examples


torch.manual_seed(0)
x, y = torch.randn(8, 1, 6, 6), torch.randint(0, 10, (8,))
x[0] *= 50  # an outlier: it shifts every other example's standardised input
for path in ("fast", "auto"):
    e = engine(MyLogReg((1, 6, 6), 10), grad_path=path)
    if e.fast is not None:
        report(f"user class with PER_EXAMPLE=True (grad_path={path})", e, x, y)
    else:
        print(f"grad_path={path}: rows path")
