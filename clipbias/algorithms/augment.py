"""Self-augmentation (De et al. 2022; Xiao et al. Section 6): clip the average gradient of K
augmented copies of an example.

``row_i = (1/K) sum_{k=1..K} grad f(w, A_k(x_i), y_i)`` with ``A_k`` independent random
augmentations, then ``clip(row_i, C)``. The row is a function of the single example ``x_i`` and of
data-independent randomness, so the sensitivity stays C and the accounting is DPSGD's.

Augmentations for 28x28 grey images (Fashion-MNIST): a random crop of the image padded by ``pad``
pixels on each side (default 2, i.e. shifts of up to 2 pixels, the 28x28 analogue of the usual 4 on
32x32), and a horizontal flip with probability 1/2. The flip is on by default because mirroring
preserves every Fashion-MNIST class (tops, trousers, dresses, coats, shirts, bags and shoes are
still the same garment when mirrored); turn it off (``flip=False``) for digits or letters, where a
mirror image changes or destroys the class. No vertical flip (upside-down garments are not in the
data). The padding value is each image's own minimum (``fill="min"``, the black background of
Fashion-MNIST after normalisation) or a given constant.

Unlike the authors' released code, which averages the original and K augmented copies (K + 1
gradients), we average K augmented copies, as in De et al.; K = 1 is a single random augmentation.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from ..config import Setting, boolean, integer
from ..errors import ConfigError
from ..grads.rows import FuncGradients, LossFn, RowSource
from ..randomness import Purpose, SecretKey, batch_keys, forward, keyed_ints


class CropFlip:
    """Random crop with padding + optional horizontal flip of ``[b, C, H, W]`` images."""

    def __init__(self, pad: int = 2, flip: bool = True, fill: str | float = "min") -> None:
        if not (isinstance(pad, int) and pad >= 0):
            raise ConfigError(f"`AlgoConfig.extra['pad']` must be an integer >= 0, got {pad!r}")
        if not (fill == "min" or isinstance(fill, (int, float))):
            raise ConfigError(f"augmentation fill must be 'min' or a number, got {fill!r}")
        self.pad, self.flip, self.fill = pad, bool(flip), fill

    @property
    def choices(self) -> int:
        side = 2 * self.pad + 1
        return side * side * (2 if self.flip else 1)

    def decode(self, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Integer codes in ``[0, choices)`` -> (row offset, column offset, flipped)."""
        side = 2 * self.pad + 1
        flip = v % 2 if self.flip else torch.zeros_like(v)
        v = v // 2 if self.flip else v
        return v // side, v % side, flip.bool()

    def __call__(self, x: Tensor, codes: Tensor) -> Tensor:
        """``x [b, C, H, W]``, ``codes [b, K]`` -> ``[b * K, C, H, W]`` (copies of x_0 first)."""
        if x.dim() != 4:
            raise ConfigError(f"self-augmentation needs image inputs [batch, C, H, W], got shape "
                              f"{tuple(x.shape)}; use an image dataset (e.g. fashion-mnist)")
        b, c, h, w = x.shape
        k = codes.shape[1]
        p = self.pad
        if self.fill == "min":
            fill = x.flatten(1).min(dim=1).values.view(b, 1, 1, 1)
        else:
            fill = torch.full((b, 1, 1, 1), float(self.fill), dtype=x.dtype, device=x.device)
        xp = fill.expand(b, c, h + 2 * p, w + 2 * p).clone()
        xp[:, :, p:p + h, p:p + w] = x
        oy, ox, fl = (t.to(x.device) for t in self.decode(codes.flatten()))
        src = xp.repeat_interleave(k, dim=0)
        ar_h, ar_w = torch.arange(h, device=x.device), torch.arange(w, device=x.device)
        rows = oy.unsqueeze(1) + ar_h
        cols = torch.where(fl.unsqueeze(1), ox.unsqueeze(1) + (w - 1 - ar_w), ox.unsqueeze(1) + ar_w)
        n = torch.arange(b * k, device=x.device)
        out = src[n[:, None, None], :, rows[:, :, None], cols[:, None, :]]  # [bK, H, W, C]
        return out.permute(0, 3, 1, 2).contiguous()


class AugmentedGradients(RowSource):
    """Rows = the average of the gradients of K augmented copies of each example."""

    structured = False  # image tensors [b, c, h, w] only

    def __init__(self, model: nn.Module, loss_fn: LossFn, k: int, augment: CropFlip,
                 key: SecretKey | None = None) -> None:
        if not (isinstance(k, int) and k >= 1):
            raise ConfigError(f"`AlgoConfig.extra['K']` (K copies per example) must be an integer >= 1, got {k!r}")
        self.fg = FuncGradients(model, loss_fn)
        self.layout = self.fg.layout
        self.k, self.augment, self.key = k, augment, key

    def codes(self, keys: list[int], step: int) -> Tensor:
        return keyed_ints(self.key, Purpose.AUGMENT, step, keys, self.k, self.augment.choices)

    def rows(self, x: Tensor, y: Tensor, keys: list[int], step: int) -> tuple[Tensor, Tensor]:
        b = len(x)
        xa = self.augment(x, self.codes(keys, step))
        g, loss = self.fg(xa, y.repeat_interleave(self.k))
        return g.view(b, self.k, -1).mean(1), loss.view(b, self.k).mean(1)

    def iter_rows(self, x: Tensor, y: Tensor, indices: Tensor | None, step: int,
                  max_physical_batch: int) -> Iterator[tuple[Tensor, Tensor, Tensor | None]]:
        chunk = max(1, max_physical_batch // self.k)  # K copies per example in a physical batch
        for start in range(0, len(x), chunk):
            sl = slice(start, start + chunk)
            keys = batch_keys(indices, start, len(x[sl]))
            # the K copies of an example draw its keyed dropout masks (clipbias.randomness.forward)
            with forward.examples(indices[sl].repeat_interleave(self.k) if indices is not None else None):
                g, loss = self.rows(x[sl], y[sl], keys, step)
            yield g, loss, (indices[sl] if indices is not None else None)


AUG_K = Setting("K", 4, "an integer >= 1", integer(1), "--augmentations",
                help="augmented copies per example", aliases=("augmentations",))
AUG_PAD = Setting("pad", 2, "an integer >= 0", integer(0), "--aug-pad", help="crop padding in pixels")
AUG_FLIP = Setting("flip", True, "true or false", boolean, "--aug-flip/--no-aug-flip",
                   help="random horizontal flips (off for digits/letters)")
SETTINGS = (AUG_K, AUG_PAD, AUG_FLIP)


def augmented_source(model: nn.Module, loss_fn: LossFn, cfg, s: dict, *, n: int, batch_size: float,
                     key: SecretKey | None) -> AugmentedGradients:
    return AugmentedGradients(model, loss_fn, s["K"], CropFlip(s["pad"], s["flip"]), key)
