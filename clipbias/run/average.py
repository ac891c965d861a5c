"""``WeightAverage``: an exponential moving average of the weights (De et al. 2022, "Unlocking
high-accuracy differentially private image classification through scale", Sec. 3.2).

After every step ``a_t = decay a_(t-1) + (1 - decay) w_t``, starting from the weights after the first
step (``a_1 = w_1``). The iterates ``w_t`` are released by the private algorithm (each is a function of
the noisy updates), so the average is post-processing: it costs no privacy and the run's guarantee
covers it. Only the trainable floating-point parameters are averaged; buffers (normalisation
statistics) are the current model's. ``--ema DECAY`` evaluates, reports and exports it beside the
raw weights; its state is in the checkpoint, so a resumed run continues it exactly.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor, nn

from ..errors import ConfigError


def check_decay(decay: float) -> float:
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not math.isfinite(decay) \
            or not 0 < decay < 1:
        raise ConfigError(f"`ema` (the decay of the weight average a = decay a + (1 - decay) w) must lie in (0, 1), "
                          f"e.g. 0.9 for a run of about 100 steps; got {decay!r}")
    return float(decay)


class WeightAverage:
    """The EMA of a model's trainable parameters (by name)."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.model, self.decay = model, check_decay(decay)
        self.names = [n for n, p in model.named_parameters() if p.requires_grad and p.is_floating_point()]
        self.avg: dict[str, Tensor] | None = None
        self.updates = 0

    def _params(self) -> dict[str, Tensor]:
        named = dict(self.model.named_parameters())
        return {n: named[n] for n in self.names}

    @torch.no_grad()
    def update(self) -> None:
        """Fold in the current weights (call after every optimizer step)."""
        now = self._params()
        if self.avg is None:
            self.avg = {n: p.detach().clone() for n, p in now.items()}
        else:
            for n, p in now.items():
                self.avg[n].mul_(self.decay).add_(p.detach(), alpha=1.0 - self.decay)
        self.updates += 1

    @contextlib.contextmanager
    def applied(self):
        """The model holds the averaged weights inside the block and its own weights, bit for bit, after."""
        if self.avg is None:
            yield self.model
            return
        params = self._params()
        saved = {n: p.detach().clone() for n, p in params.items()}
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(self.avg[n])
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(saved[n])

    def averaged_state_dict(self) -> dict[str, Tensor]:
        """The model's state_dict with the averaged parameters (CPU copies): the releasable averaged model."""
        with self.applied() as m:
            return {k: v.detach().cpu().clone() for k, v in m.state_dict().items()}

    def state_dict(self) -> dict:
        return {"decay": self.decay, "updates": self.updates,
                "avg": None if self.avg is None else {n: t.detach().cpu().clone() for n, t in self.avg.items()}}

    def load_state_dict(self, state: dict) -> None:
        if float(state["decay"]) != self.decay:
            raise ConfigError(f"cannot resume the weight average: the checkpoint's `ema` is {state['decay']}, now "
                              f"{self.decay}; resume with `ema={state['decay']}`")
        dev = {n: p.device for n, p in self._params().items()}
        self.updates = int(state["updates"])
        self.avg = None if state["avg"] is None else {n: state["avg"][n].to(dev[n]) for n in self.names}
