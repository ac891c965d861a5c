"""Opacus's Lightning pattern (Opacus's mnist_lightning): ``privacy_engine.make_private(module=self, ...)`` in a
LightningModule's ``configure_optimizers``. Lightning calls the module and iterates its own train loader, so the
private step is a ``DPCallback`` (``lightning``) added to the module's Trainer with the settings ``make_private``
was given (``options.opacus_settings``); ``PrivacyEngine`` (``opacus``) reads its epsilon and report from it."""

from __future__ import annotations

from typing import Any, Callable

from ..errors import ConfigError
from .lightning import DPCallback


def make_private_lightning(earlier: DPCallback | None, module: Any, data_loader: Any, settings: dict, *,
                           criterion: Callable | None, epochs: int | None, ghost: bool,
                           extra: dict) -> tuple[DPCallback, Callable[[], None]]:
    """The ``DPCallback`` of a ``make_private`` on a LightningModule, on the module's Trainer in place of
    ``earlier`` (the one an earlier ``make_private`` of the same ``PrivacyEngine`` added): the Trainer's train
    loader is drawn in secret Poisson batches, the optimizer ``configure_optimizers`` returns is made private,
    the loss ``training_step`` returns is trained. A resumed fit's callback state (restored by Lightning before
    ``configure_optimizers``) is loaded into it.

    Args:
        earlier: The ``PrivacyEngine``'s callback so far (None: none).
        module: The LightningModule, attached to its Trainer.
        data_loader: The data loader ``make_private`` was given (held against the Trainer's at the first step).
        settings: The ``DPOptions`` keywords of the call (``options.opacus_settings``).
        criterion: ``make_private``'s.
        epochs: ``make_private_with_epsilon``'s (None: ``make_private``).
        ghost: Whether ``grad_sample_mode="ghost"`` was asked (refused: it returns a criterion for a loop).
        extra: ``make_private``'s clipbias keywords.

    Returns:
        ``(callback, remove)``: ``remove()`` takes the callback off the Trainer (``DPModule.remove_hooks``).
    """
    if ghost:
        raise ConfigError("grad_sample_mode='ghost' returns a criterion for your loop; in the Lightning pattern "
                          "training_step's loss is trained: leave grad_sample_mode at 'hooks'")
    if earlier is not None and earlier.engine is not None:
        raise ConfigError("this PrivacyEngine's Lightning training has taken private steps: use one "
                          "PrivacyEngine per training")
    trainer = getattr(module, "_trainer", None)
    if trainer is None:
        raise ConfigError("make_private on a LightningModule without a Trainer: call it in configure_optimizers "
                          "(Opacus's mnist_lightning pattern), where the Trainer is attached, or add "
                          "`callbacks=[DPCallback(noise_multiplier=..., max_grad_norm=...)]` to your Trainer "
                          "(from clipbias.integrations.lightning import DPCallback)")
    if epochs is not None and trainer.max_epochs != epochs:
        raise ConfigError(f"make_private_with_epsilon(epochs={epochs}) but the Trainer runs max_epochs="
                          f"{trainer.max_epochs}: the noise is calibrated for the Trainer's planned steps; give "
                          f"epochs={trainer.max_epochs} (or change max_epochs)")
    if extra.get("public_clip"):
        raise ConfigError("public_clip is make_private's for your own training loop; DPCallback trains a "
                          "LightningModule's training_step, whose forwards on other data keep their exact gradient")
    callback = DPCallback(criterion=criterion, max_physical_batch=extra.get("max_physical_batch", 512), **settings)
    callback.given = data_loader
    loaded = getattr(getattr(trainer, "_checkpoint_connector", None), "_loaded_checkpoint", None) or {}
    state = loaded.get("callbacks", {}).get(callback.state_key)  # (a resumed fit: Lightning restored the
    if state is not None:                                         # callbacks before configure_optimizers)
        callback.load_state_dict(state)
    trainer.callbacks[:] = [c for c in trainer.callbacks if c is not earlier] + [callback]
    callback.setup(trainer, module, "fit")  # (Lightning's setup hooks ran before configure_optimizers)

    def remove() -> None:
        if callback in trainer.callbacks:
            trainer.callbacks.remove(callback)
    return callback, remove
