"""``DPEngine``: one private training run's moving parts, with one ``state_dict``.

It owns the Poisson sampler, the per-example gradient backend, the update pipeline, the base torch
optimizer and the privacy accountant (a step counter against the algorithm's ``AccountingSpec``).
``step(x, y)`` performs one logical step of the algorithm on a Poisson batch, splitting it into
physical micro-batches without changing the math; an empty batch is a noise-only step and is
accounted like any other.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from .. import algorithms, privacy
from ..data import batch
from .. import distributed
from ..data.batch import Batch
from ..config import AlgoConfig
from ..errors import ConfigError
from ..algorithms.bands import NoiseStrategy
from ..grads.fast import BookKeeping, rule_kind
from ..grads.path import GradPath
from ..grads.rows import RowsPath
from ..grads.rows import LossFn, PerSampleGradients, RowSource, as_row_source, cross_entropy
from ..sampling.loader import PoissonLoader
from ..privacy import PrivacyReport
from ..randomness import SecretKey
from ..sampling.poisson import PoissonSampler
from . import accounting, state as saved
from .accounting import SEEDED_CAVEAT  # noqa: F401  (SEEDED_CAVEAT: engine's API)
from .sum_precision import apply_sum_precision
from .aggregate import apply_update, attempt_sums, drop_staged, engine_aggregate, output_source, with_fall_back
from .guard import StateGuard
from .checks import check_arguments, check_distributed, check_mixed, check_step
from .loop import run_steps
from .plan import PrivacySettings, StepPlan, make_plan  # noqa: F401  (PrivacySettings, StepPlan: engine's API)


class DPEngine:
    """Private training with one of ``clipbias.algorithms.ALGORITHMS``.

    Give either ``epsilon`` (the noise multiplier is calibrated for the planned steps, never overshooting) or
    ``noise_multiplier``. Without ``steps`` and ``epochs``, and with ``noise_multiplier``, the run is
    open-ended (Opacus's habit): ``total_steps`` is infinite and ``privacy()`` accounts the steps taken.

    Randomness: the model init is the caller's (public). The batches, the noise and every keyed draw
    are ChaCha20 draws under one 256-bit ``SecretKey`` (``clipbias.randomness``): by default 256 OS bits,
    kept only in the private ``state_dict``.

    Args:
        model: The model; its trainable parameters are the ones trained.
        algorithm: The algorithm's name: ``"dpsgd"``, ``"dice"``, ``"disk"``, ``"adaptive"``, ... (a name of
            ``clipbias.algorithms.ALGORITHMS``, or ``BASE+SUFFIX`` such as ``"dice+disk"``).
        n: The number of training examples.
        batch_size: The *expected* Poisson batch size B; the sampling rate is q = B / n.
        epochs: The planned epochs: ``steps`` defaults to ``epochs * round(n / B)``.
        steps: The planned steps (instead of ``epochs``).
        epsilon: The target epsilon: the noise multiplier is calibrated for the planned steps, never
            overshooting. Give it or ``noise_multiplier``.
        delta: Delta of the guarantee (default 1e-5).
        noise_multiplier: The noise multiplier z, instead of ``epsilon``.
        accountant: ``"pld"`` (default) or ``"rdp"``.
        dice_accounting: The basis error-feedback algorithms (the DiceSGD family) are accounted by:
            ``"sound"`` (default), ``"conservative"``; ``"paper"`` and ``"authors"`` are refuted and report
            ``certified = False``.
        config: The hyper-parameters (default ``AlgoConfig()``). Without ``config.ef_clip`` the DiceSGD
            family uses C2 = 0.01 C1 / B (feedback ratio r = 0.01).
        loss_fn: The per-example loss, ``(model output, y) -> [b]`` (default: cross-entropy).
        max_physical_batch: Examples per per-example gradient computation (memory only; default 512).
        noise_seed: An integer below 2^256, or a ``SecretKey``: makes a run reproducible, and ``privacy()``
            then reports it uncertified (default None: a fresh key of 256 OS bits).
        grads: The rows: a ``RowSource`` or a per-example gradient function (default: the algorithm's own
            source).
        grad_path: How the per-example gradients are computed: ``"auto"`` (default), ``"rows"``
            (``torch.func``) or ``"fast"`` (book-keeping, no per-example rows; docs/models.md).
        bands: > 1: banded correlated noise (``clipbias.algorithms.bands``) of that many bands; with
            ``bands_strategy="blt"``, BLT noise in that many participation classes.
        optimizer: Your own torch optimizer, holding exactly the model's trainable parameters: it takes the
            private update (default: one built from ``config``: SGD, Adam or AdamW).
        sample_rate: Sets q instead of B / n, for ``n`` rows that are a keyed random part of a public
            population (a ``--validation`` split: q = B / the part's expected size, so that q, the steps and
            the noise do not reveal the realised n; each row joins a batch with probability q, the update is
            divided by B; ``steps`` defaults to ``epochs * round(1 / q)``).
        autocast: ``torch.bfloat16`` (CPU or CUDA) or ``torch.float16``: each step's forward and backward run
            under ``torch.autocast`` on the parameters' device, while the parameters, the per-example norms,
            the clip factors and every sum across examples stay in float32 (float64 where the fast path uses
            it): 16-bit activations and output gradients are widened to float32, exactly, before any of them
            (docs/privacy.md, "Floating point in the fast path"). A step called inside the caller's own
            ``torch.autocast`` is refused (the sums would be 16-bit), as are 16-bit parameters.
        loss_scale: A power of two (default 1 under bfloat16, 256 under float16) that multiplies the loss
            before the backward and is divided out exactly after: float16 output gradients below 2^-24
            would otherwise flush to zero.
        bands_strategy: The banded noise's coefficients: ``"taylor"`` (default) or ``"optimized"`` for the
            run's finite number of steps (the same privacy guarantee, ``clipbias.algorithms.band_strategy``);
            ``"blt"``: BLT noise.
        noise_prefetch: Whether each step's noise (its standard normals: data-independent, a function of the key and
            the draw counter) is drawn in a background thread while the step's forward and backward run, on a CUDA
            device on a side stream (``clipbias.randomness.prefetch``): True, False, or None (default: off,
            ``prefetch.DEFAULT``, whose docstring gives the measurements: slower on the 2-core CPU measured). The
            same release bit for bit either way; drawing ahead holds one float64 vector of the update's size (8
            bytes a coordinate), reused from step to step.
        sum_precision: ``"float64"`` (default) or ``"float32"``: the fast path's ghost-layer clipped sums from
            per-example float32 gradients, with the sensitivity ``C (1 + 2^-10)`` their proven rounding allows
            and the noise scaled to it (``engine.sum_delta``; docs/privacy.md, "Float32 clipped sums").

    Raises:
        ConfigError: both ``epsilon`` and ``noise_multiplier``, or neither for a private algorithm; neither
            ``epochs`` nor ``steps`` where the run must be planned (``epsilon``); any setting outside its
            range (the message names it); settings the algorithm's guarantee does not cover (refused now,
            not after training).

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
                 dice_accounting: str | privacy.DiceBasis = privacy.DEFAULT_DICE_ACCOUNTING,
                 config: AlgoConfig | None = None,
                 loss_fn: LossFn = cross_entropy, max_physical_batch: int = 512,
                 noise_seed: int | SecretKey | None = None, grads: RowSource | PerSampleGradients | None = None,
                 grad_path: str = "auto", bands: int = 1, optimizer: torch.optim.Optimizer | None = None,
                 sample_rate: float | None = None, autocast: torch.dtype | str | None = None,
                 loss_scale: float | None = None, bands_strategy: str | NoiseStrategy = "taylor",
                 noise_prefetch: bool | None = None, sum_precision: str = "float64") -> None:
        self.autocast = check_mixed(autocast, loss_scale, grads)  # (dtype, loss scale) or None
        self.undrawn_steps = 0  # steps whose batch the engine's sampler did not draw (``privacy`` caveat)
        self.transformed_steps = 0  # steps on a batch other than the one the loader drew (``drawn``)
        self.unproven_steps = 0  # steps on a loop's loss not proved per example (the Opacus interface's ``follow``)
        n = check_arguments(model, n, batch_size, config or AlgoConfig())
        self.sharded = distributed.is_sharded(model)  # fully_shard: gathered whole for each step (``_gathered``)
        if self.sharded:
            distributed.check_sharded(model, rule_kind)
        if max_physical_batch < 1:
            raise ConfigError(f"max_physical_batch must be >= 1, got {max_physical_batch!r}")
        # the run's plan: participation, mechanism, calibrated noise, accounting (nothing of the data or model)
        self.plan = make_plan(algorithm, config or AlgoConfig(), n=n, batch_size=batch_size, epochs=epochs,
                              steps=steps, epsilon=epsilon, delta=delta, noise_multiplier=noise_multiplier,
                              accountant=accountant, dice_accounting=dice_accounting, bands=bands,
                              sample_rate=sample_rate, bands_strategy=bands_strategy)
        self.algo, self.config, z, steps = self.plan.algo, self.plan.config, self.noise_multiplier, self.total_steps
        # in a process group every rank holds rank 0's key: one global sample, one noise draw
        self.key = distributed.broadcast_key(SecretKey.of(noise_seed))
        self.key.adopt(self)
        self._dropout_layouts: dict = {}  # each keyed dropout call's layout as the first forward made it
        self.state_guard = StateGuard(model)  # a forward on the private batch may not write the model
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
        self.pipeline = self.algo.pipeline(self.config, self.expected_batch_size, z, self.key, self.noise_shape,
                                           self.plan.strategy.name)  # (the noise stage's state records the name)
        set_prefetch(self.pipeline, noise_prefetch)
        self.optimizer = check_base_optimizer(optimizer, self.params, self.rows.layout.names) or \
            algorithms.make_optimizer(self.config.optimizer or self.algo.optimizer, self.params, self.config)
        self.sampler = PoissonSampler(n, self.sample_rate, self.key, self.plan.steps_per_epoch, bands)
        self.max_physical_batch = max_physical_batch
        self._sharded = None  # fully_shard with sums sharded: set by engine_aggregate (engine/sharded.py)
        # the step's gradient path (grads.path.GradPath): the engine calls its ``sums`` and asks it, never its class
        self.path, choice = engine_aggregate(self, grad_path, own_rows, model, loss_fn, max_physical_batch)
        self.plan = self.plan.with_path(choice)  # which gradient path, and why (``PathChoice``)
        self.grad_path = grad_path
        self._views_path = None  # (path, rows) of the steps with several views of each example (``views``)
        self.own_rows = own_rows  # a given backend may read labels its own way (the audit's canaries: y < 0)
        self.world_size = check_distributed(self.algo.name, self.rows, self.pipeline)
        self.grad_path_fallback: str | None = None  # grad_path="auto"'s fall-back, once it has happened
        self.path = with_fall_back(self, grad_path)  # auto: the other path taken if the chosen one refuses the first step
        # sum_precision (engine/sum_precision.py): "float32" ghost-layer sums, the noise scaled to C (1 + delta)
        apply_sum_precision(self, sum_precision)
        self.steps_taken, self.last_loss = 0, (0.0, 0)
        self.last_outputs, self._outputs = None, None  # step(keep_outputs=True)

    # ------------------------------------------------------------------ the plan's values, as the engine's
    n = property(lambda self: self.plan.n)
    expected_batch_size = property(lambda self: self.plan.expected_batch_size)
    sample_rate = property(lambda self: self.plan.sample_rate)
    total_steps = property(lambda self: self.plan.total_steps)
    delta = property(lambda self: self.plan.delta)
    accountant = property(lambda self: self.plan.accountant)
    dice_accounting = property(lambda self: self.plan.dice_accounting)  # the settings' spellings
    bands = property(lambda self: self.plan.bands)
    bands_strategy = property(lambda self: self.plan.bands_strategy)
    grad_path_note = property(lambda self: self.plan.path.note)  # the header's words for ``plan.path``
    mechanism = property(lambda self: self.plan.mechanism)  # typed: privacy.Mechanism
    strategy = property(lambda self: self.plan.strategy)  # typed: algorithms.bands.NoiseStrategy
    noise_shape = property(lambda self: self.plan.noise_shape)
    noise_multiplier = property(lambda self: self.plan.noise_multiplier)
    spec = property(lambda self: self.plan.spec)
    settings = property(lambda self: self.plan.settings)

    # ------------------------------------------------------------------ training
    def step(self, x: Batch, y: Batch, indices: Tensor | None = None, *, keep_outputs: bool = False,
             public: list | None = None, views: bool = False) -> Tensor:
        """One logical step on the Poisson batch ``(x, y)``.

        In a process group of N ranks, ``(x, y, indices)`` is this rank's share of the global batch
        (``engine.local_share`` of the sampled indices; ``run_steps`` does it): the partial sums
        are all-reduced once and every rank applies the same update. ``last_loss`` is the global
        (loss sum, example count) of the step. A model sharded with ``fully_shard`` is gathered whole on
        every rank for the sums (``distributed.unsharded``) and each rank applies its shards' slice of the
        update (docs/architecture.md, "Sharded models").

        Args:
            x: The inputs: a tensor or any ``clipbias.data.batch.Batch`` (tuples, dicts of tensors: the
                model is called ``model(**x)`` for a dict), with the examples on the first dimension; an
                empty batch (zero examples) is a noise-only step.
            y: The targets, likewise.
            indices: The batch ``engine.sampler.sample()`` returned last (this rank's share of it), used by
                no step before: any other batch (no indices, indices of your choosing, a batch used twice)
                is taken, with a warning, and makes ``privacy()`` uncertified, with a caveat that counts
                such steps.
            keep_outputs: Where ``outputs_kept`` says the gradient path can: ``last_outputs`` is then the
                model's output on the batch from the step's own forward (detached), so a loop needs no
                second forward.
            public: A gradient that depends on no private example (one tensor or None per parameter, layout
                order: a forward on generated or public data, a term of the parameters alone), added to the
                noisy update as it is (post-processing; ``apply_update``).
            views: Each example ran through the model K times (augmented views): every tensor of ``x`` and of
                ``y`` is ``[b, K, ...]``, example i's views and their targets. Example i's gradient is the sum of
                ``loss_fn(model(x_i^k), y_i^k)``'s gradients over its K views, clipped as one example's (the
                sensitivity is unchanged). Such a step takes the rows path (``views_path``; refused under
                ``grad_path="fast"``) and refuses dropout masks (``grads.rows.VIEWS_DROPOUT``).

        Returns:
            The per-example losses of this rank's examples.

        Raises:
            NonFiniteGradientError: a per-example gradient is not finite; raised before changing anything
                (model, optimizer, error feedback, accountant), on every rank when one rank's is not.
            ConfigError: ``keep_outputs`` where the gradient path does not produce the outputs, and what
                ``check_step`` refuses (indices no Poisson batch holds, labels of the wrong dtype, ...).
        """
        y = check_step(self, x, y, indices)  # (int32 class indices as torch.long)
        self.state_guard.check_between_steps()  # state written since the last step ended (guard)
        if keep_outputs and not self.outputs_kept:
            raise ConfigError("keep_outputs: this gradient path does not produce the batch's outputs (only the fast "
                              "path and the per-parameter rows of a norm-scaling algorithm do)")
        if views:
            check_views(x, y)
            if keep_outputs:
                raise ConfigError("keep_outputs: a step with views does not keep the batch's outputs")
        # (drawn by the sampler, as the loader fetched it; with views, each view compared with the fetched batch)
        drawn = accounting.origin(self, split_views(x) if views else x, split_views(y) if views else y, indices)
        self.last_outputs, self._outputs = None, [] if keep_outputs else None
        dev = self.params[0].device
        # the noise does not depend on the data: its normals are drawn while the sums are computed (joined by the
        # commit or the rollback below, so no draw outlives the step)
        self.pipeline.draw_ahead(self.rows.layout.dim, dev)
        if views:  # the rows path, on each example's K views (auto's choice waits for a step without views)
            saved = self.path, self.rows
            self.path, self.rows = views_path(self)  # (no fall-back: a path of its own)
            try:
                proc_sum, ref_sum, losses, failure = attempt_sums(self, x, y, indices, keep_outputs, views=True)
            finally:
                self.path, self.rows = saved
        else:
            proc_sum, ref_sum, losses, failure = attempt_sums(self, x, y, indices, keep_outputs)
        if batch.size(x) and failure is None and not views:
            self.path = self.path.settled()  # auto's choice stands from the first step that ran the model
        mine = torch.cat(losses) if losses else torch.zeros(0, device=dev)
        self.last_loss = (float(mine.sum()), len(mine))
        if self._outputs:
            self.last_outputs = batch.cat(self._outputs)
        if self.world_size > 1:  # the one all-reduce of the step: global sums, and did any rank fail
            proc_sum, ref_sum, loss_sum, count, failure = distributed.reduce_step(
                proc_sum, ref_sum, mine, failure, reduced=self._sharded is not None)  # (fully_shard: engine/sharded.py)
            self.last_loss = (loss_sum, count)
        if failure is not None:  # every stage drops what it staged, on every rank
            drop_staged(self)
            raise failure
        try:
            update = (self._sharded or self.pipeline).finish(proc_sum, ref_sum)  # (fully_shard: engine/sharded.py)
        except BaseException:
            drop_staged(self)
            raise
        # once the noisy update exists it counts as released, before it reaches the model (an interrupt
        # between applying it and counting it would let a later step reuse its noise draw, whose
        # difference with this release cancels the noise, or shift the classes of banded noise): its
        # draws are never drawn again and the step is accounted
        self.pipeline.commit()
        self.rows.commit()
        self.steps_taken += 1
        accounting.count_origin(self, drawn)
        self.sampler.settle()
        apply_update(self, update, public)
        self.state_guard.stepped()  # (the next step refuses state written in between: check_between_steps)
        return mine

    @property
    def fast(self) -> BookKeeping | None:
        """The book-keeping fast path when this engine runs it (``--grad-path``), else None."""
        path = getattr(self, "path", None)  # None while the engine is being built
        return path.book_keeping() if path is not None else None

    @property
    def _aggregate(self) -> GradPath | None:
        """The path as the engine held it before paths were objects: None for the rows through the pipeline
        (``grads.rows.RowsPath``); setting None takes that path."""
        return None if self.path.kind == "rows" else self.path

    @_aggregate.setter
    def _aggregate(self, path: GradPath | None) -> None:
        self.path = RowsPath() if path is None else path

    def local_share(self, indices: Tensor, step: int | None = None) -> Tensor:
        """This rank's share of the global sample ``indices`` (all of it with one process): the
        examples the row source assigns to this rank at ``step`` (default: the coming step;
        ``RowSource.owners``)."""
        if self.world_size == 1:
            return indices
        step = self.steps_taken if step is None else step
        return distributed.local_share(indices, self.rows.owners(indices, step, self.world_size))

    @property
    def outputs_kept(self) -> bool:
        """Whether ``step(..., keep_outputs=True)`` can hand back the batch's outputs (``last_outputs``)."""
        return output_source(self) is not None

    def train_epoch(self, x: "Batch | Dataset | PoissonLoader", y: Batch | None = None, **loader_options) -> float:
        """One epoch of Poisson batches.

        Args:
            x: The data: in-memory inputs (with labels ``y``), a map-style ``torch.utils.data.Dataset``
                (``y`` omitted), or a ``PoissonLoader``.
            y: The labels of in-memory inputs ``x`` (exactly the n training examples).
            **loader_options (Any): For a ``Dataset``: ``clipbias.sampling.PoissonLoader``'s options, such
                as ``collate_fn`` and ``num_workers``.

        Returns:
            The mean example loss.

        Raises:
            ConfigError: once the planned steps (``epochs`` or ``steps`` at construction) are all taken,
                rather than return having done nothing; inputs and labels that are not n each.
        """
        if y is not None and (batch.size(x) != batch.size(y) or batch.size(x) != self.n):
            raise ConfigError(f"train_epoch got {batch.size(x)} inputs and {batch.size(y)} labels for an engine "
                              f"built with n={self.n}: the sampler draws from n examples and the accounting assumes "
                              f"n; pass exactly the n training examples (or build the engine with n={batch.size(x)})")
        total, count = run_steps(self, x, y, len(self.sampler), **loader_options)
        return total / max(count, 1)

    # ------------------------------------------------------------------ privacy
    def privacy(self, steps: int | None = None) -> PrivacyReport:
        """The guarantee after ``steps`` steps.

        Args:
            steps: The steps to account (default: the steps taken so far).

        Returns:
            The ``PrivacyReport``. A run keyed by a seed (``noise_seed``) is reported ``certified=False``:
                whoever knows or guesses the seed can recompute the batches and subtract the noise.
        """
        return accounting.report(self, self.steps_taken if steps is None else steps)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """All DP state except the model weights (save ``model.state_dict()`` beside it).

        PRIVATE: holds the error-feedback buffer and the secret key of the batches and the noise;
        never release it.
        """
        return saved.state_of(self)

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state_dict()``.

        All or nothing: a state that fails to load leaves the engine as it was. A state (a checkpoint) may
        drive ONE released continuation: two continuations draw the same batches and noise, and releasing
        both reveals their difference without noise.

        Args:
            state: What ``state_dict()`` returned.

        Raises:
            ResumeMismatchError: a privacy setting (or the base optimizer) differs from the state's.
            ConfigError: not a ``DPEngine`` state, or an engine that has taken steps (only a fresh engine
                loads a state: one that has taken steps would replay its own released draws).
        """
        saved.load(self, state)


def check_views(x: Batch, y: Batch) -> None:
    """Refuse a views step (``DPEngine.step(..., views=True)``) whose tensors are not all ``[b, K, ...]`` with one
    K, K >= 1."""
    ks = {t.shape[1] if t.dim() >= 2 else None for t in batch.leaves(x) + batch.leaves(y)}
    if None in ks or len(ks) != 1 or 0 in ks:
        raise ConfigError(f"views: every tensor of the inputs and targets must be [b, K, ...], the K views of each "
                          f"example on the second dimension, with one K for all (got second dimensions "
                          f"{sorted(str(k) for k in ks)})")


def split_views(x: Batch) -> list:
    """The views of a views batch ``[b, K, ...]``: K batches of ``[b, ...]``."""
    k = batch.leaves(x)[0].shape[1]
    return [batch.tree_map(lambda t, i=i: t[:, i], x) for i in range(k)]


def views_path(engine: DPEngine) -> tuple:
    """(path, rows) of a step with several views of each example: the per-example gradients of the sum of
    the views' losses (``FuncGradients(views=True)``), summed per parameter where the step only scales rows by
    their norms (the fast path's steps too: book-keeping has no per-example sum over views), else per-example
    rows through the pipeline. Built once; refused (``ConfigError``, with the reason) where the engine does not
    compute its per-example gradients itself with torch.func, and under ``grad_path="fast"``."""
    if engine._views_path is not None:
        engine._views_path[1].key = engine.key  # (a state loaded since: the run's key)
        return engine._views_path
    from ..grads.rows import FuncGradients, ParamSums, PerExampleRows
    why = ("`grad_path='fast'` was asked for, and the fast path (book-keeping) has no per-example sum over views: "
           "use `grad_path='auto'` or `grad_path='rows'`" if engine.grad_path == "fast" else
           "the model is sharded with fully_shard, whose steps take the fast path" if engine.sharded else
           "a gradient backend was given" if not engine.own_rows else
           "DiSK's two points" if engine.path.two_point else None)
    agg, rows = RowsPath(), engine.rows
    if why is None and engine.path.kind != "rows":  # a norm-scaling step: the rows summed per parameter
        agg = ParamSums(FuncGradients(engine.model, engine.loss_fn, views=True))
    elif why is None and type(rows) is PerExampleRows and isinstance(rows.grads, FuncGradients) \
            and not rows.grads.grouped:
        rows = PerExampleRows(FuncGradients(engine.model, engine.loss_fn, views=True))
        rows.key = engine.key
    elif why is None:
        why = f"--algo {engine.algo.name} computes its own rows"
    if why is not None:
        raise ConfigError(f"a step with several forwards of each example (views, summed per example before clipping) "
                          f"is not available here: {why}")
    engine._views_path = (agg, rows)
    return engine._views_path


def set_prefetch(pipeline, noise_prefetch: bool | None) -> None:
    """``DPEngine(noise_prefetch=...)`` on the noise stage (``GaussianNoise.prefetch``), checked."""
    if noise_prefetch is not None and not isinstance(noise_prefetch, bool):
        raise ConfigError(f"noise_prefetch must be True, False or None (the default), got {noise_prefetch!r}")
    if pipeline.noise is not None:
        pipeline.noise.prefetch = noise_prefetch


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
