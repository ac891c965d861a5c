"""BatchClipping with public features (Xiao et al. Section 5.2, Alg. 3; inference as in App. E).

A BatchNorm network sees each private example ``x_i`` together with ``p - 1`` public feature
vectors drawn (uniformly, with replacement, fresh per example and step) from a public pool
``x_pub``: ``f(w, x_i, x_pub, y_i) = loss(NW(w, [x_i, x_pub draws])[first row], y_i)`` (eq. (15)).
BatchNorm normalises over the group, so the gradient is not a per-example gradient of a fixed
function -- but it depends on the private data only through ``(x_i, y_i)``: the public rows carry
no private data, and no public *label* is ever read (the API takes features only). After
``clip(., C)`` one private example changes the sum by at most C: the standard Poisson-subsampled
Gaussian accounting over the private set only.

Inference (App. E): the model is a function of a group, so a test image is classified by running
it with ``p - 1`` random public features, 10 times, and taking the majority vote
(``batchclip_predict``). BatchNorm layers here never keep running statistics.

Public data must be disjoint from the private training set: ``public_split`` takes it from the
test split (the default, as the paper does with CIFAR10's test set; those images are then removed
from the evaluation set) or holds it out of the training split (``source="holdout"``, which shrinks
N, the accounting's dataset size).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from ..config import OPTIONAL, REQUIRED, Setting, integer
from ..errors import ConfigError
from ..grads.rows import FuncGradients, LossFn, RowSource
from ..randomness import Purpose, SecretKey, batch_keys, forward, keyed_ints
from ..step import Clip
from .base import Algorithm, Parts, register
from .p_avg import P_AVG


class GroupBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm over a group for inputs of any rank >= 2, always with the group's own statistics."""

    def __init__(self, num_features: int, eps: float = 1e-5, affine: bool = True) -> None:
        super().__init__(num_features, eps=eps, momentum=None, affine=affine, track_running_stats=False)

    def _check_input_dim(self, x: Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"GroupBatchNorm expects [batch, channels, ...], got shape {tuple(x.shape)}")


def batchnorm_variant(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every GroupNorm replaced by BatchNorm (no running statistics).

    E.g. ``batchnorm_variant(build_model("resnet20-gn", (1, 28, 28), 10))`` is ResNet20 with BN in
    the usual place: the network BatchClipping trains. Raises if the model has no GroupNorm.
    """
    model = copy.deepcopy(model)
    replaced = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.GroupNorm):
                bn = GroupBatchNorm(child.num_channels, eps=child.eps, affine=child.affine)
                if child.affine:
                    with torch.no_grad():
                        bn.weight.copy_(child.weight)
                        bn.bias.copy_(child.bias)
                setattr(module, child_name, bn.to(next(child.parameters(), torch.zeros(0)).device))
                replaced += 1
    if not replaced:
        raise ConfigError(f"{type(model).__name__} has no GroupNorm layer to turn into BatchNorm; "
                          f"batch-clip needs a normalised network such as resnet20-gn or cnn-gn")
    return model


def check_batchnorm_model(model: nn.Module) -> None:
    bns = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not bns:
        raise ConfigError("batch-clip (Xiao et al. Alg. 3) needs a BatchNorm network: convert yours with "
                          "clipbias.algorithms.batchnorm_variant(model) (GroupNorm -> BatchNorm)")
    for n, m in bns:
        if m.track_running_stats:
            raise ConfigError(f"BatchNorm layer '{n}' keeps running statistics (updated from batches of "
                              f"private data, and not vmap-safe); build it with track_running_stats=False "
                              f"or use clipbias.algorithms.batchnorm_variant(model)")


def check_public(public: object, input_shape: tuple[int, ...] | None = None) -> Tensor:
    if not isinstance(public, Tensor) or public.dim() < 2 or len(public) < 1:
        raise ConfigError("batch-clip needs public features: AlgoConfig.extra['public'] must be a tensor "
                          "[n_public, *input_shape] of features (no labels), e.g. from "
                          "clipbias.algorithms.public_split(dataset, 100)")
    if input_shape is not None and tuple(public.shape[1:]) != tuple(input_shape):
        raise ConfigError(f"public features have shape {tuple(public.shape[1:])} per example but the "
                          f"private inputs have {tuple(input_shape)}; take them from the same data set")
    return public


def public_split(dataset, n_public: int = 100, source: str = "test", seed: int = 0, key: SecretKey | None = None):
    """``(public_features, dataset_without_them)``: public data disjoint from the private set.

    ``source="test"``: ``n_public`` random images of the *test* split (labels dropped; chosen by the public
    ``seed``: the test split is public); they are removed from the returned dataset's test split, so
    evaluation never scores an image the model saw as a public feature. ``source="holdout"``: about
    ``n_public`` training examples held out by keyed draws under ``key`` (``clipbias.data.holdout``), so
    the private N shrinks; they are private data that nothing protects (``HOLDOUT_CAVEAT``).
    """
    if not (isinstance(n_public, int) and n_public >= 1):
        raise ConfigError(f"`AlgoConfig.extra['public_size']` must be an integer >= 1, got {n_public!r}")
    if source == "holdout":
        from ..data.catalog import holdout
        if key is None:
            raise ConfigError("public_split(source='holdout') needs key=: the SecretKey whose draws choose the "
                              "held-out training examples (the run's key)")
        rest, x_pub = holdout(dataset, n_public, key)
        return x_pub, rest
    if source != "test":
        raise ConfigError(f"`public_source` must be 'test' or 'holdout', got {source!r}")
    n_test = len(dataset.x_test)
    if n_public >= n_test:
        raise ConfigError(f"`AlgoConfig.extra['public_size']={n_public}` must be below the test split size {n_test}")
    perm = torch.from_numpy(np.random.default_rng(seed).permutation(n_test))
    taken, keep = perm[:n_public].sort().values, perm[n_public:].sort().values
    rest = dataclasses.replace(
        dataset, x_test=dataset.x_test[keep], y_test=dataset.y_test[keep],
        notes=(dataset.notes + f" {n_public} test images used as public features (seed {seed}) and "
               f"removed from the test split.").strip())
    return dataset.x_test[taken], rest


def draw_groups(x: Tensor, public: Tensor, p: int, key: SecretKey, purpose: int, step: int,
                keys: list[int]) -> Tensor:
    """``[b, p, *input]``: each x_i first, then p - 1 public features drawn for key i."""
    idx = keyed_ints(key, purpose, step, keys, p - 1, len(public)).to(public.device)
    pub = public[idx.flatten()].view(len(x), p - 1, *public.shape[1:]).to(x)
    return torch.cat([x.unsqueeze(1), pub], dim=1)


class BatchClipGradients(RowSource):
    """Rows = gradients of the private example's loss through a BatchNorm network run on its group."""

    structured = False  # groups stack tensor inputs with public features

    def __init__(self, model: nn.Module, loss_fn: LossFn, public: Tensor, p: int,
                 key: SecretKey | None = None) -> None:
        check_batchnorm_model(model)
        self.public = check_public(public, getattr(model, "input_shape", None))
        if not (isinstance(p, int) and p >= 2):
            raise ConfigError(f"`AlgoConfig.extra['p']` (BatchClipping group size: 1 private + p-1 public) must be an integer "
                              f">= 2, got {p!r}")
        self.fg = FuncGradients(model, loss_fn, grouped=True, check=False)
        self.layout = self.fg.layout
        self.p, self.key = p, key

    def groups(self, x: Tensor, keys: list[int], step: int) -> Tensor:
        return draw_groups(x, self.public, self.p, self.key, Purpose.PUBLIC, step, keys)

    def iter_rows(self, x: Tensor, y: Tensor, indices: Tensor | None, step: int,
                  max_physical_batch: int) -> Iterator[tuple[Tensor, Tensor, Tensor | None]]:
        chunk = max(1, max_physical_batch // self.p)  # p inputs per private example
        for start in range(0, len(x), chunk):
            sl = slice(start, start + chunk)
            keys = batch_keys(indices, start, len(x[sl]))
            with forward.examples(indices[sl] if indices is not None else None):  # a group draws its example's masks
                g, loss = self.fg(self.groups(x[sl], keys, step), y[sl])
            yield g, loss, (indices[sl] if indices is not None else None)


@torch.no_grad()
def batchclip_logits(model: nn.Module, x: Tensor, public: Tensor, p: int, draw: int = 0, seed: int = 0,
                     chunk: int = 256) -> Tensor:
    """Logits of each ``x_i`` run with ``p - 1`` public features (draw number ``draw``). The draws of
    inference are not secret (public features for evaluation inputs): keyed by the public ``seed``."""
    check_public(public)
    key = SecretKey.from_seed(seed)
    params = {n: t.detach() for n, t in model.named_parameters()}
    buffers = dict(model.named_buffers())
    run = vmap(lambda xg: functional_call(model, (params, buffers), (xg,))[0], randomness="different")
    out = []
    for start in range(0, len(x), chunk):
        xs = x[start:start + chunk]
        keys = list(range(start, start + len(xs)))
        out.append(run(draw_groups(xs, public, p, key, Purpose.PREDICT, draw, keys)))
    return torch.cat(out) if out else torch.zeros(0)


@torch.no_grad()
def batchclip_predict(model: nn.Module, x: Tensor, public: Tensor, p: int, draws: int = 10,
                      seed: int = 0, chunk: int = 256) -> Tensor:
    """Majority vote over ``draws`` predictions, each with fresh public features (App. E).

    Ties go to the smallest class index.
    """
    if not (isinstance(draws, int) and draws >= 1):
        raise ConfigError(f"`AlgoConfig.extra['draws']` must be an integer >= 1, got {draws!r}")
    votes = torch.stack([batchclip_logits(model, x, public, p, r, seed, chunk).argmax(1)
                         for r in range(draws)], dim=1)  # [n, draws]
    num_classes = int(votes.max()) + 1 if votes.numel() else 1
    counts = torch.zeros(len(x), num_classes, dtype=torch.long)
    counts.scatter_add_(1, votes.cpu(), torch.ones_like(votes.cpu()))
    return counts.argmax(1)  # first maximum: the smallest tied class


PUBLIC_FEATURES = Setting("public", REQUIRED, "a tensor [n_public, *input_shape] of public features (no labels)",
                          lambda v: isinstance(v, Tensor) and v.dim() >= 2 and len(v) >= 1,
                          "--public-size/--public-source",
                          help="public features disjoint from the private set, e.g. "
                               "clipbias.algorithms.public_split(dataset, 100)[0]", aliases=("public_x",), cli=False)
PUBLIC_SIZE = Setting("public_size", OPTIONAL, "an integer >= 1", integer(1), "--public-size",
                      help="N public features (no labels), taken from --public-source")
DRAWS = Setting("draws", 10, "an integer >= 1", integer(1), "--vote-draws",
                help="public draws per test image in the majority vote at inference")

register(Algorithm(
    "batch-clip", "BatchClipping: BatchNorm network on groups with public features (Xiao et al. Alg. 3)",
    True, "gaussian", lambda cfg, s, b, key: Parts([Clip(cfg.clip)]),
    schema=(P_AVG, PUBLIC_FEATURES, DRAWS, PUBLIC_SIZE),
    source=lambda model, loss_fn, cfg, s, *, n, batch_size, key: BatchClipGradients(
        model, loss_fn, s["public"], s["p"], key),
    note=lambda cfg, s: (
        f"per-example L2 sensitivity {cfg.clip:g} (clip C); the clipped group gradient of a private example "
        f"depends on it and on {s['p'] - 1} public features only (no public labels); the accounting covers "
        f"the private set (N) only")))
