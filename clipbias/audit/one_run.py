"""The one-run audit (Steinke, Nasr & Jagielski 2023): m canaries, one real training run.

Each of ``m`` canaries is included in the training set independently with probability 1/2; one run
of the algorithm (a real ``DPEngine`` on a real model and data set) trains on the real examples plus
the included canaries; the auditor scores every canary, guesses "in" for the ``k`` highest scores,
and the number of right guesses gives an epsilon lower bound (every ``k`` on the ROC hull tried,
Bonferroni over them; ``estimators``).

* ``gradient`` canaries (white-box): canary j's per-example gradient is ``norm * e_{c_j}`` on its own
  random coordinate c_j (a Dirac gradient, inserted in the engine's per-example rows by
  ``CanaryGradients``); score: ``theta_0[c_j] - theta_T[c_j]``, the released updates' sum along c_j,
  divided by the spread of the updates of c_j's parameter tensor.
  For algorithms whose rows are per-example gradients (no row backend of their own).
* ``input`` canaries (black-box): held-out test images with random labels; score: minus the final
  model's loss on them. Any algorithm.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from .. import algorithms, privacy
from ..errors import ConfigError
from ..grads.rows import FuncGradients, cross_entropy
from ..privacy.report import check_delta, check_positive
from .estimators import one_run_estimate


@dataclass(frozen=True)
class OneRunAudit:
    algo: str
    noise_multiplier: float
    batch_size: float | None              # None: full batch (every example, canaries included, each step)
    steps: int
    canaries: int = 1000
    canary_type: str = "gradient"
    data: str = "fashion-mnist"
    model: str = "cnn"
    lr: float = 4.0
    clip: float = 0.1
    momentum: float = 0.9
    ef_clip: float | None = None
    canary_norm: float | None = None      # gradient canaries: default 10 C1 (clipped to C1)
    delta: float = 1e-5
    dice_accounting: str = privacy.DEFAULT_DICE_ACCOUNTING
    claim_noise_multiplier: float | None = None
    confidence: float = 0.95
    seed: int = 0
    subset: int | None = None
    grad_path: str = "auto"               # rows | fast | auto, as in clipbias train
    bands: int = 1                        # banded noise, as in clipbias train --bands

    def __post_init__(self) -> None:
        check_positive(self.noise_multiplier, "noise_multiplier")
        check_delta(self.delta)
        if self.canary_type not in ("gradient", "input"):
            raise ConfigError(f"`canary_type` must be gradient or input, got {self.canary_type!r}")
        if not (isinstance(self.canaries, int) and self.canaries >= 20):
            raise ConfigError(f"`canaries` must be an integer >= 20, got {self.canaries!r}")
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ConfigError(f"`steps` must be an integer >= 1, got {self.steps!r}")
        self.basis  # noqa: B018  (checked here, where the setting enters)

    @property
    def basis(self) -> privacy.DiceBasis:
        """The error-feedback basis whose claim is tested (``dice_accounting``, checked when made)."""
        return privacy.dice.basis(self.dice_accounting)


class CanaryGradients:
    """Per-example rows of ``inner`` for real examples; a Dirac row ``norm * e_{c_j}`` for canary j.

    Canaries are marked by negative labels ``y = -1 - j`` (their inputs are ignored), so the engine's
    ordinary Poisson sampling and micro-batching carry them like any example.
    """

    def __init__(self, inner: FuncGradients, coords: Tensor, norm: float) -> None:
        self.inner, self.layout = inner, inner.layout
        self.coords, self.norm = coords, float(norm)

    def __call__(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        is_canary = y < 0
        rows = torch.zeros(len(y), self.layout.dim, device=x.device)
        losses = torch.zeros(len(y), device=x.device)
        real = (~is_canary).nonzero().flatten()
        if len(real):
            g, loss = self.inner(x[real], y[real])
            rows[real], losses[real] = g, loss
        can = is_canary.nonzero().flatten()
        rows[can, self.coords.to(x.device)[-1 - y[can]]] = self.norm
        return rows, losses


def one_run_audit(a: OneRunAudit, *, progress: bool = False, splits=None) -> dict:
    """Train once with the canaries, score them, and bound epsilon from below."""
    from ..engine.core import DPEngine, run_steps
    from ..run import TrainConfig, evaluate, prepare_splits

    algo = algorithms.get(a.algo)
    if not algo.private:
        raise ConfigError(f"`algo='{a.algo}'` is not private (epsilon = inf): there is no claim to audit")
    if a.canary_type == "gradient" and algo.source is not None:
        raise ConfigError(f"`algo='{a.algo}'` computes its rows with its own row source: gradient canaries cannot "
                          f"be inserted; use `canary_type='input'`")
    cfg = TrainConfig(data=a.data, model=a.model, algo=a.algo, noise_multiplier=a.noise_multiplier,
                      batch_size=a.batch_size or 1.0, lr=a.lr, clip=a.clip, ef_clip=a.ef_clip, momentum=a.momentum,
                      delta=a.delta, dice_accounting=a.dice_accounting, subset=a.subset, seed=a.seed,
                      extra={"public_size": 100} if algo.needs_public else {})
    splits = splits or prepare_splits(cfg)
    gen = torch.Generator().manual_seed(a.seed)
    inside = torch.rand(a.canaries, generator=gen) < 0.5
    model, algo_cfg, logits = _model(a, cfg, splits, algo)
    c = _canaries(a, splits, model, inside, gen)
    x_all, y_all = torch.cat([splits.x_train, c["x"]]), torch.cat([splits.y_train, c["y"]])
    batch = float(len(y_all)) if a.batch_size is None else a.batch_size
    engine = DPEngine(model, a.algo, n=len(y_all), batch_size=batch, steps=a.steps,
                      noise_multiplier=a.noise_multiplier, delta=a.delta, dice_accounting=a.basis,
                      config=algo_cfg, grads=c["grads"], grad_path=a.grad_path, bands=a.bands)
    layout = engine.rows.layout
    theta0 = torch.cat([p.detach().flatten() for p in layout.params(model)]).clone()
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=a.steps, unit="step", mininterval=1.0, leave=False, desc=f"one-run {a.algo}")
    run_steps(engine, x_all, y_all, after=(lambda e, losses: bar.update(1)) if bar is not None else None)
    if bar is not None:
        bar.close()
    if a.canary_type == "gradient":
        # the total update along each canary's coordinate, in units of the spread of its parameter
        # tensor's updates (real training moves layers by very different amounts; a function of the
        # released model only, so the guesses stay valid)
        moved = theta0 - torch.cat([p.detach().flatten() for p in layout.params(model)])
        spread = torch.cat([t.std().expand(len(t)) for t in torch.split(moved, layout.numels)])
        scores = moved[c["coords"]] / spread[c["coords"]].clamp_min(1e-12)
    else:
        with torch.no_grad():
            model.eval()
            scores = -torch.nn.functional.cross_entropy(logits(c["can_x"]), c["can_y"], reduction="none")
    acc, _ = evaluate(model, c["x_test"], c["y_test"],
                      predict=(lambda m, x: logits(x).argmax(1)) if algo.needs_public else None)
    best = _estimates(scores, inside, a)
    spec = algo.spec(engine.config, engine.sample_rate, a.claim_noise_multiplier or a.noise_multiplier,
                     engine.expected_batch_size, a.bands)
    rep = privacy.account(spec, a.steps, a.delta, "pld", a.basis)
    m = a.canaries
    return {**best, "epsilon_claimed": rep.epsilon, "certified": rep.certified, "basis": rep.basis,
            "refuted": best["epsilon_lower_bound"] > rep.epsilon, "confidence": a.confidence,
            "method": f"one-run ({a.canary_type} canaries; Steinke, Nasr & Jagielski 2023; "
                      f"f-DP: Mahloujifar, Melis & Chaudhuri 2024)",
            "canaries": m, "included": int(inside.sum()), "delta": a.delta, "test_accuracy": acc,
            "settings": asdict(a), "sample_rate": engine.sample_rate,
            "score_gap": float(scores[inside].mean() - scores[~inside].mean())
            if 0 < int(inside.sum()) < m else math.nan, "score_std": float(scores.std())}


def _model(a: OneRunAudit, cfg, splits, algo: algorithms.Algorithm):
    """(model, its AlgoConfig, the logits function): BatchClipping gets the BatchNorm variant and
    group logits with public features from the test split (App. E)."""
    from ..run.splits import build_model
    torch.manual_seed(a.seed)
    model = build_model(cfg, tuple(splits.info["input_shape"]), splits.info["num_classes"])
    if not algo.needs_public:
        return model, cfg.algo_config(), model
    model = algorithms.batchnorm_variant(model)
    algo_cfg = dataclasses.replace(cfg.algo_config(), extra={**cfg.extra, "public": splits.public_x})
    p_group = algo.settings(algo_cfg)["p"]
    return model, algo_cfg, lambda x: algorithms.batchclip_logits(model, x, splits.public_x, p_group, seed=a.seed)


def _canaries(a: OneRunAudit, splits, model, inside: Tensor, gen: torch.Generator) -> dict:
    """The included canaries (``x``, ``y``, and the gradient backend for gradient canaries), all
    canaries for scoring, and the test split left for evaluation."""
    m, x_test, y_test = a.canaries, splits.x_test, splits.y_test
    if a.canary_type == "gradient":
        inner = FuncGradients(model, cross_entropy)
        coords = torch.randperm(inner.layout.dim, generator=gen)[:m]
        if len(coords) < m:
            raise ConfigError(f"`canaries={m}` exceeds the model's {inner.layout.dim} parameters")
        ids = inside.nonzero().flatten()
        return {"x": torch.zeros(len(ids), *splits.x_train.shape[1:]), "y": -1 - ids, "coords": coords,
                "grads": CanaryGradients(inner, coords, a.canary_norm or 10 * a.clip),
                "x_test": x_test, "y_test": y_test}
    if m >= len(y_test):
        raise ConfigError(f"`canaries={m}` must be below the {len(y_test)} test examples")
    perm = torch.randperm(len(y_test), generator=gen)
    can_x, keep = x_test[perm[:m]], perm[m:]
    can_y = torch.randint(0, splits.info["num_classes"], (m,), generator=gen)
    return {"x": can_x[inside], "y": can_y[inside], "grads": None, "can_x": can_x, "can_y": can_y,
            "x_test": x_test[keep], "y_test": y_test[keep]}


def _estimates(scores: Tensor, inside: Tensor, a: OneRunAudit) -> dict:
    """Both one-run bounds from the canaries' scores (one-sided guesses, every threshold)."""
    s = scores.detach().double().cpu().numpy()
    ins = inside.cpu().numpy()
    if ins.all() or not ins.any():
        return {"epsilon_lower_bound": 0.0, "epsilon_lower_bound_fdp": 0.0, "guesses": 0, "correct": 0}
    kw = dict(delta=a.delta, significance=1 - a.confidence)
    plain = one_run_estimate(s[ins], s[~ins], method="one-run", **kw)
    fdp = one_run_estimate(s[ins], s[~ins], method="one-run-fdp", **kw)
    return {"epsilon_lower_bound": plain["epsilon_lower_bound"], "guesses": plain["guesses"],
            "correct": plain["correct"], "epsilon_lower_bound_fdp": fdp["epsilon_lower_bound"],
            "guesses_fdp": fdp["guesses"], "correct_fdp": fdp["correct"]}


def run_from_args(args) -> dict:
    """``clipbias audit --mode one-run``: B from --batch-size, else q times the training-set size."""
    from ..run import TrainConfig, prepare_splits
    lr = args.lr if args.lr is not None else 4.0
    public = any(st.key == "public" for st in getattr(algorithms.get(args.algo), "schema", ()))
    probe = TrainConfig(data=args.data, model=args.model, algo=args.algo, noise_multiplier=args.noise_multiplier,
                        batch_size=1.0, lr=lr, clip=args.clip, subset=args.subset,
                        extra={"public_size": 100} if public else {})
    splits = prepare_splits(probe)
    if args.sample_rate >= 1:
        b = None  # full batch: B = N + the included canaries
    else:
        b = args.batch_size if args.batch_size is not None else args.sample_rate * splits.n
    a = OneRunAudit(algo=args.algo, noise_multiplier=args.noise_multiplier, batch_size=b, steps=args.steps,
                    canaries=args.canaries, canary_type=args.canary_type, data=args.data, model=args.model,
                    lr=lr, clip=args.clip, momentum=args.momentum, ef_clip=args.ef_clip,
                    canary_norm=args.canary_norm, delta=args.delta, dice_accounting=args.dice_accounting,
                    claim_noise_multiplier=args.claim_noise_multiplier, confidence=args.confidence,
                    seed=args.seed, subset=args.subset, grad_path=args.grad_path, bands=args.bands)
    return one_run_audit(a, progress=not args.quiet, splits=splits)
