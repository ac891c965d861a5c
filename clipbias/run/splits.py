"""The data of a run: load once, apply ``--validation``/``--subset``/``--public-size``, move to
the device, and compute scattering features for scatter models (``Splits``, ``prepare_splits``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import algorithms
from ..data.datasets import Dataset, load_dataset
from ..errors import ClipbiasError, ConfigError
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
    info: dict  # dataset name, n, shapes, notes, preprocessing_private, features
    public_x: Tensor | None = None

    @property
    def n(self) -> int:
        return int(self.y_train.shape[0])


def device(name: str) -> torch.device:
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: CUDA is not available on this machine "
                              "(torch.cuda.is_available() is False); use --device cpu")
        return torch.device("cuda")
    if name != "cpu":
        raise ConfigError(f"--device must be cpu or cuda, got {name!r}")
    return torch.device("cpu")


def build_model(cfg: TrainConfig, ds_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """``--model`` for this data; a ConfigError naming both when they do not fit."""
    from ..models import build_model as build
    try:
        return build(cfg.model, ds_shape, num_classes)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(f"--model {cfg.model} does not fit --data {cfg.data} (per-example input "
                          f"shape {tuple(ds_shape)}): {exc}") from exc


def prepare_splits(cfg: TrainConfig, dataset: Dataset | None = None) -> Splits:
    """Load the data once (unless given), apply ``--validation``/``--subset``/``--public-size``,
    and turn images into scattering features for scatter models (once per split, cached on disk)."""
    if dataset is None:
        try:
            dataset = load_dataset(cfg.data, data_dir=cfg.data_dir, validation=cfg.validation,
                                   seed=cfg.split_seed, data_path=cfg.data_path)
        except ClipbiasError:
            raise
        except ValueError as exc:  # e.g. a validation split larger than the training set
            if cfg.validation:
                raise ConfigError(f"--validation {cfg.validation} must be smaller than the training "
                                  f"split of {cfg.data} ({exc})") from exc
            raise ConfigError(f"--data {cfg.data}: {exc}") from exc
    elif cfg.validation and (dataset.x_val is None or len(dataset.y_val) != cfg.validation):
        raise ConfigError(f"--validation {cfg.validation}: the given dataset has no validation split "
                          f"of that size")
    public_x = None
    public_size = cfg.extra.get("public_size")
    if public_size is None and algorithms.get(cfg.algo).needs_public:
        raise ConfigError(f"--algo {cfg.algo} needs public features: give --public-size N (taken from "
                          f"the test split, or from the training split with --public-source holdout)")
    if public_size is not None:
        from ..algorithms import public_split
        limit = dataset.num_train if cfg.public_source == "holdout" else len(dataset.y_test)
        if public_size >= limit:
            raise ConfigError(f"--public-size must be < the {limit} {cfg.public_source} examples, "
                              f"got {public_size}")
        public_x, dataset = public_split(dataset, public_size, cfg.public_source, seed=cfg.split_seed)
    x_tr, y_tr = dataset.x_train, dataset.y_train
    if cfg.subset is not None:
        if cfg.subset > len(y_tr):
            raise ConfigError(f"--subset must be <= the {len(y_tr)} training examples, got {cfg.subset}")
        x_tr, y_tr = x_tr[:cfg.subset], y_tr[:cfg.subset]
    x_te, y_te, x_va, y_va = dataset.x_test, dataset.y_test, dataset.x_val, dataset.y_val

    probe = build_model(cfg, dataset.input_shape, dataset.num_classes)
    features = "raw"
    if hasattr(probe, "preprocess"):
        features = f"{type(probe).__name__}.preprocess (scattering, computed once per split)"
        tag = dataset.name + (f"-sub{cfg.subset}" if cfg.subset else "") + (
            f"-val{cfg.validation}" if cfg.validation else "") + (f"-pub{public_size}" if public_size else "")
        x_tr = probe.preprocess(x_tr, cache_key=f"{tag}-train")
        x_te = probe.preprocess(x_te, cache_key=f"{dataset.name}-test" + (
            f"-pub{public_size}" if public_size and cfg.public_source == "test" else ""))
        if x_va is not None:
            x_va = probe.preprocess(x_va, cache_key=f"{tag}-val")
        if public_x is not None:
            public_x = probe.preprocess(public_x, cache_key=f"{tag}-public")
    dev = device(cfg.device)
    move = (lambda t: None if t is None else t.to(dev))
    info = {"name": dataset.name, "n": int(len(y_tr)), "num_test": int(len(y_te)),
            "num_val": 0 if y_va is None else int(len(y_va)), "input_shape": list(dataset.input_shape),
            "num_classes": dataset.num_classes, "notes": dataset.notes,
            "preprocessing": dataset.preprocessing, "features": features,
            "subset": cfg.subset, "validation": cfg.validation, "public_size": public_size,
            "public_source": cfg.public_source if public_size else None,
            "model_key": model_key(cfg.model)}
    return Splits(move(x_tr), move(y_tr), move(x_te), move(y_te), move(x_va), move(y_va), info,
                  move(public_x))


def model_key(model: str) -> str:
    return "scatter" if model.startswith("scatter") else "raw"


def splits_for(cfg: TrainConfig, splits: Splits | None = None, dataset: Dataset | None = None) -> Splits:
    """``splits`` checked against ``cfg`` (prepared for another config: refused), or prepared now."""
    if splits is None:
        splits = prepare_splits(cfg, dataset)
    else:
        if splits.info.get("model_key") != model_key(cfg.model):
            raise ConfigError(f"the prepared data are for {splits.info.get('model_key')} models, not "
                              f"--model {cfg.model}; prepare them with prepare_splits for this model")
        for key in ("subset", "validation", "public_size"):
            want = cfg.extra.get(key) if key == "public_size" else getattr(cfg, key)
            if splits.info.get(key) != (want or (0 if key == "validation" else None)):
                raise ConfigError(f"the prepared data have {key}={splits.info.get(key)!r} but the run asks "
                                  f"for --{key.replace('_', '-')} {want!r}; prepare them for this config")
    if cfg.batch_size > splits.n:
        raise ConfigError(f"--batch-size must lie in [1, N={splits.n}] (the expected batch cannot exceed the "
                          f"{splits.n} training examples), got {cfg.batch_size:g}")
    if cfg.validation and splits.x_val is None:
        raise ConfigError("--validation: the prepared data hold no validation split")
    return splits
