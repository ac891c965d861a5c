"""The Opacus interface: ``PrivacyEngine().make_private(...)`` over your own model, optimizer, scheduler
and DataLoader, so that an Opacus training script runs by changing its import.

    from clipbias import PrivacyEngine                      # was: from opacus import PrivacyEngine
    privacy_engine = PrivacyEngine()
    model, optimizer, train_loader = privacy_engine.make_private(
        module=model, optimizer=optimizer, data_loader=train_loader, noise_multiplier=1.1, max_grad_norm=1.0)
    for x, y in train_loader:                               # secret Poisson batches of your Dataset
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()                                    # the private step (a DPEngine step)
    print(privacy_engine.get_epsilon(delta=1e-5))

How it works (docs/integrations.md): the returned data loader draws every batch with the engine's secret
Poisson sampler; the returned module records the inputs it is called with on that batch; ``DPEngine.step`` runs
on the recorded inputs, the loader's targets and the batch's indices: per-example gradients of ``criterion``
(rows or the fast path), clipping, the algorithm's stages, secret noise, and then your optimizer's own
``step`` on the private update. Where the engine can hand back the batch's outputs, the module's forward takes
that step and returns the step's own outputs (from the second batch on); elsewhere the forward runs without a
graph and ``optimizer.step()`` takes it. Either way the outputs support ``loss.backward()``, which costs almost
nothing. Everything the engine
guarantees holds here unchanged, and ``privacy_report()`` says what the epsilon rests on.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..engine import DPEngine
from ..engine.drawn import TRANSFORMED_CAVEAT  # noqa: F401  (the caveat's text: the engine's report carries it)
from ..errors import ConfigError
from ..privacy import PrivacyReport
from .losses import loss_function
from .opacus_accountant import Accountant
from .options import (DPOptions, check_accountant, check_count, check_opacus_keywords, check_positive,
                      opacus_settings, resolve_public_clip)
from .refusals import check_loader, check_opacus_options
from .released import LOOP_RELEASED
from .session import DPDataLoader, DPOptimizer, Session, epoch_steps
from .wording import OpacusEngine, speak_opacus, speaks_opacus  # noqa: F401  (speak_opacus: the interface's words)


class PrivacyEngine:
    """Opacus's ``PrivacyEngine``, backed by a ``clipbias.engine.DPEngine``.

    The attribute ``accountant`` is Opacus's accountant surface over the engine's accounting
    (``get_epsilon(delta=)``, ``history``, ``state_dict``: ``opacus_accountant.Accountant``). Errors raised by
    its entry points and by the private step name the Opacus interface's arguments (``criterion``, not the
    engine's ``loss_fn``).

    Args:
        accountant: ``"prv"`` (Opacus's default; served by the PLD accountant), ``"pld"`` or ``"rdp"``; the
            name stays in ``accountant_name``.
        secure_mode: Accepted for compatibility: clipbias's randomness is always secret (ChaCha20 under a
            256-bit key from the OS), so there is nothing to switch on.

    Raises:
        ConfigError: another accountant (``"gdp"``: a central-limit approximation, not an upper bound on
            epsilon).
    """

    def __init__(self, accountant: str = "prv", secure_mode: bool = False) -> None:
        check_accountant(accountant, why=True)
        self.accountant_name, self.secure_mode = accountant, secure_mode
        self.accountant = Accountant(self, accountant)  # Opacus's ``privacy_engine.accountant`` surface
        self._engine_: DPEngine | None = None
        self.module: DPModule | None = None
        self.optimizer: DPOptimizer | None = None
        self.data_loader: DPDataLoader | None = None
        self._session_: Session | None = None
        self.lightning = None  # the DPCallback of Opacus's Lightning pattern (``make_private_lightning``)

    @property
    def engine(self) -> DPEngine | None:
        """The run's ``DPEngine`` (in the Lightning pattern: its ``DPCallback``'s, once ``fit`` trains)."""
        return self.lightning.engine if self.lightning is not None else self._engine_

    @property
    def session(self) -> Session | None:
        return self.lightning.session if self.lightning is not None else self._session_

    # ------------------------------------------------------------------ making a training private
    @speaks_opacus
    def make_private(self, *, module: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader,
                     noise_multiplier: float, max_grad_norm: float, criterion: Callable | None = None,
                     batch_first: bool = True, loss_reduction: str = "mean", poisson_sampling: bool = True,
                     clipping: str = "flat", noise_generator: Any = None, grad_sample_mode: str = "hooks",
                     **clipbias_options) -> tuple:
        """Your ``(module, optimizer, data_loader)`` made private at ``noise_multiplier``; trains for as many
        steps as you take, each accounted (``get_epsilon``). What a ``make_private`` returned before (a
        resumed script passes the private module, optimizer or loader again) is unwrapped to your objects, as
        Opacus does.

        Args:
            module: Your model.
            optimizer: Your optimizer (any ``torch.optim`` class), holding the model's trainable parameters.
            data_loader: Your ``DataLoader(dataset, batch_size=B)``: its dataset is drawn in secret Poisson
                batches of expected size B, with its ``collate_fn`` and workers.
            noise_multiplier: The noise multiplier z.
            max_grad_norm: The per-example clipping norm: each example's gradient is clipped to it.
            criterion: Leave it out to train the loss your loop computes (each example's gradient from your
                ``loss.backward()``, proven per example: ``rowtrace``; docs/integrations.md). Given, the step
                differentiates it per example instead (a loss module with ``reduction`` is evaluated with
                ``reduction="none"``, any other callable one example at a time) and the forward may take the
                step itself; with ``grad_sample_mode="ghost"`` it defaults to ``nn.CrossEntropyLoss()``.
            batch_first: Opacus's; only True (every input tensor holds one example per row of its first
                dimension).
            loss_reduction: Opacus's; only ``"mean"`` (the noisy sum of clipped gradients is divided by the
                expected batch size; with ``"sum"``, multiply the learning rate by the batch size instead).
            poisson_sampling: Opacus's; only True (the accounting assumes secret Poisson sampling).
            clipping: Opacus's; only ``"flat"`` (for adaptive clipping pass ``algorithm="adaptive"``).
            noise_generator: Opacus's; only None (all noise is ChaCha20 under the run's secret key).
            grad_sample_mode: Opacus's: ``"hooks"``, ``"ghost"``, ``"functorch"`` or ``"ew"``, all run
                clipbias's own per-example gradients (``grad_path=`` chooses them); with ``"ghost"`` it
                returns ``(module, optimizer, criterion, data_loader)`` as Opacus does.
            **clipbias_options (Any): clipbias's own keywords: ``algorithm`` (default ``"dpsgd"``;
                ``"dice"``, ``"disk"``, ``"adaptive"``, ...), ``grad_path`` (``auto``, ``rows``, ``fast``),
                ``dice_accounting``, ``bands`` and ``bands_strategy`` (``"taylor"`` or ``"optimized"``:
                banded noise's coefficients, ``DPEngine``'s; ``"blt"``: BLT noise in ``bands`` classes;
                ``"optimized"`` and ``"blt"`` need the run's length: ``make_private_with_epsilon``),
                ``settings`` (the algorithm's settings, ``AlgoConfig.extra``), ``ef_clip``, ``public_clip``
                (True, the default where the step follows your loop's loss, as Opacus does: a forward on data the
                loader did not draw, such as a DCGAN's generated batch, trains each of its rows' gradients clipped
                to ``max_grad_norm`` and averaged, as the private rows' are; False: its exact gradient, the rule
                of clipbias's other interfaces; no privacy cost either way; with ``criterion=`` no public forward
                is trained, and True is refused), ``delta`` (for
                the engine's own report; default ``min(1e-5, 1 / (10 n))``, every integration's),
                ``max_physical_batch``, ``noise_seed`` (a reproducible run: reported uncertified, as ``DPEngine``'s), ``autocast`` (``torch.bfloat16`` or
                ``torch.float16``: the engine's forward and backward under ``torch.autocast``, norms and sums
                in float32; use it instead of your own ``torch.autocast`` and ``GradScaler``) and
                ``loss_scale``.

        Returns:
            ``(module, optimizer, data_loader)``, made private (with ``grad_sample_mode="ghost"``:
                ``(module, optimizer, criterion, data_loader)``).

        Raises:
            ConfigError: a second ``make_private`` on one ``PrivacyEngine``; a setting out of range; an
                Opacus option clipbias does not offer, with the reason. The message names this interface's
                arguments.
        """
        return self._make(module, optimizer, data_loader, criterion, max_grad_norm, noise_multiplier=noise_multiplier,
                          options=dict(batch_first=batch_first, loss_reduction=loss_reduction,
                                       poisson_sampling=poisson_sampling, clipping=clipping,
                                       noise_generator=noise_generator, grad_sample_mode=grad_sample_mode),
                          extra=clipbias_options)

    @speaks_opacus
    def make_private_with_epsilon(self, *, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  data_loader: DataLoader, target_epsilon: float, target_delta: float, epochs: int,
                                  max_grad_norm: float, criterion: Callable | None = None, batch_first: bool = True,
                                  loss_reduction: str = "mean", poisson_sampling: bool = True, clipping: str = "flat",
                                  noise_generator: Any = None, grad_sample_mode: str = "hooks",
                                  **clipbias_options) -> tuple:
        """As ``make_private``, with the noise multiplier calibrated so that ``epochs`` epochs end at
        ``target_epsilon`` or just below, never above; a step past them is refused.

        Args:
            module: Your model.
            optimizer: Your optimizer (any ``torch.optim`` class).
            data_loader: Your ``DataLoader(dataset, batch_size=B)``.
            target_epsilon: The epsilon the planned steps end at.
            target_delta: Delta, a float in (0, 1).
            epochs: The planned epochs (``epochs * len(data_loader)`` steps), an integer >= 1.
            max_grad_norm: The per-example clipping norm.
            criterion: As ``make_private``'s.
            batch_first: As ``make_private``'s.
            loss_reduction: As ``make_private``'s.
            poisson_sampling: As ``make_private``'s.
            clipping: As ``make_private``'s.
            noise_generator: As ``make_private``'s.
            grad_sample_mode: As ``make_private``'s.
            **clipbias_options (Any): As ``make_private``'s.

        Returns:
            As ``make_private``.

        Raises:
            ConfigError: as ``make_private``; ``epochs`` not an integer >= 1.
        """
        check_count("epochs", epochs)
        return self._make(module, optimizer, data_loader, criterion, max_grad_norm, epsilon=target_epsilon,
                          delta=target_delta, epochs=epochs,
                          options=dict(batch_first=batch_first, loss_reduction=loss_reduction,
                                       poisson_sampling=poisson_sampling, clipping=clipping,
                                       noise_generator=noise_generator, grad_sample_mode=grad_sample_mode),
                          extra=clipbias_options)

    def _make(self, module, optimizer, data_loader, criterion, max_grad_norm, *, options: dict, extra: dict,
              noise_multiplier: float | None = None, epsilon: float | None = None, delta: float | None = None,
              epochs: int | None = None) -> tuple:
        if self.engine is not None:
            raise ConfigError("this PrivacyEngine already made a training private: use one PrivacyEngine per "
                              "training (its accountant counts that training's steps)")
        check_opacus_options(**options)
        check_positive((("max_grad_norm", max_grad_norm), ("noise_multiplier", noise_multiplier),
                        ("target_epsilon", epsilon)), "a positive finite number")
        if delta is not None and not (isinstance(delta, float) and 0 < delta < 1):
            raise ConfigError(f"target_delta must be a float in (0, 1), got {delta!r}")
        module, optimizer, data_loader = _unwrapped(module, optimizer, data_loader)
        if not isinstance(module, nn.Module):
            raise ConfigError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        settings = opacus_settings(extra, noise_multiplier=noise_multiplier, epsilon=epsilon, delta=delta,
                                   max_grad_norm=max_grad_norm, accountant=self.accountant_name)
        if any(k.__name__ == "LightningModule" for k in type(module).__mro__):  # Opacus's Lightning pattern
            from .opacus_lightning import make_private_lightning
            self.lightning, remove = make_private_lightning(
                self.lightning, module, data_loader, settings, criterion=criterion, epochs=epochs,
                ghost=options["grad_sample_mode"] == "ghost", extra=extra)
            self.module = DPModule(module, remove=remove)
            return self.module, optimizer, data_loader
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        check_loader(data_loader, "data_loader", "data_loader must be a torch.utils.data.DataLoader, got {}")
        check_opacus_keywords(extra)
        n, B = len(data_loader.dataset), data_loader.batch_size
        # the plan (``make_private_with_epsilon``): ``epochs`` epochs of ``len(data_loader)`` steps, Opacus's count
        steps = None if epochs is None else epochs * epoch_steps(n, B, data_loader.drop_last)
        # without ``criterion`` the step trains the loss the loop computes (``rowtrace``); Opacus's ghost mode
        # computes its loss with the criterion it returns
        follow = criterion is None and options["grad_sample_mode"] != "ghost"
        self._engine_ = DPOptions(**settings).build(module, optimizer, n=n, batch_size=B, steps=steps,
                                                    loss_fn=loss_function(criterion, follow),
                                                    max_physical_batch=extra.get("max_physical_batch", 512),
                                                    engine_class=OpacusEngine)
        clip = max_grad_norm if resolve_public_clip(extra, follow) else None
        self._session_ = Session(self.engine, unstepped=UNSTEPPED, public_clip=clip, released=LOOP_RELEASED)
        self.module = DPModule(module, self.session)
        self.data_loader = DPDataLoader(self.session, data_loader)
        self.optimizer = DPOptimizer(optimizer, self.session)
        if options["grad_sample_mode"] == "ghost":
            return self.module, self.optimizer, criterion or nn.CrossEntropyLoss(), self.data_loader
        return self.module, self.optimizer, self.data_loader

    # ------------------------------------------------------------------ privacy
    @speaks_opacus
    def get_epsilon(self, delta: float) -> float:
        """Epsilon after the steps taken so far.

        Args:
            delta: Delta, in (0, 1).

        Returns:
            Epsilon at ``delta`` (0 before the first step).
        """
        return self.privacy_report(delta).epsilon

    @speaks_opacus
    def privacy_report(self, delta: float | None = None) -> PrivacyReport:
        """The full statement after the steps taken so far.

        Args:
            delta: Delta (default: the run's: ``make_private_with_epsilon``'s ``target_delta``, or
                ``make_private``'s ``delta`` option, default ``min(1e-5, 1 / (10 n))``).

        Returns:
            The ``PrivacyReport``: epsilon, delta, accountant, basis, ``certified`` and its caveats.

        Raises:
            ConfigError: before ``make_private``, or a ``delta`` outside (0, 1).
        """
        self._engine()
        return self.session.report(delta)

    @property
    def steps(self) -> int:
        """The private steps taken so far."""
        return self._engine().steps_taken

    def _engine(self) -> DPEngine:
        if self.engine is None:
            raise ConfigError("call make_private (or make_private_with_epsilon) first")
        return self.engine

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The private state (secret key, counters, error feedback, your optimizer's state): PRIVATE, never
        release it. Save the model's ``state_dict`` beside it."""
        return {"engine": self._engine().state_dict(), "transformed_steps": self.optimizer.transformed_steps}

    @speaks_opacus
    def load_state_dict(self, state: dict) -> None:
        """Continue a training from ``state_dict()`` (in a new process: a fresh ``make_private`` with the same
        settings, then this); the batches, noise and updates continue exactly.

        Args:
            state: What ``state_dict()`` returned.

        Raises:
            ConfigError: not such a state, or before ``make_private``.
            ResumeMismatchError: a privacy setting differs from the state's.
        """
        if not isinstance(state, Mapping) or "engine" not in state:
            raise ConfigError("load_state_dict: pass what PrivacyEngine.state_dict() returned")
        self._engine().load_state_dict(state["engine"])
        engine = self._engine()  # (a state saved before the engine counted them: its own count)
        engine.transformed_steps = max(engine.transformed_steps, int(state.get("transformed_steps", 0)))

    def save_checkpoint(self, *, path, module: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                        checkpoint_dict: dict | None = None) -> None:
        """Opacus's checkpoint: the module's weights and the private state (the optimizer's is inside it) in one
        file. PRIVATE: it holds the secret key; never release it (release ``module.state_dict()``).

        Args:
            path (str | os.PathLike): Where to write it (``torch.save``).
            module: The model whose weights are saved.
            optimizer: Accepted as Opacus's; its state is inside the private state.
            checkpoint_dict: More entries to save in the file.
        """
        out = dict(checkpoint_dict or {})
        out.update(module_state_dict=module.state_dict(), privacy_engine_state_dict=self.state_dict())
        torch.save(out, path)

    def load_checkpoint(self, *, path, module: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
        """Load what ``save_checkpoint`` wrote into ``module`` and this engine.

        Args:
            path (str | os.PathLike): The file ``save_checkpoint`` wrote.
            module: The model to load the weights into.
            optimizer: Accepted as Opacus's; its state is restored with the private state.

        Returns:
            The checkpoint's dict.
        """
        ckpt = torch.load(path, weights_only=False)
        module.load_state_dict(ckpt["module_state_dict"])
        self.load_state_dict(ckpt["privacy_engine_state_dict"])
        return ckpt


def _unwrapped(module: Any, optimizer: Any, data_loader: Any) -> tuple:
    """What ``make_private`` returned before, given again (a resumed script), as the objects it wrapped: the
    module, the optimizer and the DataLoader (Opacus accepts them too). A warning where their training took
    steps: this PrivacyEngine accounts its own steps from zero unless that training's state is loaded."""
    earlier = [w.engine for w in (optimizer, data_loader) if isinstance(w, (DPOptimizer, DPDataLoader))]
    if isinstance(module, DPModule) and module._session is not None:
        earlier.append(module._session.engine)
    taken = max((e.steps_taken for e in earlier if e is not None), default=0)  # (None: a marked loader)
    if taken:
        warnings.warn(f"make_private got the module, optimizer or data loader of a training that has taken {taken} "
                      f"private step(s): this PrivacyEngine accounts its own steps from 0 (right for a new training "
                      f"of a new model). To continue that training and its accounting, load its state "
                      f"(privacy_engine.load_state_dict(state) or privacy_engine.accountant.load_state_dict(state)) "
                      f"before the first step", stacklevel=5)
    return (module._module if isinstance(module, DPModule) else module,
            optimizer.original_optimizer if isinstance(optimizer, DPOptimizer) else optimizer,
            data_loader.original if isinstance(data_loader, DPDataLoader) else data_loader)


class DPModule(nn.Module):
    """Your module, made private (``_module``, as Opacus's ``GradSampleModule``). In training, on the rows of a
    batch of the private data loader, its forward is the loop's call of the run's ``Session``
    (``Session.call``): recorded for ``optimizer.step()``, run without an autograd graph under the engine's
    state guard, each output handed back as a leaf that requires grad, so that ``loss.backward()`` works, costs
    almost nothing and leaves in it the gradient of the loop's own loss.

    Without ``criterion`` that gradient is what the step trains (``rowtrace``: the batch and the outputs are
    traced, a loss that couples examples is refused at its backward), and a call on other data is public: your
    module with its graph. With ``criterion``, ``optimizer.step()`` holds the loop's gradient against
    ``criterion``'s (``Session.check_loss``), and where the engine's step can hand back the batch's outputs the
    forward takes the private step itself from the second batch on and returns the step's own outputs. A
    forward in training mode on such a batch under ``torch.no_grad()`` is not recorded, but it too may not
    change a buffer. Elsewhere (``eval()``, after the step) it is your module."""

    def __init__(self, module: nn.Module, session: Session | None = None, remove: Callable | None = None) -> None:
        super().__init__()
        self._module = module
        self._session = session
        self._remove = remove

    def remove_hooks(self) -> None:
        """Opacus's ``GradSampleModule.remove_hooks``: the module is no longer private (its calls are your
        module's, and ``optimizer.step()`` finds no private batch to step on); in the Lightning pattern the
        ``DPCallback`` leaves the Trainer (Opacus's mnist_lightning calls it before a second ``make_private``)."""
        self._session = None
        if self._remove is not None:
            self._remove()

    def forward(self, *args, **kwargs):
        if self._session is None:
            return self._module(*args, **kwargs)
        return self._session.call(self._module, self.training, args, kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_module"], name)


UNSTEPPED = ("the private data loader's batch was used in a forward pass but optimizer.step() was not called before "
             "the next batch: call it once per batch")


class BatchMemoryManager:
    """Opacus's ``BatchMemoryManager``: within it the private data loader yields each logical Poisson batch in
    physical chunks of at most ``max_physical_batch_size`` examples, and ``optimizer.step()`` takes the private
    step once per logical batch (earlier calls only record). The math is that of the whole batch; the engine
    also computes the per-example gradients in micro-batches of that size.

    Args:
        data_loader: The data loader ``make_private`` returned.
        max_physical_batch_size: The most examples in one physical chunk (an integer >= 1).
        optimizer: The optimizer ``make_private`` returned.

    Raises:
        ConfigError: a data loader or optimizer that ``make_private`` did not return, or a size that is not
            an integer >= 1.
    """

    def __init__(self, *, data_loader: DPDataLoader, max_physical_batch_size: int, optimizer: DPOptimizer) -> None:
        if not isinstance(data_loader, DPDataLoader) or not isinstance(optimizer, DPOptimizer):
            raise ConfigError("BatchMemoryManager takes the data loader and optimizer that make_private returned")
        check_count("max_physical_batch_size", max_physical_batch_size)
        self.data_loader, self.size, self.optimizer = data_loader, max_physical_batch_size, optimizer

    def __enter__(self) -> DPDataLoader:
        self._was = (self.data_loader.physical_batch_size, self.optimizer.engine.max_physical_batch)
        self.data_loader.physical_batch_size = self.size
        self.optimizer.engine.max_physical_batch = self.size
        return self.data_loader

    def __exit__(self, *exc) -> None:
        self.data_loader.physical_batch_size, self.optimizer.engine.max_physical_batch = self._was
