"""ScatterNet features (2-D wavelet scattering, J=2, L=8) and the trainable heads of
Tramer & Boneh 2021 ("Differentially Private Learning Needs Better Features").

The scattering transform has no trainable parameter, so it is computed ONCE per data
split (:meth:`ScatterFeatures.compute`, optionally cached on disk) and the model that
DP-SGD trains is only the head, taking features of shape ``(81*C, H/4, W/4)``.

Normalisation: Tramer & Boneh normalise features with (privately estimated) data
statistics or GroupNorm. Here only GroupNorm(27 groups, no affine) is used: it
normalises each example on its own, so it uses no data statistic and is DP-safe.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from pathlib import Path

import torch
from torch import Tensor, nn

from clipbias.data.catalog import cache_dir
from clipbias.errors import ConfigError, require

__all__ = ["ScatterFeatures", "ScatterLinear", "ScatterCNN"]


class ScatterFeatures:
    """Batched, gradient-free 2-D scattering transform (kymatio) with an on-disk cache.

    Maps images ``(N, C, H, W)`` (or ``(N, H, W)``) to ``(N, C*K, H/2^J, W/2^J)`` with
    ``K = 1 + J*L + L^2*J*(J-1)/2`` (81 for J=2, L=8), i.e. 81x7x7 for 28x28 input.
    Not an ``nn.Module`` on purpose: it holds no trainable state and must not end up
    in a model's parameters or state dict.
    """

    def __init__(self, image_shape: tuple[int, int], J: int = 2, L: int = 8,
                 chunk_size: int = 1024) -> None:
        self.image_shape = (int(image_shape[0]), int(image_shape[1]))
        self.J, self.L, self.chunk_size = J, L, chunk_size
        self._scattering: nn.Module | None = None

    @property
    def channels_per_input(self) -> int:
        """Number of scattering channels per input channel (81 for J=2, L=8)."""
        return 1 + self.J * self.L + self.L ** 2 * self.J * (self.J - 1) // 2

    def output_shape(self, in_channels: int = 1) -> tuple[int, int, int]:
        """Per-example feature shape for ``in_channels`` input channels."""
        h, w = self.image_shape
        s = 2 ** self.J
        return (in_channels * self.channels_per_input, math.ceil(h / s), math.ceil(w / s))

    def _module(self, device: torch.device) -> nn.Module:
        if self._scattering is None:
            # kymatio.torch pulls in the 3-D frontend, which imports a SciPy function
            # removed in recent SciPy; the 2-D torch frontend imports cleanly.
            frontend = require("kymatio.scattering2d.frontend.torch_frontend", "computing the scattering "
                               "features of the scatter models (scatter-linear, scatter-cnn)")
            self._scattering = frontend.ScatteringTorch2D(J=self.J, shape=self.image_shape, L=self.L)
        return self._scattering.to(device)

    @torch.no_grad()
    def compute(self, x: Tensor) -> Tensor:
        """Scattering features of a batch of images, computed in chunks to bound memory."""
        if x.dim() == 3:
            x = x.unsqueeze(1)
        if x.dim() != 4 or tuple(x.shape[-2:]) != self.image_shape:
            raise ValueError(f"expected images (N, C, {self.image_shape[0]}, "
                             f"{self.image_shape[1]}), got {tuple(x.shape)}")
        n, c = x.shape[:2]
        scat = self._module(x.device)
        out = torch.empty(n, *self.output_shape(c), dtype=torch.float32, device=x.device)
        from tqdm.auto import tqdm
        starts = range(0, n, self.chunk_size)
        # minutes on a CPU for Fashion-MNIST: a bar on a terminal (disable=None: none when piped)
        for i in tqdm(starts, desc=f"scattering features of {n} images (once, then cached)", unit="chunk",
                      leave=False, disable=None if len(starts) > 4 else True):
            chunk = x[i:i + self.chunk_size].float().contiguous()
            out[i:i + chunk.shape[0]] = scat(chunk).reshape(chunk.shape[0], *out.shape[1:])
        return out

    def cache_path(self, x: Tensor, key: str) -> Path:
        """Cache file for ``x`` under ``key`` (e.g. "fashion-mnist-train"): the name holds
        the key, J, L, the shape and a hash of the data, so other data never hits it."""
        digest = hashlib.blake2b(x.detach().cpu().contiguous().numpy().tobytes(),
                                 digest_size=8).hexdigest()
        shape = "x".join(str(s) for s in x.shape)
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in key)
        return cache_dir() / "scatter" / f"{safe}-J{self.J}-L{self.L}-{shape}-{digest}.pt"

    def cached(self, x: Tensor, key: str | None) -> Tensor:
        """:meth:`compute`, loading from / saving to the disk cache when ``key`` is given."""
        if key is None:
            return self.compute(x)
        path = self.cache_path(x, key)
        if path.is_file():
            try:
                return torch.load(path, weights_only=True).to(x.device)
            except Exception:  # damaged cache: recompute and overwrite
                pass
        feats = self.compute(x)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            torch.save(feats.cpu(), tmp)
            os.replace(tmp, path)
        except OSError as e:  # caching is an optimisation only
            print(f"scattering features of {len(x)} images ({key}): not cached ({e})", file=sys.stderr)
        else:
            print(f"scattering features of {len(x)} images ({key}): cached in {path} "
                  f"({path.stat().st_size / 2**20:.0f} MB; `clipbias cache` shows the cache, "
                  f"`clipbias cache --clear` deletes it)", file=sys.stderr, flush=True)
        return feats


class _ScatterHead(nn.Module):
    """Shared plumbing: scattering set-up and the once-per-split ``preprocess``."""

    def __init__(self, input_shape: tuple[int, ...], J: int, L: int) -> None:
        super().__init__()
        if len(input_shape) == 2:
            input_shape = (1, *input_shape)
        if len(input_shape) != 3:
            raise ConfigError(f"scatter models need image input (C, H, W), got {input_shape}")
        self.raw_input_shape = tuple(input_shape)
        self.scatter = ScatterFeatures(tuple(input_shape[1:]), J=J, L=L)
        # what forward() takes per example: scattering features, not images
        self.input_shape = self.scatter.output_shape(input_shape[0])

    def preprocess(self, x_all: Tensor, cache_key: str | None = None) -> Tensor:
        """Images -> scattering features. Call ONCE per data split (train/val/test) before
        training, outside the per-example gradient computation; with ``cache_key`` the
        result is cached on disk."""
        return self.scatter.cached(x_all, cache_key)

    def feature_transform(self, x: Tensor) -> Tensor:
        """Alias of :meth:`preprocess` without caching, for trainers that look for it."""
        return self.scatter.compute(x)

    def _features(self, x: Tensor) -> Tensor:
        return self.norm(x.reshape(x.shape[0], *self.input_shape))


class ScatterLinear(_ScatterHead):
    """ScatterNet + linear model (Tramer & Boneh 2021): GroupNorm(27, no affine) on the
    81-channel features, then one Linear layer. Takes features, not images."""

    PER_EXAMPLE = True  # forward composes its children example by example (reviewed; grads.separable)

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, J: int = 2, L: int = 8,
                 num_groups: int = 27) -> None:
        super().__init__(input_shape, J, L)
        self.norm = nn.GroupNorm(num_groups, self.input_shape[0], affine=False)
        self.fc = nn.Linear(math.prod(self.input_shape), num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self._features(x).flatten(1))


class ScatterCNN(_ScatterHead):
    """ScatterNet + CNN head for (Fashion-)MNIST, as in Tramer & Boneh's code
    (``ftramer/Handcrafted-DP``, ``MNIST_CNN`` on scattering input): GroupNorm(27, no
    affine) -> Conv(16, 3x3, s2, p1) -> tanh -> Conv(32, 3x3, s1, p1) -> tanh ->
    Flatten -> Linear(32) -> tanh -> Linear(num_classes). Takes features, not images."""

    PER_EXAMPLE = True  # forward composes its children example by example (reviewed; grads.separable)

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, J: int = 2, L: int = 8,
                 num_groups: int = 27, channels: tuple[int, int] = (16, 32)) -> None:
        super().__init__(input_shape, J, L)
        c1, c2 = channels
        self.norm = nn.GroupNorm(num_groups, self.input_shape[0], affine=False)
        self.features = nn.Sequential(
            nn.Conv2d(self.input_shape[0], c1, 3, stride=2, padding=1), nn.Tanh(),
            nn.Conv2d(c1, c2, 3, stride=1, padding=1), nn.Tanh(), nn.Flatten())
        with torch.no_grad():
            flat = self.features(torch.zeros(1, *self.input_shape)).shape[1]
        self.classifier = nn.Sequential(nn.Linear(flat, 32), nn.Tanh(), nn.Linear(32, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(self._features(x)))
