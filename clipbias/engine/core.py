"""``DPEngine``: one private training run's moving parts, with one ``state_dict``.

It owns the Poisson sampler, the per-example gradient backend, the update pipeline, the base torch
optimizer and the privacy accountant (a step counter against the algorithm's ``AccountingSpec``).
``step(x, y)`` performs one logical step of the algorithm on a Poisson batch, splitting it into
physical micro-batches without changing the math; an empty batch is a noise-only step and is
accounted like any other.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from dataclasses import asdict, dataclass, replace

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from .. import algorithms, privacy
from ..algorithms.bands import band_pipeline, banded_spec, check_bandable, check_strategy
from ..data import batch
from .. import distributed
from ..data.batch import Batch
from ..config import AlgoConfig
from ..errors import ClipbiasError, ConfigError, PathRefusal, ResumeMismatchError
from ..grads import precision
from ..grads.fast import BookKeeping, rule_kind
from ..grads.rows import (FuncGradients, LossFn, ParamSums, PerSampleGradients, RowSource, as_row_source, check_finite,
                          check_finite_norms, cross_entropy, guarded)
from ..sampling.loader import PoissonLoader
from ..privacy import PrivacyReport
from ..randomness import SecretKey, forward
from ..sampling.poisson import PoissonSampler, check_bands
from ..transforms import StepContext
from .aggregate import choose_aggregate, other_path
from .checks import (canon, check_arguments, check_distributed, check_mixed, check_optimizer_resume, check_resume,
                     check_step)
from .loop import run_steps


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
    bands: int = 1     # banded noise: participation classes and noise correlation (algorithms.bands)


class DPEngine:
    """Private training with one of ``clipbias.algorithms.ALGORITHMS``.

    Give either ``epsilon`` (the noise multiplier is calibrated for ``steps`` steps, never
    overshooting) or ``noise_multiplier``. ``batch_size`` is the *expected* Poisson batch size B;
    the sampling rate is q = B / n. ``steps`` defaults to ``epochs * round(n / B)``. ``sample_rate`` sets q
    instead, for ``n`` rows that are a keyed random part of a public population (a ``--validation`` split: q =
    B / the part's expected size, so that q, the steps and the noise do not reveal the realised n; each row
    joins a batch with probability q, the update is divided by B; ``steps`` defaults to ``epochs * round(1 / q)``).

    Without ``steps`` and ``epochs``, and with ``noise_multiplier``, the run is open-ended (Opacus's habit):
    ``total_steps`` is infinite and ``privacy()`` accounts the steps taken. ``optimizer``: your own torch
    optimizer, holding exactly the model's trainable parameters, takes the private update (default: one built
    from ``config``: SGD, Adam or AdamW).

    Error-feedback algorithms (the DiceSGD family) are accounted by ``dice_accounting`` (default
    ``sound``; ``paper`` and ``authors`` are refuted and report ``certified = False``); without
    ``config.ef_clip`` they use C2 = 0.01 C1 / B (feedback ratio r = 0.01).

    Mixed precision: ``autocast=torch.bfloat16`` (CPU or CUDA) or ``torch.float16`` runs each step's forward
    and backward under ``torch.autocast`` on the parameters' device, while the parameters, the per-example
    norms, the clip factors and every sum across examples stay in float32 (float64 where the fast path uses
    it): 16-bit activations and output gradients are widened to float32, exactly, before any of them
    (docs/privacy.md, "Floating point in the fast path"). ``loss_scale`` (a power of two; default 1 under
    bfloat16, 256 under float16) multiplies the loss before the backward and is divided out exactly after:
    float16 output gradients below 2^-24 would otherwise flush to zero. A step called inside the caller's
    own ``torch.autocast`` is refused (the sums would be 16-bit), as are 16-bit parameters.

    ``bands`` > 1: banded correlated noise (``clipbias.algorithms.bands``); ``bands_strategy`` picks its
    coefficients, ``taylor`` (default) or ``optimized`` for the run's finite number of steps (the same
    privacy guarantee, ``clipbias.algorithms.band_strategy``).

    Randomness: the model init is the caller's (public). The batches, the noise and every keyed draw
    are ChaCha20 draws under one 256-bit ``SecretKey`` (``clipbias.randomness``): by default 256 OS bits,
    kept only in the private ``state_dict``; ``noise_seed`` (an integer below 2^256, or a key) makes a
    run reproducible and ``privacy()`` then reports it uncertified. Rows: ``grads`` (a ``RowSource``
    or a per-example gradient function) if given, else the algorithm's own source.

    For example, a loop written by hand:

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
                 grad_path: str = "auto", bands: int = 1, optimizer: torch.optim.Optimizer | None = None,
                 sample_rate: float | None = None, autocast: torch.dtype | str | None = None,
                 loss_scale: float | None = None, bands_strategy: str = "taylor") -> None:
        self.algo = algorithms.get(algorithm)
        self.autocast = check_mixed(autocast, loss_scale, grads)  # (dtype, loss scale) or None
        self.undrawn_steps = 0  # steps whose batch the engine's sampler did not draw (``privacy`` caveat)
        self.config = config or AlgoConfig()
        n = check_arguments(model, n, batch_size, self.config)
        self.sharded = distributed.is_sharded(model)  # fully_shard: gathered whole for each step (``_gathered``)
        if self.sharded:
            distributed.check_sharded(model, rule_kind)
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
        self.sample_rate = self.expected_batch_size / n if sample_rate is None else check_rate(sample_rate)
        check_bands(bands, self.sample_rate)
        check_bandable(self.algo.name, bands)
        check_strategy(bands_strategy)
        self.bands, self.bands_strategy = bands, bands_strategy
        steps_per_epoch = max(1, round(n / self.expected_batch_size) if sample_rate is None else round(1 / sample_rate))
        if steps is None and epochs is None and noise_multiplier is not None:
            steps = math.inf  # open-ended (Opacus's habit): accounted as the steps are taken
        elif steps is None:
            if epochs is None or epochs < 1:
                raise ConfigError(f"give --epochs >= 1 or steps >= 1 (got epochs={epochs!r})")
            steps = epochs * steps_per_epoch
        if steps != math.inf:
            privacy.check_steps(steps)
        self.total_steps, self.delta = steps, delta
        # in a process group every rank holds rank 0's key: one global sample, one noise draw
        self.key = distributed.broadcast_key(SecretKey.of(noise_seed))
        self.key.adopt(self)
        # the layout of each keyed dropout call, as the run's first forward made it (randomness.forward's guard)
        self._dropout_layouts: dict = {}
        self.accountant, self.dice_accounting = accountant, dice_accounting

        self.noise_multiplier = z = noise_multiplier_for(self, epsilon, noise_multiplier)
        self.spec = banded_spec(self.algo.spec(self.config, self.sample_rate, z, self.expected_batch_size), bands)
        if self.algo.private:  # refuses now (not after training) when the guarantee cannot hold
            self.privacy(steps if steps != math.inf else 1)
        self.model = model
        own_rows = grads is None
        if grads is None:  # an algorithm may compute its rows differently (group means, momenta, ...)
            grads = self.algo.row_source(model, loss_fn, self.config, n=n, batch_size=self.expected_batch_size,
                                         key=self.key)
        self.rows, self.loss_fn = as_row_source(grads), loss_fn
        self.rows.key = self.key
        self.params = self.rows.layout.params(model)
        self.pipeline = band_pipeline(self.algo.pipeline(self.config, self.expected_batch_size, z, self.key),
                                      self.algo.name, bands, self._band_momentum(), self.key, bands_strategy, steps)
        self.optimizer = check_base_optimizer(optimizer, self.params, self.rows.layout.names) or \
            algorithms.make_optimizer(self.config.optimizer or self.algo.optimizer, self.params, self.config)
        self.sampler = PoissonSampler(n, self.sample_rate, self.key, steps_per_epoch, bands)
        self.max_physical_batch = max_physical_batch
        self._aggregate, self.grad_path_note = self._choose_aggregate(grad_path, own_rows, model, loss_fn,
                                                                      max_physical_batch)
        self.own_rows = own_rows  # a given backend may read labels its own way (the audit's canaries: y < 0)
        self.world_size = check_distributed(self.algo.name, self.rows, self.pipeline)
        # grad_path="auto": the other path, taken once if the chosen one refuses the model at its first step
        self.grad_path_fallback: str | None = None  # what happened, once it has
        self._other_path = other_path(grad_path, own_rows, model, loss_fn, self.algo, self.pipeline, self.rows,
                                      max_physical_batch, self.expected_batch_size, self._aggregate) \
            if grad_path == "auto" and self.world_size == 1 else None
        self.steps_taken, self.last_loss = 0, (0.0, 0)
        self.last_outputs, self._outputs = None, None  # step(keep_outputs=True)
        self.settings = PrivacySettings(algorithm, n, self.sample_rate, steps, z, delta, accountant,
                                        dice_accounting, self.config.clip, self.config.ef_clip,
                                        self.config.grad_bound, self.config.gamma, epsilon,
                                        tuple(sorted((k, canon(v)) for k, v in self.config.extra.items())), bands)

    def _choose_aggregate(self, grad_path: str, own_rows: bool, model: nn.Module, loss_fn: LossFn,
                          max_physical_batch: int):
        """``choose_aggregate``'s (aggregate, note); a model sharded with fully_shard takes the fast path
        (``auto`` means ``fast``) or is refused (``distributed.refuse_sharded_path``)."""
        if not self.sharded:
            return choose_aggregate(grad_path, own_rows, model, loss_fn, self.algo, self.pipeline, self.rows,
                                    max_physical_batch, self.expected_batch_size)
        if grad_path == "rows":
            distributed.refuse_sharded_path("grad_path='rows' was asked for")
        try:
            agg, note = choose_aggregate("fast" if grad_path == "auto" else grad_path, own_rows, model, loss_fn,
                                         self.algo, self.pipeline, self.rows, max_physical_batch,
                                         self.expected_batch_size)
        except ConfigError as e:
            if not hasattr(e, "why"):
                raise
            distributed.refuse_sharded_path(e.why)
        if type(agg) is not BookKeeping:
            distributed.refuse_sharded_path(f"{self.algo.name} evaluates gradients at points other than the "
                                            f"current parameters")
        return agg, note + "; fully_shard: the parameters gathered whole for the step, the update applied per shard"

    def _gathered(self):
        """The step's sums over the whole model: a fully_shard model gathered on every rank
        (``distributed.unsharded``), any other as it is."""
        return distributed.unsharded(self.model) if self.sharded else contextlib.nullcontext()

    def _band_momentum(self) -> float:
        """The momentum the banded noise's coefficients are shaped for: the base SGD's (0 for Adam)."""
        return self.config.momentum if (self.config.optimizer or self.algo.optimizer) == "sgd" else 0.0

    # ------------------------------------------------------------------ training
    def step(self, x: Batch, y: Batch, indices: Tensor | None = None, *, keep_outputs: bool = False) -> Tensor:
        """One logical step on the Poisson batch ``(x, y)``; returns the per-example losses.

        ``x`` and ``y`` are tensors or any ``clipbias.data.batch.Batch`` (tuples, dicts of tensors: the
        model is called ``model(**x)`` for a dict), with the examples on the first dimension; an
        empty batch (zero examples) is a noise-only step.

        In a process group of N ranks, ``(x, y, indices)`` is this rank's share of the global batch
        (``engine.local_share`` of the sampled indices; ``run_steps`` does it): the partial sums
        are all-reduced once and every rank applies the same update. ``last_loss`` is the global
        (loss sum, example count) of the step. A model sharded with ``fully_shard`` is gathered whole on
        every rank for the sums (``distributed.unsharded``) and each rank applies its shards' slice of the
        update (docs/architecture.md, "Sharded models").

        Raises before changing anything (model, optimizer, error feedback, accountant) if a
        per-example gradient is not finite, on every rank when one rank's is not.

        ``indices`` must be the batch ``engine.sampler.sample()`` returned last (this rank's share of it),
        used by no step before: any other batch (no indices, indices of your choosing, a batch used twice)
        is taken, with a warning, and makes ``privacy()`` uncertified, with a caveat that counts such steps.

        ``keep_outputs`` (where ``outputs_kept`` says the gradient path can): ``last_outputs`` is then the model's
        output on the batch from the step's own forward (detached), so a loop needs no second forward.
        """
        check_step(self, x, y, indices)
        if keep_outputs and not self.outputs_kept:
            raise ConfigError("keep_outputs: this gradient path does not produce the batch's outputs (only the fast "
                              "path and the per-parameter rows of a norm-scaling algorithm do)")
        drawn = self._drawn_by_sampler(indices)
        self.last_outputs, self._outputs = None, [] if keep_outputs else None
        dev = self.params[0].device
        proc_sum, ref_sum, losses, failure = self._attempt_sums(x, y, indices, keep_outputs)
        if self._other_path is not None and batch.size(x) and failure is None:
            self._other_path = None  # auto's choice stands from the first step that ran the model
        mine = torch.cat(losses) if losses else torch.zeros(0, device=dev)
        self.last_loss = (float(mine.sum()), len(mine))
        if self._outputs:
            self.last_outputs = batch.cat(self._outputs)
        if self.world_size > 1:  # the one all-reduce of the step: global sums, and did any rank fail
            proc_sum, ref_sum, loss_sum, count, failure = distributed.reduce_step(proc_sum, ref_sum, mine, failure)
            self.last_loss = (loss_sum, count)
        if failure is not None:  # every stage drops what it staged, on every rank
            self._drop_staged()
            raise failure
        try:
            update = self.pipeline.finish(proc_sum, ref_sum)
        except BaseException:
            self._drop_staged()
            raise
        # once the noisy update exists it counts as released, before it reaches the model (an interrupt
        # between applying it and counting it would let a later step reuse its noise draw, whose
        # difference with this release cancels the noise, or shift the classes of banded noise): its
        # draws are never drawn again and the step is accounted
        self.pipeline.commit()
        self.rows.commit()
        self.steps_taken += 1
        self.undrawn_steps += not drawn
        self.sampler.settle()
        try:
            for param, u in zip(self.params, self.rows.layout.unflatten(update)):
                param.grad = distributed.shard_like(param, u.to(param.dtype))  # a shard's slice of the one update
            self.optimizer.step()
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        return mine

    def _attempt_sums(self, x: Batch, y: Batch, indices: Tensor | None, keep_outputs: bool) -> tuple:
        """The step's (processed sum, reference sum or None, per-example losses, failure or None) on this
        rank, under the keyed forward (and a fully_shard model gathered whole); computed once more on the
        other path where ``grad_path="auto"`` takes it (``_fall_back``)."""
        d = self.rows.layout.dim
        dev, dt = self.params[0].device, self.params[0].dtype  # a float64 model sums in float64
        while True:  # once more only where grad_path="auto" takes its other path (_fall_back)
            ref_sum = torch.zeros(d, device=dev, dtype=dt) if self.pipeline.error_feedback is not None else None
            proc_sum = torch.zeros(d, device=dev, dtype=dt)
            losses, failure = [], None
            # vmap refusing the model: auto's other path, while it has one (else one example at a time)
            self._set_unvectorizable("refuse" if self._other_path is not None else "loop")
            try:
                # dropout masks from the key, per example index; a fully_shard model gathered whole for the sums;
                # under autocast=, the model's forwards in 16 bits
                with forward.keyed(self.key, self.steps_taken, dev, self._dropout_layouts), self._gathered(), \
                        precision.mixed(self._mixed(dev)):
                    for r, p, loss in self._sums(x, y, indices):
                        if ref_sum is not None:
                            ref_sum += r
                        proc_sum += p
                        losses.append(loss)
            except ClipbiasError as err:  # a micro-batch failed (NaN, bad shape, a public random draw)
                failure = err
            except BaseException:  # out of memory, an interrupt: nothing staged may reach the next step
                self._set_unvectorizable("loop")
                self._drop_staged()  # (adaptive clipping's count would hold these examples twice)
                raise
            if not (isinstance(failure, PathRefusal) and self._fall_back(failure)):
                break
            self._outputs = [] if keep_outputs else None
        self._set_unvectorizable("loop")
        return proc_sum, ref_sum, losses, failure

    def _fall_back(self, err: PathRefusal) -> bool:
        """``grad_path="auto"``, before its first step that ran the model completed: the path it chose
        refused the model (``err``, a structural refusal raised while the step's sums were computed: nothing
        released, no noise drawn, the sampler's batch still in hand). Drop what the attempt staged, take the
        other path (kept for the rest of the run) and say so; the caller computes the step again on the same
        batch (the same dropout masks: functions of the key, the step and the indices). False where there
        is no other path (then the refusal stands)."""
        if self._other_path is None or err.path != self._path_name():
            return False
        self.rows.rollback()  # not _drop_staged: the batch stays this step's (with bands too)
        self.pipeline.rollback()
        before = self._path_name()
        self._aggregate, note = self._other_path
        self._other_path = None
        if self._path_name() == "fast":  # should it refuse too: the rows path, one example at a time
            self._other_path = other_path("auto", self.own_rows, self.model, self.loss_fn, self.algo, self.pipeline,
                                          self.rows, self.max_physical_batch, self.expected_batch_size,
                                          self._aggregate)
        reason = str(err).split(". ")[0]
        self.grad_path_fallback = (f"{self.grad_path_fallback}; then " if self.grad_path_fallback else "") + \
            f"{before} -> {self._path_name()}: {reason}"
        self.grad_path_note = f"{note}; grad_path='auto' took it at the first step, where the {before} path " \
                              f"refused the model ({reason})"
        warnings.warn(f"grad_path='auto': the {before} path refused the model at the first step ({reason}); "
                      f"nothing had changed, and the step runs on the {self._path_name()} path, which the run "
                      f"keeps (engine.grad_path_fallback). Pass grad_path='{self._path_name()}' to choose it "
                      f"yourself", stacklevel=3)
        return True

    def _path_name(self) -> str:
        """``"fast"`` or ``"rows"``: the path the step's sums take."""
        return "fast" if self.fast is not None else "rows"

    def _set_unvectorizable(self, what: str) -> None:
        """What the rows path's ``FuncGradients`` does with a model ``vmap`` cannot run: ``"loop"`` (one
        example at a time) or ``"refuse"`` (``PathRefusal``: auto's other path takes the step)."""
        agg = getattr(self._aggregate, "inner", self._aggregate)
        grads = agg.grads if isinstance(agg, ParamSums) else getattr(self.rows, "grads", None)
        if isinstance(grads, FuncGradients):
            grads.unvectorizable = what

    def _mixed(self, dev: torch.device) -> precision.Mixed | None:
        """The step's autocast on the parameters' device (``autocast=``), or None."""
        if self.autocast is None:
            return None
        return precision.Mixed(dev.type, *self.autocast)

    def _drawn_by_sampler(self, indices: Tensor | None) -> bool:
        """Whether the step's batch is (this rank's share of) the one the engine's sampler drew last and
        no step has used yet: the Poisson sample the accounting assumes. Any other batch (no indices,
        indices of the caller's choosing, a batch used twice) makes the run uncertified (``privacy``),
        with a warning at the first such step."""
        last = self.sampler.last
        ok = indices is not None and last is not None and torch.equal(
            torch.sort(indices.detach().reshape(-1).to("cpu", torch.long)).values, torch.sort(self.local_share(last)).values)
        if not ok and self.algo.private and not self.undrawn_steps:
            warnings.warn(UNDRAWN_WARNING, stacklevel=3)
        return ok

    def _drop_staged(self) -> None:
        """Undo a step that did not complete: every stage's staged state dropped; with bands, the step's
        batch goes back to the sampler (the retry takes it again). The retry draws the same dropout masks
        (functions of the key, the step and the indices)."""
        self.rows.rollback()
        self.pipeline.rollback()
        if self.bands > 1 and self.sampler.next_step == self.steps_taken + 1:
            self.sampler.give_back()

    @property
    def fast(self) -> BookKeeping | None:
        """The book-keeping fast path when this engine runs it (``--grad-path``), else None."""
        agg = getattr(self, "_aggregate", None)  # None while the engine is being built
        agg = getattr(agg, "inner", agg)  # DiSK's two points wrap it
        return agg if isinstance(agg, BookKeeping) else None

    def local_share(self, indices: Tensor, step: int | None = None) -> Tensor:
        """This rank's share of the global sample ``indices`` (all of it with one process): the
        examples the row source assigns to this rank at ``step`` (default: the coming step;
        ``RowSource.owners``)."""
        if self.world_size == 1:
            return indices
        step = self.steps_taken if step is None else step
        return distributed.local_share(indices, self.rows.owners(indices, step, self.world_size))

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
        if hasattr(self._aggregate, "begin"):  # a step-level preparation (DiSK stages the step's iterate)
            self._aggregate.begin()
        source = self._output_source()
        if source is not None:
            source.keep_output = self._outputs is not None
        try:
            for start in range(0, batch.size(x), self.max_physical_batch):
                sl = slice(start, start + self.max_physical_batch)
                with forward.examples(indices[sl] if indices is not None else None):
                    p, r, loss, norms = guarded(lambda xs, ys: self._aggregate(xs, ys, scale, need_ref),
                                                batch.take(x, sl), batch.take(y, sl), self.rows.layout.dim)
                check_finite_norms(norms, indices[sl] if indices is not None else None)
                if self._outputs is not None and len(loss):
                    self._outputs.append(source.last_out)
                yield r, p, loss
        finally:
            if source is not None:
                source.keep_output, source.last_out = False, None

    def _output_source(self):
        """What computes the step's forward where it can keep its output: the fast path, or the per-example
        gradients under the per-parameter rows (``ParamSums``); None elsewhere."""
        agg = getattr(self, "_aggregate", None)
        return agg if isinstance(agg, BookKeeping) else agg.grads if isinstance(agg, ParamSums) else None

    @property
    def outputs_kept(self) -> bool:
        """Whether ``step(..., keep_outputs=True)`` can hand back the batch's outputs (``last_outputs``)."""
        return self._output_source() is not None

    def train_epoch(self, x: "Batch | Dataset | PoissonLoader", y: Batch | None = None, **loader_options) -> float:
        """One epoch of Poisson batches; returns the mean example loss. The data: in-memory inputs
        ``x`` with labels ``y``, a map-style ``torch.utils.data.Dataset`` (``y`` omitted; ``loader_options``
        such as ``collate_fn`` and ``num_workers`` go to ``clipbias.sampling.PoissonLoader``) or a
        ``PoissonLoader``. Once the planned steps (``epochs`` or ``steps`` at construction) are all taken
        it refuses (ConfigError) rather than return having done nothing."""
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
        if self.algo.private and self.undrawn_steps:
            report = report.with_caveat(undrawn_caveat(self.undrawn_steps, self.steps_taken, self.sample_rate))
        if self.algo.private and getattr(getattr(self, "sampler", None), "skipped", 0):  # (None while being built)
            report = report.with_caveat(SKIPPED_CAVEAT.format(self.sampler.skipped))
        return report

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """All DP state except the model weights (save ``model.state_dict()`` beside it).

        PRIVATE: holds the error-feedback buffer and the secret key of the batches and the noise;
        never release it.
        """
        return {"settings": asdict(self.settings), "steps_taken": self.steps_taken, "undrawn_steps": self.undrawn_steps,
                "optimizer": self.optimizer.state_dict(), "optimizer_class": type(self.optimizer).__name__,
                "pipeline": self.pipeline.state_dict(),
                "sampler": self._sampler_state(), "secret_key": self.key.state_dict(),
                "rows": self.rows.state_dict(), "dropout_layouts": copy.deepcopy(self._dropout_layouts)}

    def _sampler_state(self) -> dict:
        """The sampler's state, with the batch it handed out last and no step has used (a loop that stopped
        after fetching it) first among the batches drawn ahead: the resumed run steps on it next."""
        state = self.sampler.state_dict()
        if self.sampler.last is not None:
            state["ahead"] = [self.sampler.last.clone()] + state["ahead"]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``; refuses (ResumeMismatchError) if a privacy setting changed.

        All or nothing: a state that fails to load leaves the engine as it was. Only a fresh engine
        (no step taken) loads a state: one that has taken steps would replay its own released draws.
        A state (a checkpoint) may drive ONE released continuation: two continuations draw the same
        batches and noise, and releasing both reveals their difference without noise."""
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
        check_resume(state["settings"], asdict(self.settings))
        check_optimizer_resume(state, self.optimizer)
        if self.steps_taken:
            raise ConfigError(f"load_state_dict: this engine has taken {self.steps_taken} step(s); loading a state "
                              f"into it would replay draws it has already released. Build a new DPEngine and load "
                              f"the state into that")
        backup = self.state_dict()
        try:
            self._load(state)
        except Exception:
            self._load(backup)  # the engine as it was, on its own key
            raise

    def _load(self, state: dict) -> None:
        key = SecretKey.from_state(state["secret_key"])  # the stream continues under the run's key
        key.adopt(self)
        self._set_key(key)
        self.steps_taken = state["steps_taken"]
        self.undrawn_steps = state.get("undrawn_steps", 0)
        self.optimizer.load_state_dict(state["optimizer"])
        self.pipeline.load_state_dict(state["pipeline"])
        self.sampler.load_state_dict(state["sampler"])
        self.rows.load_state_dict(state.get("rows", state.get("grads", {})))  # "grads": before the redesign
        # the keyed dropout calls' layouts recorded before (randomness.forward's guard; absent: before the guard)
        self._dropout_layouts = copy.deepcopy(state.get("dropout_layouts", {}))

    def _set_key(self, key: SecretKey) -> None:
        """Every secret draw of the run under ``key``: sampler, row source, keyed stages (noise, perturbation)."""
        self.key = self.rows.key = self.sampler.key = key
        for _, stage in self.pipeline.named_stages():
            if isinstance(getattr(stage, "key", None), SecretKey):
                stage.key = key


def noise_multiplier_for(engine: DPEngine, epsilon: float | None, noise_multiplier: float | None) -> float:
    """The given noise multiplier, or the one calibrated to ``epsilon`` for all the engine's steps (0 for a
    non-private algorithm)."""
    if not engine.algo.private:
        return 0.0
    if noise_multiplier is not None:
        return privacy.report.check_positive(noise_multiplier, "--noise-multiplier")
    if epsilon is None:
        raise ConfigError(f"{engine.algo.name} is private: give --epsilon (calibrates the noise) or "
                          f"--noise-multiplier")
    spec = banded_spec(engine.algo.spec(engine.config, engine.sample_rate, 0.0, engine.expected_batch_size),
                       engine.bands)
    # in a process group rank 0 calibrates and every rank takes its answer (and its error, if any)
    return distributed.from_rank0(lambda: privacy.calibrate(spec, epsilon, engine.delta, engine.total_steps,
                                                            engine.accountant, engine.dice_accounting))


def check_rate(sample_rate: float) -> float:
    """A given sampling rate: a float in (0, 1]."""
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
        raise ConfigError(f"sample_rate must be a number in (0, 1], got {sample_rate!r}")
    return float(sample_rate)


def check_base_optimizer(optimizer: torch.optim.Optimizer | None, params: list,
                         names: list[str]) -> torch.optim.Optimizer | None:
    """The caller's base optimizer (None: the engine builds its own), refused unless it updates exactly the
    model's trainable parameters: the private update covers those, and clipping bounds their joint norm."""
    if optimizer is None:
        return None
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer must be a torch.optim.Optimizer (SGD, Adam, ...), got {type(optimizer).__name__}")
    mine = {id(p) for p in params}
    theirs = [p for g in optimizer.param_groups for p in g["params"]]
    missing = [n for n, p in zip(names, params) if id(p) not in {id(q) for q in theirs}]
    extra = [p for p in theirs if id(p) not in mine]
    if missing or extra:
        what = (f"the model's trainable parameters {missing[:3]} are not in the optimizer" if missing else
                f"{len(extra)} optimizer parameter(s) are not trainable parameters of the model")
        raise ConfigError(f"optimizer: {what}. The private update covers every trainable parameter of the model and "
                          f"nothing else: set requires_grad=False on the parameters you do not train, and give the "
                          f"optimizer exactly the others")
    return optimizer


UNDRAWN_WARNING = ("DPEngine.step got a batch that its Poisson sampler did not draw (no indices, indices of your "
                   "choosing, or a batch used twice): the accounting assumes secret Poisson sampling, so this run is "
                   "no longer certified (engine.privacy() says why). Draw batches with engine.sampler.sample(), "
                   "engine.train_epoch, clipbias.sampling.PoissonLoader or clipbias.PrivacyEngine's data loader")


def undrawn_caveat(undrawn: int, steps: int, q: float) -> str:
    return (f"{undrawn} of the {steps} steps took batches the engine's Poisson sampler did not draw: the accounting "
            f"assumes every batch is a secret Poisson sample at rate q = {q:.6g} (each example in independently), "
            f"which nothing guarantees for those batches")


SKIPPED_CAVEAT = ("{} batch(es) drawn by the sampler were passed over by the training loop (sampled again before a "
                  "step used them): a loop that chooses batches by their content (skipping small or empty ones, "
                  "redrawing) includes examples at another rate than the accounted q")


SEEDED_CAVEAT = ("batches and noise derived from a user-given seed (a reproducible run): the guarantee holds only "
                 "while that seed stays secret and unguessable; anyone who has it can recompute the batches and "
                 "subtract the noise")

