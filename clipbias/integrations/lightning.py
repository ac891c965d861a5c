"""Private training with Lightning: add ``DPCallback`` to your ``Trainer`` and fit as usual.

    import lightning as L
    from clipbias.integrations.lightning import DPCallback
    dp = DPCallback(target_epsilon=3.0, max_grad_norm=1.0)     # or noise_multiplier=1.1
    L.Trainer(max_epochs=5, callbacks=[dp]).fit(module, DataLoader(train, batch_size=64))
    print(dp.privacy_report())

What it does (docs/integrations.md): your train DataLoader's dataset is drawn in secret Poisson batches by the
engine (expected size B = the DataLoader's ``batch_size``, with its ``collate_fn`` and workers); the
optimizer from ``configure_optimizers`` is made private (its schedulers keep stepping it); each optimizer step
runs your ``training_step`` and the backward of the loss it returns, as Lightning does, with your module's
forward on the batch as the call of the run's ``Session`` (the Opacus interface's core, ``session``): run
without a graph, its outputs handed as leaves that receive the gradient of your loss; then the engine's
private step on the batch: each example's gradient of the loss ``training_step`` computes (proved a sum of
per-example terms, ``rowtrace``; or of ``criterion`` where you pass one), clipping, secret noise, and your
optimizer's ``step`` on the private update. ``epsilon`` is logged with ``self.log``. A batch changed after the
draw (``on_after_batch_transfer``, an in-place edit in ``training_step``) makes the report uncertified
(``clipbias.engine.drawn``); validation on the training data is refused.
"""

from __future__ import annotations

from typing import Any, Callable

import lightning as L
from torch.utils.data import DataLoader

from ..engine import DPEngine
from ..errors import ConfigError
from ..privacy import PrivacyReport
from .losses import loss_function
from .options import DPOptions, check_count
from .refusals import check_given_loader, check_loader, check_monitors, check_trainer, check_validation_data
from .released import LIGHTNING_RELEASED
from .session import DPDataLoader, DPOptimizer, Session

__all__ = ["DPCallback", "DPLightningDataModule"]


class DPCallback(L.Callback):
    """Makes ``Trainer.fit`` private: pass it in ``callbacks`` (see the module's docstring).
    ``privacy_report()`` states the guarantee; ``epsilon`` is logged with ``self.log`` (on the progress bar).

    Args:
        noise_multiplier: The noise multiplier z, fixed; epsilon is accounted as the steps are taken. Give
            it or ``target_epsilon``.
        target_epsilon: The epsilon the run ends at: the noise multiplier is calibrated for
            ``max_epochs`` / ``max_steps``.
        target_delta: Delta of the guarantee; default ``min(1e-5, 1 / (10 n))`` for ``n`` training examples.
        max_grad_norm: The per-example clipping norm C.
        criterion: Leave it out to train the loss your ``training_step`` returns (each example's gradient
            from its backward, proved per example: ``rowtrace``; docs/integrations.md). Given, the step
            differentiates it per example instead, on your module's outputs and the batch's targets ``y``
            (or the ``labels`` entry of a dict batch): a loss module with ``reduction`` (evaluated per
            example) or a function returning per-example losses ``[b]``; a warning says so where the loss
            ``training_step`` returns is not ``criterion``'s.
        max_physical_batch: Examples per per-example gradient computation (memory only; default 512).
        **options (Any): The other settings of
            [`DPOptions`][clipbias.integrations.options.DPOptions]: ``algorithm``, ``grad_path``,
            ``accountant``, ``bands``, ``autocast``, ...

    Raises:
        ConfigError: settings ``DPOptions.check`` refuses, or ``max_physical_batch`` not an integer >= 1.
            ``fit`` refuses, with the reason, what the private step cannot run soundly (16-bit precision,
            several devices, ``accumulate_grad_batches``, ``gradient_clip_val``, manual optimization,
            validation on the training data, ...).
    """

    def __init__(self, *, noise_multiplier: float | None = None, target_epsilon: float | None = None,
                 target_delta: float | None = None, max_grad_norm: float = 1.0, criterion: Callable | None = None,
                 max_physical_batch: int = 512, **options: Any) -> None:
        self.options = DPOptions(noise_multiplier=noise_multiplier, target_epsilon=target_epsilon,
                                 target_delta=target_delta, max_grad_norm=max_grad_norm, **options)
        self.options.check()
        check_count("max_physical_batch", max_physical_batch)
        self.loss_fn = loss_function(criterion, follow=criterion is None)
        self.max_physical_batch = max_physical_batch
        self.engine: DPEngine | None = None
        self.session: Session | None = None
        self.data: DataLoader | None = None       # your train DataLoader (its dataset, batch size, collate_fn)
        self._state: dict | None = None           # a checkpoint's private state, loaded once the engine exists

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        check_trainer(trainer, pl_module)
        loop = trainer.fit_loop
        if not isinstance(loop._data_source, _PrivateSource):
            loop._data_source = _PrivateSource(loop._data_source, self)
        loop._combined_loader = None  # built again, through the private source

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        trainer.fit_loop._combined_loader = None  # (configure_optimizers may have read the loader's length)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.data is None:
            raise ConfigError("DPCallback: the train dataloader was not requested through the private source")
        check_validation_data(self.data, trainer)
        optimizers = trainer.strategy.optimizers
        if len(optimizers) != 1:
            raise ConfigError(f"DPCallback trains with one optimizer; configure_optimizers returned {len(optimizers)}")
        optimizer = optimizers[0]
        if self._state is None and trainer.global_step > 0:
            raise ConfigError(f"DPCallback: this fit resumes at step {trainer.global_step} (ckpt_path=), and the "
                              f"checkpoint holds no DPCallback state: the private steps before it could not be "
                              f"accounted. Resume from a checkpoint a private run saved (its DPCallback state inside), "
                              f"or load the weights into the module and fit without ckpt_path (a new run, accounted "
                              f"from 0; its epsilon adds to any earlier run's on the same data)")
        if self.engine is not None:
            raise ConfigError(f"this DPCallback has accounted {self.engine.steps_taken} steps of a run: to continue "
                              f"that run pass ckpt_path= to fit (a new DPCallback loads its state); a new "
                              f"DPCallback starts a new run, accounted on its own")
        check_given_loader(getattr(self, "given", None), self.data)  # (make_private's: ``opacus_lightning``)
        n, B = len(self.data.dataset), self.data.batch_size
        self.engine = self.options.engine(pl_module, optimizer, n=n, batch_size=B, steps=planned_steps(trainer),
                                          loss_fn=self.loss_fn, max_physical_batch=self.max_physical_batch)
        if self._state is not None:
            self.engine.load_state_dict(self._state)
            self._state = None
        # (eager=False: the step comes after training_step, whose closure runs under the state guard)
        self.session = Session(self.engine, released=LIGHTNING_RELEASED, eager=False)
        follow(pl_module, self.session)
        trainer.strategy.optimizers = [DPOptimizer(optimizer, self.session, guard_closure=True)]

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        source = getattr(trainer.fit_loop, "_data_source", None)  # (before training: the DataLoader given to fit)
        given = getattr(source, "instance", None)
        check_validation_data(self.data if self.data is not None else
                              given if isinstance(given, DataLoader) else None, trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        check_monitors(trainer)
        last = batch_idx + 1 >= trainer.num_training_batches
        if self.engine is not None and (trainer.global_step % trainer.log_every_n_steps == 0 or last):
            epsilon = self.session.epsilon()
            pl_module.log("epsilon", epsilon, on_step=True, on_epoch=False, prog_bar=True)
            if last:
                log_epoch_end(trainer, epsilon)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage == "fit" and "forward" in vars(pl_module):
            del pl_module.forward  # (the class's own again: ``follow``)

    # ------------------------------------------------------------------ privacy and checkpoints
    def privacy_report(self) -> PrivacyReport:
        """The guarantee after the steps taken.

        Returns:
            The ``PrivacyReport``: epsilon, delta, accountant, basis, ``certified``, caveats.

        Raises:
            ConfigError: no private training yet (call ``trainer.fit`` first).
        """
        if self.session is None:
            raise ConfigError("DPCallback.privacy_report: no private training yet; call trainer.fit first")
        return self.session.report()

    def get_epsilon(self) -> float:
        """Epsilon after the steps taken, at the run's delta: ``privacy_report().epsilon``."""
        return self.privacy_report().epsilon

    def state_dict(self) -> dict:
        """The engine's private state (secret key, sampler, steps), saved in Lightning's checkpoints: a
        checkpoint file is then PRIVATE; release the module's weights only."""
        return {"engine": self.engine.state_dict()} if self.engine is not None else {}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict.get("engine") is not None:
            self._state = state_dict["engine"]


def log_epoch_end(trainer: L.Trainer, epsilon: float) -> None:
    """Epsilon to the loggers at the epoch's last batch: Lightning writes a step's ``self.log`` values to the
    loggers only every ``log_every_n_steps`` steps, so where that step is not one of them the value is written
    here, as Lightning would (its step numbering, with ``epoch``)."""
    connector = getattr(trainer, "_logger_connector", None)
    if not trainer.loggers or connector is None or connector.should_update_logs:
        return  # no logger, or Lightning writes this step itself
    connector.log_metrics({"epsilon": epsilon})


def planned_steps(trainer: L.Trainer) -> int | None:
    """Optimizer steps ``fit`` will take: ``max_epochs`` x batches per epoch, at most ``max_steps``."""
    per_epoch = trainer.num_training_batches
    epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs >= 0 else None
    by_epochs = int(epochs * per_epoch) if epochs is not None and per_epoch != float("inf") else None
    by_steps = trainer.max_steps if trainer.max_steps is not None and trainer.max_steps > 0 else None
    known = [s for s in (by_epochs, by_steps) if s is not None]
    return min(known) if known else None


class _PrivateSource:
    """Lightning's train-dataloader source, with your DataLoader replaced by the private Poisson batches."""

    def __init__(self, original: Any, callback: DPCallback) -> None:
        self.original, self.callback = original, callback
        self.instance, self.name = original.instance, original.name

    def dataloader(self) -> DPDataLoader:
        data = self.original.dataloader()
        data = data.original if isinstance(data, DPDataLoader) else data  # (``DPLightningDataModule``'s)
        check_loader(data, "the train DataLoader", "DPCallback needs one torch DataLoader(dataset, batch_size=B) as "
                     "the train dataloader, got {}: its dataset is drawn in Poisson batches of expected size B")
        old = self.callback.data
        if old is not None and (len(old.dataset) != len(data.dataset) or old.batch_size != data.batch_size):
            raise ConfigError("the train dataloader changed its dataset size or batch size during the run")
        self.callback.data = data
        loader = DPDataLoader(None, data, session_of=lambda: self.callback.session)
        loader.worker_init_fn = None  # (Lightning may set one; the workers' seeds come from the run's secret key)
        return loader

    def is_defined(self) -> bool:
        return self.original.is_defined()

    def is_module(self) -> bool:
        return self.original.is_module()


def follow(pl_module: L.LightningModule, session: Session) -> None:
    """Your module's forward, as Lightning's ``training_step`` calls it (``self(x)``), made the call of the
    run's ``Session`` (an attribute of the instance, removed at ``teardown``): on the private batch it is
    recorded for the step and its outputs are handed as leaves; elsewhere it is your forward."""
    forward = type(pl_module).forward.__get__(pl_module)

    def private_forward(*args, **kwargs):
        return session.call(forward, pl_module.training, args, kwargs)
    pl_module.forward = private_forward


class DPLightningDataModule:
    """Opacus's ``opacus.lightning.DPLightningDataModule``: your ``LightningDataModule``, whose
    ``train_dataloader()`` is marked for private training (a ``DPDataLoader``, as Opacus's, so that a script's
    ``poisson_sampling=isinstance(data_loader, DPDataLoader)`` holds); the ``DPCallback`` that ``make_private``
    adds draws its batches in secret Poisson batches. The other loaders and hooks are your data module's.
    An instance is a ``LightningDataModule`` of the package yours is built on (``lightning`` or
    ``pytorch_lightning``).

    Args:
        datamodule: Your ``LightningDataModule``.
        generator: Opacus's; only None (clipbias's batches are drawn under the run's secret key).

    Raises:
        ConfigError: not a LightningDataModule, or a ``generator``.
    """

    def __new__(cls, datamodule: Any, generator: Any = None):
        if cls is DPLightningDataModule:
            base = next((k for k in type(datamodule).__mro__ if k.__name__ == "LightningDataModule"), None)
            if base is None:
                raise ConfigError(f"DPLightningDataModule wraps a LightningDataModule, got {type(datamodule).__name__}")
            cls = _SUBCLASSES.setdefault(base, type("DPLightningDataModule", (DPLightningDataModule, base), {}))
        return object.__new__(cls)

    def __init__(self, datamodule: Any, generator: Any = None) -> None:
        if generator is not None:
            raise ConfigError("DPLightningDataModule(generator=...): clipbias draws the Poisson batches under the "
                              "run's secret 256-bit key; a torch generator would make them recoverable")
        super().__init__()
        self.datamodule = datamodule

    def prepare_data(self) -> None:
        self.datamodule.prepare_data()

    def setup(self, stage: str | None = None) -> None:
        self.datamodule.setup(stage)

    def teardown(self, stage: str | None = None) -> None:
        self.datamodule.teardown(stage)

    def train_dataloader(self):
        return DPDataLoader.marked(self.datamodule.train_dataloader())

    def val_dataloader(self):
        return self.datamodule.val_dataloader()

    def test_dataloader(self):
        return self.datamodule.test_dataloader()

    def predict_dataloader(self):
        return self.datamodule.predict_dataloader()

    def state_dict(self) -> dict:
        return self.datamodule.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.datamodule.load_state_dict(state_dict)


_SUBCLASSES: dict = {}
"""LightningDataModule class -> the DPLightningDataModule built on it."""
