"""The data of a run: load once, apply ``--subset``/``--public-size``/``--validation`` (the private
splits keyed by a secret key), move to the device, and compute scattering features for scatter models
(``Splits``, ``prepare_splits``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import algorithms
from ..data.catalog import Dataset, keyed_split, load_dataset
from ..errors import ClipbiasError, ConfigError
from ..randomness import Purpose, SecretKey
from .config import TrainConfig


@dataclass
class Splits:
    """Tensors ready for the model (scattering features for scatter models), on ``device``.

    Build once per command with :func:`prepare_splits` and pass to every :func:`train` call.
    """

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    x_val: Tensor | None
    y_val: Tensor | None
    info: dict  # dataset name, n_given and n_expected (public), n and num_val (realised, private), shapes, notes, ...
    public_x: Tensor | None = None

    @property
    def n(self) -> int:
        return int(self.y_train.shape[0])


def device(name: str) -> torch.device:
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("`device='cuda'`: CUDA is not available on this machine "
                              "(torch.cuda.is_available() is False); use `device='cpu'`")
        return torch.device("cuda")
    if name != "cpu":
        raise ConfigError(f"`device` must be cpu or cuda, got {name!r}")
    return torch.device("cpu")


def build_model(cfg: TrainConfig, ds_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """``--model`` for this data; a ConfigError naming both when they do not fit."""
    from ..models import build_model as build
    try:
        return build(cfg.model, ds_shape, num_classes)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(f"`model='{cfg.model}'` does not fit `data='{cfg.data}'` (per-example input "
                          f"shape {tuple(ds_shape)}): {exc}") from exc


def prepare_splits(cfg: TrainConfig, dataset: Dataset | None = None, key: SecretKey | None = None) -> Splits:
    """Load the data once (unless given), apply ``--subset``, ``--public-size``/``--public-source`` and
    ``--validation``, and turn images into scattering features for scatter models (cached on disk).

    The private splits (the validation part, examples held out) are keyed draws per example under
    ``key``: the run's key (``train`` passes it); by default the key of ``--reproducible-noise``'s seed,
    else a fresh key from the OS (``clipbias compare`` prepares one split this way for all its runs).
    Their sizes are expected sizes; the realised ones are private (``info``: ``n``, ``num_val``)."""
    key = key if key is not None else SecretKey.of(cfg.key_seed)
    dataset = _load(cfg) if dataset is None else _given(cfg, dataset)
    if cfg.subset is not None:  # the private data set IS the first K examples (the definition of the data)
        if cfg.subset > dataset.num_train:
            raise ConfigError(f"`subset` must be <= the {dataset.num_train} training examples, got {cfg.subset}")
        dataset = dataclasses.replace(dataset, x_train=dataset.x_train[:cfg.subset],
                                      y_train=dataset.y_train[:cfg.subset])
    n_given = dataset.num_train
    public_size = cfg.extra.get("public_size")
    if public_size is None and algorithms.get(cfg.algo).needs_public:
        raise ConfigError(f"`algo='{cfg.algo}'` needs public features: give `AlgoConfig.extra['public_size']` N "
                          f"(taken from the test split, or from the training split with `public_source='holdout'`)")
    public_x = None
    if public_size is not None and cfg.public_source == "test":  # public data, a public choice
        from ..algorithms import public_split
        if public_size >= len(dataset.y_test):
            raise ConfigError(f"`AlgoConfig.extra['public_size']` must be < the {len(dataset.y_test)} test examples, got "
                              f"{public_size}")
        public_x, dataset = public_split(dataset, public_size, "test", seed=cfg.split_seed)
    x_tr, x_te, public_x, features = _features(cfg, dataset, public_size, public_x)
    y_tr, parts = dataset.y_train, _parts(cfg, n_given, public_size, key)
    train, val, held = parts["train"], parts.get("val"), parts.get("held")
    x_va, y_va = (x_tr[val], y_tr[val]) if val is not None else (None, None)
    if held is not None:
        public_x = x_tr[held]
    x_tr, y_tr = x_tr[train], y_tr[train]
    dev = device(cfg.device)
    move = (lambda t: None if t is None else t.to(dev))
    expected = n_given - (cfg.validation or 0) - (public_size if public_size and cfg.public_source == "holdout" else 0)
    info = {"name": dataset.name, "n_given": n_given, "n_expected": expected, "n": int(len(y_tr)), "num_test": int(len(dataset.y_test)),
            "num_val": 0 if y_va is None else int(len(y_va)), "input_shape": list(dataset.input_shape),
            "num_classes": dataset.num_classes, "notes": dataset.notes,
            "preprocessing": dataset.preprocessing, "features": features,
            "subset": cfg.subset, "validation": cfg.validation, "public_size": public_size,
            "public_source": cfg.public_source if public_size else None,
            "num_public": None if public_x is None else int(len(public_x)), "model_key": model_key(cfg.model)}
    return Splits(move(x_tr), move(y_tr), move(x_te), move(dataset.y_test), move(x_va), move(y_va), info,
                  move(public_x))


def _load(cfg: TrainConfig) -> Dataset:
    try:
        return load_dataset(cfg.data, data_dir=cfg.data_dir, data_path=cfg.data_path)
    except ClipbiasError:
        raise
    except ValueError as exc:
        raise ConfigError(f"`data='{cfg.data}'`: {exc}") from exc


def _given(cfg: TrainConfig, dataset: Dataset) -> Dataset:
    if dataset.x_val is not None:
        raise ConfigError("the given dataset already holds a validation split (x_val): pass it without one and "
                          "ask for `TrainConfig.validation` K: the run draws that split with its "
                          "secret key")
    return dataset


def _parts(cfg: TrainConfig, n: int, public_size: int | None, key: SecretKey) -> dict[str, Tensor]:
    """Bool masks over the N training examples as given: ``train``, and ``val`` (``--validation K``: each
    example with probability K/N) and ``held`` (``--public-source holdout``: each example not in ``val``
    with probability P/(N - K)), each a keyed draw of the example's own (``data.keyed_split``)."""
    k = cfg.validation or 0
    held_out = public_size if (public_size is not None and cfg.public_source == "holdout") else 0
    if k + held_out >= n:
        asked = [f"`validation={k}`"] * bool(k) + \
            [f"`AlgoConfig.extra['public_size']={held_out}` (`public_source='holdout'`)"] * bool(held_out)
        raise ConfigError(f"{' plus '.join(asked)} must be smaller than the training split of {cfg.data} ({n} "
                          f"examples), leaving some for training")
    parts = {"train": torch.ones(n, dtype=torch.bool)}
    if k:
        parts["val"] = keyed_split(key, Purpose.VALIDATION_SPLIT, n, k / n)
        parts["train"] &= ~parts["val"]
    if held_out:
        parts["held"] = parts["train"] & keyed_split(key, Purpose.HOLDOUT, n, held_out / (n - k))
        parts["train"] &= ~parts["held"]
    for name, mask in parts.items():
        if not mask.any():
            raise ConfigError(f"the keyed split left the {name} part empty (its expected size is too small for "
                              f"{n} examples): ask for a larger `validation` / `AlgoConfig.extra['public_size']`, or use more data")
    return parts


def _features(cfg: TrainConfig, dataset: Dataset, public_size: int | None, public_x: Tensor | None):
    """(training inputs, test inputs, public test features or None, what the model reads): scattering
    features for scatter models, computed for the whole training set as given, before any keyed split,
    so that no cache entry depends on (or reveals) a split."""
    probe = build_model(cfg, dataset.input_shape, dataset.num_classes)
    x_tr, x_te = dataset.x_train, dataset.x_test
    if not hasattr(probe, "preprocess"):
        return x_tr, x_te, public_x, "raw"
    tag = dataset.name + (f"-sub{cfg.subset}" if cfg.subset else "")
    test_tag = f"{dataset.name}-test" + (f"-pub{public_size}" if public_x is not None else "")
    x_tr = probe.preprocess(x_tr, cache_key=f"{tag}-train")
    x_te = probe.preprocess(x_te, cache_key=test_tag)
    if public_x is not None:
        public_x = probe.preprocess(public_x, cache_key=f"{test_tag}-public")
    return x_tr, x_te, public_x, f"{type(probe).__name__}.preprocess (scattering, computed once per data set)"


def model_key(model: str) -> str:
    return "scatter" if model.startswith("scatter") else "raw"


def splits_for(cfg: TrainConfig, splits: Splits | None = None, dataset: Dataset | None = None,
               key: SecretKey | None = None) -> Splits:
    """``splits`` checked against ``cfg`` (prepared for another config: refused), or prepared now (their
    private splits keyed by ``key``, see :func:`prepare_splits`)."""
    if splits is None:
        splits = prepare_splits(cfg, dataset, key)
    else:
        if splits.info.get("model_key") != model_key(cfg.model):
            raise ConfigError(f"the prepared data are for {splits.info.get('model_key')} models, not "
                              f"`model='{cfg.model}'`; prepare them with prepare_splits for this model")
        public = cfg.extra.get("public_size")
        for name, want in (("subset", cfg.subset), ("validation", cfg.validation or 0), ("public_size", public),
                           ("public_source", cfg.public_source if public else None)):
            if splits.info.get(name) != want:
                raise ConfigError(f"the prepared data have {name}={splits.info.get(name)!r} but the run asks "
                                  f"for --{name.replace('_', '-')} {want!r}; prepare them for this config")
    if cfg.batch_size > splits.n:
        raise ConfigError(f"`batch_size` must lie in [1, N={splits.n}] (the expected batch cannot exceed the "
                          f"{splits.n} training examples), got {cfg.batch_size:g}")
    if cfg.validation and splits.x_val is None:
        raise ConfigError("`validation`: the prepared data hold no validation split")
    return splits
