"""``build_run``: from a validated ``TrainConfig`` and its data to the moving parts of a run.

One place builds the model (seeded by ``--seed``), its BatchNorm variant and majority-vote
inference for BatchClipping, and the ``DPEngine`` (which calibrates the noise): ``clipbias train``,
``compare`` and ``diagnose`` all run exactly this.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from .. import algorithms
from ..config import AlgoConfig
from ..engine.core import DPEngine
from ..errors import ConfigError
from ..randomness import SecretKey
from .average import WeightAverage
from .config import TrainConfig
from .splits import Splits, build_model, device

Predict = Callable[[nn.Module, Tensor], Tensor]


@dataclass
class Run:
    """A run's model, engine and data; ``predict`` replaces the plain forward pass at evaluation."""

    cfg: TrainConfig
    splits: Splits
    model: nn.Module
    engine: DPEngine
    algo: algorithms.Algorithm
    device: torch.device
    predict: Predict | None = None
    ema: WeightAverage | None = None  # --ema: the average of the weights (post-processing)

    def evaluate(self, x: Tensor, y: Tensor) -> tuple[float, float | None]:
        return evaluate(self.model, x, y, self.cfg.eval_batch_size, self.predict)


def build_run(cfg: TrainConfig, splits: Splits, key: SecretKey | None = None) -> Run:
    """The model, the BatchClipping variant when the algorithm needs public features, the engine (its
    secret randomness under ``key`` when given: a tuning trial's, drawn from the tuning's key)."""
    dev = device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, tuple(splits.info["input_shape"]), splits.info["num_classes"]).to(dev)
    algo = algorithms.get(cfg.algo)
    algo_cfg, predict = cfg.algo_config(), None
    if algo.needs_public:  # BatchClipping (Xiao et al. Alg. 3): BatchNorm net, public features
        model, algo_cfg, predict = _batchclip(cfg, splits, model, algo, algo_cfg)
    engine = DPEngine(model, cfg.algo, n=splits.n, batch_size=cfg.batch_size, epochs=cfg.epochs,
                      epsilon=cfg.epsilon if algo.private else None,
                      noise_multiplier=cfg.noise_multiplier if algo.private else None,
                      delta=cfg.delta, accountant=cfg.accountant, dice_accounting=cfg.basis,
                      config=algo_cfg, max_physical_batch=cfg.max_physical_batch,
                      noise_seed=key if key is not None else cfg.key_seed, grad_path=cfg.grad_path,
                      bands=cfg.bands, sample_rate=public_rate(cfg, splits),
                      bands_strategy=cfg.strategy)
    ema = WeightAverage(model, cfg.ema) if cfg.ema is not None else None
    return Run(cfg, splits, model, engine, algo, dev, predict, ema)


def public_rate(cfg: TrainConfig, splits: Splits) -> float | None:
    """q = B / the training part's expected size when a keyed split made the realised size private (then q, the
    steps and the calibrated noise depend only on public numbers); None (q = B / n) otherwise."""
    expected = splits.info.get("n_expected", splits.n)
    return None if expected == splits.info.get("n_given", splits.n) else cfg.batch_size / expected


def _batchclip(cfg: TrainConfig, splits: Splits, model: nn.Module, algo: algorithms.Algorithm,
               algo_cfg: AlgoConfig) -> tuple[nn.Module, AlgoConfig, Predict]:
    """The BatchNorm variant of the model, the public features in the config, majority-vote inference."""
    if splits.public_x is None:
        raise ConfigError(f"`algo='{cfg.algo}'` needs `AlgoConfig.extra['public_size']` (public features)")
    algo_cfg = dataclasses.replace(algo_cfg, extra={**cfg.extra, "public": splits.public_x})
    st = algo.settings(algo_cfg)

    def predict(m: nn.Module, x: Tensor) -> Tensor:  # majority vote over public draws (App. E)
        return algorithms.batchclip_predict(m, x, splits.public_x, st["p"], st["draws"], seed=cfg.seed)
    return algorithms.batchnorm_variant(model), algo_cfg, predict


@torch.no_grad()
def evaluate(model: nn.Module, x: Tensor, y: Tensor, batch_size: int = 1024,
             predict: Callable[[nn.Module, Tensor], Tensor] | None = None) -> tuple[float, float | None]:
    """(accuracy, mean cross-entropy) over ``(x, y)``, in batches, in eval mode, without grad.

    ``predict(model, x) -> labels`` replaces the plain forward pass (BatchClipping's majority vote);
    the loss is then None.
    """
    was_training = model.training
    model.eval()
    correct, loss = 0, 0.0
    try:
        if predict is not None:
            for i in range(0, len(y), batch_size):
                correct += int((predict(model, x[i:i + batch_size]).to(y.device) == y[i:i + batch_size]).sum())
            return correct / max(len(y), 1), None
        for i in range(0, len(y), batch_size):
            out = model(x[i:i + batch_size])
            yb = y[i:i + batch_size]
            loss += float(nn.functional.cross_entropy(out, yb, reduction="sum"))
            correct += int((out.argmax(1) == yb).sum())
    finally:
        model.train(was_training)
    n = max(len(y), 1)
    return correct / n, loss / n
