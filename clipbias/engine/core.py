"""``DPEngine``: one private training run's moving parts, with one ``state_dict``.

It owns the Poisson sampler, the per-example gradient backend, the update pipeline, the base torch
optimizer and the privacy accountant (a step counter against the algorithm's ``AccountingSpec``).
``step(x, y)`` performs one logical step of the algorithm on a Poisson batch, splitting it into
physical micro-batches without changing the math; an empty batch is a noise-only step and is
accounted like any other.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from .. import algorithms, privacy
from ..data import batch
from .. import distributed
from ..data.batch import Batch
from ..config import AlgoConfig
from ..errors import ClipbiasError, ConfigError, ResumeMismatchError
from ..grads.fast import BookKeeping, why_unsupported
from ..grads.rows import (FuncGradients, LossFn, ParamSums, PerExampleRows, PerSampleGradients, RowSource,
                          as_row_source, check_finite, check_finite_norms, cross_entropy)
from ..sampling.loader import PoissonLoader, TensorData
from ..privacy import PrivacyReport
from ..randomness import SecretKey
from ..sampling.poisson import PoissonSampler
from ..transforms import StepContext


@dataclass(frozen=True)
class PrivacySettings:
    """The privacy-relevant settings of a run: a resumed run must match them exactly."""

    algorithm: str
    n: int
    sample_rate: float
    steps: int
    noise_multiplier: float
    delta: float
    accountant: str
    dice_accounting: str
    clip: float
    ef_clip: float | None
    grad_bound: float | None
    gamma: float
    target_epsilon: float | None
    extra: tuple = ()  # method settings (p, k, K0, ...): they change the sensitivity or the algorithm


class DPEngine:
    """Private training with one of ``clipbias.algorithms.ALGORITHMS``.

    Give either ``epsilon`` (the noise multiplier is calibrated for ``steps`` steps, never
    overshooting) or ``noise_multiplier``. ``batch_size`` is the *expected* Poisson batch size B;
    the sampling rate is q = B / n. ``steps`` defaults to ``epochs * round(n / B)``.

    Error-feedback algorithms (the DiceSGD family) are accounted by ``dice_accounting`` (default
    ``sound``; ``paper`` and ``authors`` are refuted and report ``certified = False``); without
    ``config.ef_clip`` they use C2 = 0.01 C1 / B (feedback ratio r = 0.01).

    Randomness: the caller seeds the model init (public). The Poisson batches, the pipeline's draws
    (Gaussian noise, pre-clipping perturbation) and the keyed per-example draws of the gradient
    backends (augmentations, groupings, public partners) are ChaCha20 draws under one 256-bit
    ``SecretKey`` (``clipbias.randomness``): by default (``noise_seed=None``) 256 bits of the OS
    CSPRNG, recorded nowhere but in the private ``state_dict``. ``noise_seed`` (an integer below
    2^256, or a ``SecretKey``) makes a run reproducible; the guarantee then holds only while that seed
    is secret, and ``privacy()`` reports it ``certified=False`` with that caveat.

    Rows: ``grads`` if given (a ``clipbias.grads.RowSource``, or a per-example gradient function
    ``PerSampleGradients``, which is wrapped in ``PerExampleRows``), else the algorithm's own
    ``row_source`` (per-example gradients by ``FuncGradients``, or group means, augmentation averages,
    inner momenta, ...), keyed by the secret key. The source's staged state is committed after each
    successful step and rolled back after a failed one; its ``state_dict`` is part of the engine's.

    Example::

        engine = DPEngine(model, "dice", n=len(x), batch_size=256, epochs=5, epsilon=3, delta=1e-5,
                          config=AlgoConfig(lr=0.5, clip=1.0))
        for _ in range(engine.total_steps):
            idx = engine.sampler.sample()
            engine.step(x[idx], y[idx], idx)
        print(engine.privacy().epsilon)
    """

    def __init__(self, model: nn.Module, algorithm: str, *, n: int, batch_size: float,
                 epochs: int | None = None, steps: int | None = None, epsilon: float | None = None,
                 delta: float = 1e-5, noise_multiplier: float | None = None, accountant: str = "pld",
                 dice_accounting: str = privacy.DEFAULT_DICE_ACCOUNTING, config: AlgoConfig | None = None,
                 loss_fn: LossFn = cross_entropy, max_physical_batch: int = 512,
                 noise_seed: int | SecretKey | None = None, grads: RowSource | PerSampleGradients | None = None,
                 grad_path: str = "auto") -> None:
        self.algo = algorithms.get(algorithm)
        self.config = config or AlgoConfig()
        n = _check_arguments(model, n, batch_size, self.config)
        if self.algo.accounting == "dice" and self.config.ef_clip is None:
            # the privacy cost of error feedback grows with r = B C2 / C1: default r = 0.01
            self.config = replace(self.config, ef_clip=privacy.dice.default_ef_clip(self.config.clip, batch_size))
        if max_physical_batch < 1:
            raise ConfigError(f"max_physical_batch must be >= 1, got {max_physical_batch!r}")
        if epsilon is not None and noise_multiplier is not None:
            raise ConfigError("give either epsilon (the noise is calibrated to it) or noise_multiplier, not both")
        privacy.check_delta(delta)
        privacy.check_accountant(accountant)
        self.n, self.expected_batch_size = n, float(batch_size)
        self.sample_rate = self.expected_batch_size / n
        steps_per_epoch = max(1, round(n / self.expected_batch_size))
        if steps is None:
            if epochs is None or epochs < 1:
                raise ConfigError(f"give --epochs >= 1 or steps >= 1 (got epochs={epochs!r})")
            steps = epochs * steps_per_epoch
        privacy.check_steps(steps)
        self.total_steps, self.delta = steps, delta
        # in a process group every rank holds rank 0's key: one global sample, one noise draw
        self.key = distributed.broadcast_key(SecretKey.of(noise_seed))
        self.accountant, self.dice_accounting = accountant, dice_accounting

        spec = self.algo.spec(self.config, self.sample_rate, 0.0, self.expected_batch_size)
        if not self.algo.private:
            z = 0.0
        elif noise_multiplier is not None:
            privacy.report.check_positive(noise_multiplier, "--noise-multiplier")
            z = float(noise_multiplier)
        elif epsilon is not None:
            z = privacy.calibrate(spec, epsilon, delta, steps, accountant, dice_accounting)
        else:
            raise ConfigError(f"{algorithm} is private: give --epsilon (calibrates the noise) or "
                              f"--noise-multiplier")
        self.noise_multiplier = z
        self.spec = self.algo.spec(self.config, self.sample_rate, z, self.expected_batch_size)
        if self.algo.private:
            self.privacy(steps)  # refuses now (not after training) when the guarantee cannot hold

        self.model = model
        own_rows = grads is None
        if grads is None:  # an algorithm may compute its rows differently (group means, momenta, ...)
            grads = self.algo.row_source(model, loss_fn, self.config, n=n, batch_size=self.expected_batch_size,
                                         key=self.key)
        self.rows, self.loss_fn = as_row_source(grads), loss_fn
        self.rows.key = self.key
        self.params = self.rows.layout.params(model)
        self.pipeline = self.algo.pipeline(self.config, self.expected_batch_size, z, self.key)
        self.optimizer = algorithms.make_optimizer(self.config.optimizer or self.algo.optimizer,
                                                   self.params, self.config)
        self.sampler = PoissonSampler(n, self.sample_rate, self.key, steps_per_epoch)
        self.max_physical_batch = max_physical_batch
        self._aggregate, self.grad_path_note = self._fast_path(grad_path, own_rows, model, loss_fn)
        self.own_rows = own_rows  # a given backend may read labels its own way (the audit's canaries: y < 0)
        self.world_size = _check_distributed(self.algo.name, self.rows, self.pipeline)
        self.steps_taken, self.last_loss = 0, (0.0, 0)
        self.settings = PrivacySettings(algorithm, n, self.sample_rate, steps, z, delta, accountant,
                                        dice_accounting, self.config.clip, self.config.ef_clip,
                                        self.config.grad_bound, self.config.gamma, epsilon,
                                        tuple(sorted((k, _canon(v)) for k, v in self.config.extra.items())))

    # ------------------------------------------------------------------ training
    def step(self, x: Batch, y: Batch, indices: Tensor | None = None) -> Tensor:
        """One logical step on the Poisson batch ``(x, y)``; returns the per-example losses.

        ``x`` and ``y`` are tensors or any ``clipbias.data.batch.Batch`` (tuples, dicts of tensors: the
        model is called ``model(**x)`` for a dict), with the examples on the first dimension; an
        empty batch (zero examples) is a noise-only step.

        In a process group of N ranks, ``(x, y, indices)`` is this rank's share of the global batch
        (``engine.local_share`` of the sampled indices; ``run_steps`` does it): the partial sums
        are all-reduced once and every rank applies the same update. ``last_loss`` is the global
        (loss sum, example count) of the step.

        Raises before changing anything (model, optimizer, error feedback, accountant) if a
        per-example gradient is not finite, on every rank when one rank's is not.
        """
        self._check_step(x, y, indices)
        d = self.rows.layout.dim
        dev = self.params[0].device
        ref_sum = torch.zeros(d, device=dev) if self.pipeline.error_feedback is not None else None
        proc_sum = torch.zeros(d, device=dev)
        losses, failure = [], None
        torch_rng = torch.get_rng_state()  # dropout draws of the model (randomness="different")
        try:
            for r, p, loss in self._sums(x, y, indices):
                if ref_sum is not None:
                    ref_sum += r
                proc_sum += p
                losses.append(loss)
        except ClipbiasError as err:  # a micro-batch failed (NaN, bad shape)
            failure = err
        mine = torch.cat(losses) if losses else torch.zeros(0, device=dev)
        self.last_loss = (float(mine.sum()), len(mine))
        if self.world_size > 1:  # the one all-reduce of the step: global sums, and did any rank fail
            proc_sum, ref_sum, loss_sum, count, failure = distributed.reduce_step(proc_sum, ref_sum, mine, failure)
            self.last_loss = (loss_sum, count)
        if failure is not None:  # every stage drops what it staged, on every rank
            torch.set_rng_state(torch_rng)
            self.rows.rollback()
            self.pipeline.rollback()
            raise failure
        update = self.pipeline.finish(proc_sum, ref_sum)
        for param, u in zip(self.params, self.rows.layout.unflatten(update)):
            param.grad = u.to(param.dtype)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.pipeline.commit()
        self.rows.commit()
        self.steps_taken += 1
        return mine

    @property
    def fast(self) -> BookKeeping | None:
        """The book-keeping fast path when this engine runs it (``--grad-path``), else None."""
        return self._aggregate if isinstance(self._aggregate, BookKeeping) else None

    def local_share(self, indices: Tensor, step: int | None = None) -> Tensor:
        """This rank's share of the global sample ``indices`` (all of it with one process): the
        examples the row source assigns to this rank at ``step`` (default: the coming step;
        ``RowSource.owners``)."""
        if self.world_size == 1:
            return indices
        step = self.steps_taken if step is None else step
        return distributed.local_share(indices, self.rows.owners(indices, step, self.world_size))

    def _check_step(self, x: Batch, y: Batch, indices: Tensor | None) -> None:
        """Refuse a step that cannot be taken: budget spent, mismatched lengths, float labels."""
        if self.steps_taken >= self.total_steps and self.algo.private:
            raise ConfigError(f"the privacy budget covers {self.total_steps} steps and all were taken; "
                              f"start a new run with more --epochs to train longer")
        if not (isinstance(x, Tensor) and isinstance(y, Tensor)) and not self.rows.structured:
            raise ConfigError(f"--algo {self.algo.name} computes its rows from image tensors and takes tensor "
                              f"inputs and labels, got {type(x).__name__} and {type(y).__name__}; use an "
                              f"algorithm with per-example rows (dpsgd, dice, ...) for structured batches")
        _check_batch(x, y, indices, self.loss_fn is cross_entropy, self.own_rows)
        if self.world_size > 1 and indices is None:
            raise ConfigError(f"in a process group of {self.world_size} ranks, step needs the example indices of "
                              f"this rank's share (engine.local_share(engine.sampler.sample())): the keyed "
                              f"per-example draws and the shares are defined by them")

    def _sums(self, x: Batch, y: Batch, indices: Tensor | None):
        """(reference sum, processed sum, losses) per physical micro-batch, through the rows or a
        norm-scaling aggregate (``_fast_path``); the finiteness of every example's gradient is checked on its norm either way."""
        if self._aggregate is None:
            for g, loss, idx in self.rows.iter_rows(x, y, indices, self.steps_taken, self.max_physical_batch):
                norms = check_finite(g, idx)
                r, p = self.pipeline.rows(g, StepContext(idx, self.steps_taken, norms))
                yield r, p, loss
            return
        scale = self.pipeline.per_sample[0].scale
        need_ref = self.pipeline.error_feedback is not None
        for start in range(0, batch.size(x), self.max_physical_batch):
            sl = slice(start, start + self.max_physical_batch)
            p, r, loss, norms = self._aggregate(batch.take(x, sl), batch.take(y, sl), scale, need_ref)
            check_finite_norms(norms, indices[sl] if indices is not None else None)
            yield r, p, loss

    def _fast_path(self, grad_path: str, own_rows: bool, model: nn.Module, loss_fn: LossFn):
        """(the aggregate of a norm-scaling step or None, what the header says): the book-keeping fast
        path (``fastclip.BookKeeping``: no rows), the rows summed per parameter (``grads.ParamSums``),
        or None (rows through the pipeline: stages that need rows). ``grad_path`` rows | fast | auto:
        auto takes the fast path where it applies and one micro-batch of rows would exceed
        ``AUTO_ROWS_BYTES`` (on CPU the rows path is faster for small models: docs/results.md)."""
        if grad_path not in ("rows", "fast", "auto"):
            raise ConfigError(f"--grad-path must be rows, fast or auto, got {grad_path!r}")
        p = self.pipeline
        why = ("a gradient backend was given" if not own_rows else
               f"--algo {self.algo.name} computes its own rows" if self.algo.source is not None else
               "--grad-bound clips the rows first" if p.reference else
               f"--algo {self.algo.name} transforms rows beyond a norm scaling" if len(p.per_sample) != 1
               or p.per_sample[0].scale(torch.ones(1)) is None else None)
        if why is None:  # a norm-scaling step: the fast path if the model allows it, else summed rows
            why = why_unsupported(model)
            rows_bytes = min(self.max_physical_batch, math.ceil(1.2 * self.expected_batch_size)) * \
                self.rows.layout.dim * 4
            if why is None and (grad_path == "fast" or grad_path == "auto" and rows_bytes > AUTO_ROWS_BYTES):
                return BookKeeping(model, loss_fn), (
                    "fast (per-layer norms and book-keeping sums, no rows; per-example sensitivity rests "
                    "on run-time checks of the model, docs/results.md)")
            if grad_path != "fast" and isinstance(self.rows, PerExampleRows) and \
                    isinstance(self.rows.grads, FuncGradients):
                return ParamSums(self.rows.grads), "rows (per-example gradients, torch.func, summed per parameter" + (
                    f"; the fast path does not apply: {why})" if grad_path == "auto" and why else ")")
        if grad_path == "fast":
            raise ConfigError(f"--grad-path fast is not available: {why}; use --grad-path auto or rows")
        return None, "rows (per-example gradients, torch.func)" + (f"; the fast path does not apply: {why}"
                                                                    if grad_path == "auto" and why else "")

    def train_epoch(self, x: "Batch | Dataset | PoissonLoader", y: Batch | None = None, **loader_options) -> float:
        """One epoch of Poisson batches; returns the mean example loss. The data: in-memory inputs
        ``x`` with labels ``y``, a map-style ``torch.utils.data.Dataset`` (``y`` omitted; ``loader_options``
        such as ``collate_fn`` and ``num_workers`` go to ``clipbias.sampling.PoissonLoader``) or a
        ``PoissonLoader``."""
        if y is not None and (batch.size(x) != batch.size(y) or batch.size(x) != self.n):
            raise ConfigError(f"train_epoch got {batch.size(x)} inputs and {batch.size(y)} labels for an engine "
                              f"built with n={self.n}: the sampler draws from n examples and the accounting assumes "
                              f"n; pass exactly the n training examples (or build the engine with n={batch.size(x)})")
        total, count = run_steps(self, x, y, len(self.sampler), **loader_options)
        return total / max(count, 1)

    # ------------------------------------------------------------------ privacy
    def privacy(self, steps: int | None = None) -> PrivacyReport:
        """The guarantee after ``steps`` (default: the steps taken so far). A run keyed by a seed
        (``noise_seed``) is reported ``certified=False``: whoever knows or guesses the seed can
        recompute the batches and subtract the noise."""
        report = privacy.account(self.spec, self.steps_taken if steps is None else steps, self.delta,
                                 self.accountant, self.dice_accounting)
        if self.algo.private and self.key.reproducible:
            report = report.with_caveat(SEEDED_CAVEAT)
        return report

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """All DP state except the model weights (save ``model.state_dict()`` beside it).

        PRIVATE: holds the error-feedback buffer and the secret key of the batches and the noise;
        never release it.
        """
        return {"settings": asdict(self.settings), "steps_taken": self.steps_taken,
                "optimizer": self.optimizer.state_dict(), "pipeline": self.pipeline.state_dict(),
                "sampler": self.sampler.state_dict(), "secret_key": self.key.state_dict(),
                "rows": self.rows.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``; refuses (ResumeMismatchError) if a privacy setting changed."""
        missing = [k for k in ("settings", "steps_taken", "optimizer", "pipeline", "sampler")
                   if not isinstance(state, dict) or k not in state]
        if missing:
            raise ConfigError(f"load_state_dict: not a DPEngine state ({', '.join(missing)} missing); pass what "
                              f"DPEngine.state_dict() returned (a checkpoint's 'engine' entry)")
        if "secret_key" not in state:
            raise ResumeMismatchError("cannot resume: this checkpoint comes from a clipbias version whose batches and "
                                      "noise came from torch generators with 32-bit seeds, which can be recovered "
                                      "from the released model; continuing it would not be private. Start a new run "
                                      "(a new run directory, or --overwrite)")
        saved, now = state["settings"], asdict(self.settings)
        diff = {k: (saved.get(k), v) for k, v in now.items() if not _same(saved.get(k), v)
                and not (k == "steps" and _extendable(saved, now))}
        if diff:
            lines = ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
            raise ResumeMismatchError(f"cannot resume: privacy-relevant settings changed ({lines}). "
                                      f"Resume with the original settings or start a new run directory.")
        self._set_key(SecretKey.from_state(state["secret_key"]))  # the stream continues under the run's key
        self.steps_taken = state["steps_taken"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.pipeline.load_state_dict(state["pipeline"])
        self.sampler.load_state_dict(state["sampler"])
        self.rows.load_state_dict(state.get("rows", state.get("grads", {})))  # "grads": before the redesign

    def _set_key(self, key: SecretKey) -> None:
        """Every secret draw of the run under ``key``: sampler, row source, keyed stages (noise, perturbation)."""
        self.key = self.rows.key = self.sampler.key = key
        for _, stage in self.pipeline.named_stages():
            if isinstance(getattr(stage, "key", None), SecretKey):
                stage.key = key


def _check_arguments(model: nn.Module, n: int, batch_size: float, config: AlgoConfig) -> int:
    """Refuse constructor arguments that would fail later with a raw error (or silently): returns n
    as an int (numpy integers are fine)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(config, AlgoConfig):
        raise ConfigError(f"config must be an AlgoConfig (clipbias.config.AlgoConfig(lr=..., clip=...)), got "
                          f"{type(config).__name__}")
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
        raise ConfigError(f"dataset size n must be a positive integer, got {n!r}")
    n = int(n)
    if not (isinstance(batch_size, numbers.Real) and 1 <= batch_size <= n):
        raise ConfigError(f"--batch-size (the expected Poisson batch size B) must lie in [1, N={n}], got "
                          f"{batch_size!r}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"the model ({type(model).__name__}) has no trainable parameters: nothing to train")
    return n


def _check_batch(x: Batch, y: Batch, indices: Tensor | None, class_labels: bool, own_rows: bool) -> None:
    """Refuse a batch the step cannot take, before anything changes: tensors (or tuples, lists, dicts
    of tensors) with one row per example in every tensor and, for the default cross-entropy loss
    (``class_labels``), one integer class index per example, not negative where the engine computes
    the rows itself (``own_rows``; cross-entropy would silently ignore a label of -100)."""
    for name, t in (("x", x), ("y", y), ("indices", indices)):
        if t is not None and not isinstance(t, Tensor) and (name == "indices" or not isinstance(t, (tuple, list, Mapping))):
            raise ConfigError(f"step: {name} must be a torch.Tensor" + ("" if name == "indices" else
                              " (or a tuple, list or dict of tensors)") + f", got {type(t).__name__}; convert it "
                              f"with torch.as_tensor({name})")
    if isinstance(x, Tensor) and x.dim() == 0:
        raise ConfigError("step got a scalar as inputs: one row per example is needed")
    bx, by = batch.size(x), batch.size(y)
    if bx != by or (indices is not None and len(indices) != bx):
        raise ConfigError(f"step got {bx} inputs, {by} labels"
                          + (f" and {len(indices)} indices" if indices is not None else "")
                          + ": one label (and index) per input is needed")
    if class_labels and not isinstance(y, Tensor):
        raise ConfigError(f"the default cross-entropy loss takes a tensor of class indices, got "
                          f"{type(y).__name__} labels; pass your own loss_fn for structured targets")
    if class_labels and y.is_floating_point():
        raise ConfigError(f"labels must be integer class indices (torch.long) for the default cross-entropy "
                          f"loss, got {y.dtype}; convert them with y.long() or pass your own loss_fn")
    if class_labels and own_rows and len(y) and bool((y < 0).any()):
        raise ConfigError(f"labels must be class indices >= 0 for the default cross-entropy loss, got "
                          f"{int(y.min())}; fix the labels (negative ones are not classes) or pass your own loss_fn")
    if class_labels and y.dim() != 1:
        raise ConfigError(f"labels must be one class index per example (shape ({len(y)},)) for the default "
                          f"cross-entropy loss, got shape {tuple(y.shape)}; flatten them with y.view(-1) or pass "
                          f"your own loss_fn")


def _extendable(saved: dict, now: dict) -> bool:
    """More steps than the checkpoint's at a noise multiplier that was given, not calibrated to a
    target epsilon: the accounting covers the longer run (``privacy()`` reports its epsilon)."""
    return saved.get("target_epsilon") is None and now["target_epsilon"] is None and now["steps"] > saved["steps"]


def _canon(v) -> str:
    """A method setting in canonical form: 4 and 4.0 are the same setting."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return repr(float(v))
    return repr(v)


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12) or (math.isnan(a) and math.isnan(b))
    return a == b


SEEDED_CAVEAT = ("batches and noise derived from a user-given seed (a reproducible run): the guarantee holds only "
                 "while that seed stays secret and unguessable; anyone who has it can recompute the batches and "
                 "subtract the noise")

AUTO_ROWS_BYTES = 2 * 2**30
"""``grad_path="auto"`` takes the fast path when one micro-batch of float32 rows would exceed this."""


def _check_distributed(name: str, rows: RowSource, pipeline) -> int:
    """The world size of the process group (1 without one), after refusing what cannot be split:
    a row source or stage whose rows are not a sum over examples that each rank can compute alone
    declares why in ``distributed_refusal`` (none of the built-in methods does; a user's source may)."""
    world = distributed.context()[1]
    if world == 1:
        return 1
    why = getattr(rows, "distributed_refusal", None) or next(
        (s.distributed_refusal for _, s in pipeline.named_stages() if getattr(s, "distributed_refusal", None)), None)
    if why:
        raise ConfigError(f"--algo {name} cannot run on {world} processes: {why}. Run it with one process "
                          f"(plain `clipbias train`)")
    return world


StepHook = Callable[[DPEngine, Tensor], None]


def run_steps(engine: DPEngine, x: "Batch | Dataset | PoissonLoader", y: Batch | None = None,
              steps: int | None = None, *, before: Callable[[DPEngine], None] | None = None,
              after: StepHook | None = None, **loader_options) -> tuple[float, int]:
    """The sample-and-step loop: up to ``steps`` Poisson steps (default: all remaining), stopping at
    ``engine.total_steps``; returns (sum of the example losses, number of examples). The data are
    in-memory ``(x, y)`` (tensors or structured batches, on the CPU or the GPU), a map-style Dataset
    ``x`` (``y`` None; ``loader_options`` go to ``clipbias.sampling.PoissonLoader``: ``collate_fn``,
    ``num_workers``, ...) or a ``PoissonLoader``: one loop for all (``PoissonLoader.epoch``).
    ``before(engine)`` runs before each step, ``after(engine, losses)`` after it: progress bars,
    diagnostics, iterate traces. Used by training, the toy problems and the diagnostics recorder
    alike. In a process group every rank draws the same global sample and steps on its share
    (``engine.local_share``); ``after`` gets this rank's losses, the sums are global.
    """
    if isinstance(x, PoissonLoader):
        if x.engine is not engine:  # its batches come from that engine's sampler, at that engine's q and n
            raise ConfigError("this PoissonLoader was built for another engine: its batches are that engine's "
                              "Poisson samples (its sampling rate, its secret sampler), not this engine's, so "
                              "this engine's accounting would not describe them; build "
                              "PoissonLoader(engine, dataset) for this engine")
        if loader_options or y is not None:
            raise ConfigError(f"a PoissonLoader carries its own data and options; got also "
                              f"{'labels' if y is not None else ', '.join(loader_options)}: pass them when "
                              f"building the PoissonLoader")
        loader = x
    else:
        loader = PoissonLoader(engine, x if y is None else TensorData(x, y), **loader_options)
    total, count = 0.0, 0
    for xb, yb, idx in loader.epoch(engine.total_steps - engine.steps_taken if steps is None else steps):
        if before is not None:
            before(engine)
        losses = engine.step(xb, yb, idx)
        total, count = total + engine.last_loss[0], count + engine.last_loss[1]  # global sums
        if after is not None:
            after(engine, losses)
    return total, count
