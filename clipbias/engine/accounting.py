"""A ``DPEngine``'s privacy accounting: the noise multiplier it runs at (given, or calibrated to a
target epsilon), its ``PrivacyReport`` with the caveats of the run (a seeded key, batches the sampler
did not draw, batches the loop passed over), and whether a step's batch is the sampler's."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from .. import distributed, privacy
from ..errors import ConfigError
from ..privacy import PrivacyReport


def noise_multiplier_for(engine: Any, epsilon: float | None, noise_multiplier: float | None) -> float:
    """The given noise multiplier, or the one calibrated to ``epsilon`` for all the engine's steps (0 for a
    non-private algorithm)."""
    if not engine.algo.private:
        return 0.0
    if noise_multiplier is not None:
        return privacy.report.check_positive(noise_multiplier, "noise_multiplier")
    if epsilon is None:
        raise ConfigError(f"{engine.algo.name} is private: give `epsilon` (calibrates the noise) or "
                          f"`noise_multiplier`")
    spec = engine.algo.spec(engine.config, engine.sample_rate, 0.0, engine.expected_batch_size, engine.bands,
                            engine.noise_shape)
    # in a process group rank 0 calibrates and every rank takes its answer (and its error, if any)
    return distributed.from_rank0(lambda: privacy.calibrate(spec, epsilon, engine.delta, engine.total_steps,
                                                            engine.accountant, engine.dice_accounting))


def report(engine: Any, steps: int) -> PrivacyReport:
    """The engine's guarantee after ``steps`` steps, with the caveats of the run (``DPEngine.privacy``)."""
    rep = privacy.account(engine.spec, steps, engine.delta, engine.accountant, engine.dice_accounting)
    if engine.algo.private and engine.key.reproducible:
        rep = rep.with_caveat(SEEDED_CAVEAT)
    if engine.algo.private and engine.undrawn_steps:
        rep = rep.with_caveat(undrawn_caveat(engine.undrawn_steps, engine.steps_taken, engine.sample_rate))
    if engine.algo.private and getattr(getattr(engine, "sampler", None), "skipped", 0):  # (None while being built)
        rep = rep.with_caveat(SKIPPED_CAVEAT.format(engine.sampler.skipped))
    return rep


def drawn_by_sampler(engine: Any, indices: Tensor | None) -> bool:
    """Whether the step's batch is (this rank's share of) the one the engine's sampler drew last and
    no step has used yet: the Poisson sample the accounting assumes. Any other batch (no indices,
    indices of the caller's choosing, a batch used twice) makes the run uncertified (``privacy``),
    with a warning at the first such step."""
    last = engine.sampler.last
    ok = indices is not None and last is not None and torch.equal(
        torch.sort(indices.detach().reshape(-1).to("cpu", torch.long)).values,
        torch.sort(engine.local_share(last)).values)
    if not ok and engine.algo.private and not engine.undrawn_steps:
        warnings.warn(UNDRAWN_WARNING, stacklevel=3)
    return ok


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

