"""The fast path's rules for the layers of fine-tuned models: grouped and depthwise convolutions,
Conv3d, padding modes, InstanceNorm, RMSNorm (torch's and Hugging Face's), each against the rows
path, and a tiny Llama decoder end to end."""

from __future__ import annotations

import pytest
import torch
from torch import nn


@pytest.mark.parametrize("layer, shape", [
    (nn.Conv2d(4, 4, 3, groups=4, padding=1, padding_mode="reflect"), (3, 4, 6, 5)),          # depthwise
    (nn.Conv2d(6, 4, (2, 3), groups=2, stride=(1, 2), dilation=(2, 1), padding=1), (3, 6, 7, 8)),
    (nn.Conv1d(6, 9, 3, groups=3, padding="same", dilation=2, padding_mode="circular"), (4, 6, 11)),
    (nn.Conv2d(3, 5, 3, padding="same", padding_mode="replicate"), (2, 3, 6, 6)),
    (nn.Conv3d(2, 3, (2, 3, 2), stride=(1, 2, 1), padding=(1, 0, 1), dilation=(1, 1, 2)), (3, 2, 5, 6, 5)),
    (nn.Conv3d(4, 4, 2, groups=2, padding=1, padding_mode="circular"), (2, 4, 3, 4, 3)),
])
def test_every_conv_kernel_gives_the_per_example_weight_gradients(layer, shape):
    """Each kernel that takes the layer equals per-example gradients taken one example at a time in
    float64 (``dilated`` takes groups=1 only, and says so)."""
    from clipbias.grads.conv_rows import KERNELS
    layer = layer.double()
    a = torch.randn(*shape, dtype=torch.float64)
    g = torch.randn_like(layer(a))
    want = torch.stack([torch.autograd.grad((layer(a[i:i + 1]) * g[i:i + 1]).sum(), layer.weight)[0].reshape(
        layer.out_channels, -1) for i in range(shape[0])])
    ran = []
    for name, kernel in KERNELS.items():
        if name == "dilated" and layer.groups > 1:
            with pytest.raises(RuntimeError, match="groups=1"):
                kernel(layer, a, g)
            continue
        got = kernel(layer, a, g)
        assert got.shape == want.shape, name
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), name
        ran.append(name)
    assert len(ran) == (2 if layer.groups > 1 else 3)


def test_input_rows_times_the_weight_is_the_convolution():
    """``input_rows`` (im2col, the ghost norm's and the one-position rule's input rows) times the
    flattened weight is the layer's output: Conv3d, and Conv2d with a non-zero padding mode."""
    from clipbias.grads.conv_rows import input_rows
    for layer, shape in [(nn.Conv3d(2, 3, (2, 3, 2), stride=(2, 1, 1), padding=(1, 1, 0), dilation=(1, 2, 1), bias=False),
                          (3, 2, 6, 7, 5)),
                         (nn.Conv2d(3, 4, 3, padding=2, padding_mode="reflect", bias=False), (2, 3, 5, 6))]:
        layer = layer.double()
        a = torch.randn(*shape, dtype=torch.float64)
        out = layer(a)
        got = (input_rows(layer, a) @ layer.weight.reshape(layer.out_channels, -1).t()).transpose(1, 2)
        torch.testing.assert_close(got, out.flatten(2), rtol=1e-12, atol=1e-12)
