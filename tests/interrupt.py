"""A training run interrupted after its first epoch, as a Ctrl-C between epochs would leave it: the
shared set-up of the resume tests (train, EMA, CUDA)."""

from __future__ import annotations

import pytest

from clipbias.run.training import train


class Stop(Exception):
    """Raised from the epoch callback: the run stops with its first epoch's checkpoint written."""


def interrupt_after_first_epoch(cfg, splits) -> None:
    """Train ``cfg`` (an ``out`` directory set) and stop it once epoch 1 has been checkpointed."""
    def stop(rec: dict) -> None:
        if rec["epoch"] == 1:
            raise Stop

    with pytest.raises(Stop):
        train(cfg, splits=splits, on_epoch_end=stop)
