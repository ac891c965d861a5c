"""A ``DPEngine``'s privacy accounting: the noise multiplier it runs at (given, or calibrated to a
target epsilon), its ``PrivacyReport`` with the caveats of the run (a seeded key, batches the sampler
did not draw, batches the loop passed over,
batches changed after the loader drew them), and whether a step's batch is the sampler's."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

from .. import distributed, privacy
from ..errors import ConfigError
from ..privacy import PrivacyReport
from ..sampling.refetch import caveats as fetch_caveats
from .drawn import same_inputs, transformed_caveat


def noise_multiplier_for(engine: Any, epsilon: float | None, noise_multiplier: float | None) -> float:
    """The given noise multiplier, or the one calibrated to ``epsilon`` for all the steps of ``engine`` (a
    ``StepPlan``; 0 for a non-private algorithm), by the plan's error-feedback basis."""
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
    z = distributed.from_rank0(lambda: privacy.calibrate(spec, epsilon, engine.delta, engine.total_steps,
                                                         engine.accountant, engine.basis))
    why = no_signal(z, epsilon, engine.expected_batch_size, engine.total_steps)
    if why:
        warnings.warn(why, NoSignalWarning, stacklevel=4)  # (the caller of DPEngine, through make_plan)
    return z


class NoSignalWarning(UserWarning):
    """The calibrated noise drowns any gradient the run could sum (``no_signal``)."""


def no_signal(z: float, epsilon: float, batch_size: float, steps: int) -> str | None:
    """Why noise multiplier ``z``, calibrated to ``epsilon`` for ``steps`` steps of expected batch ``B``,
    leaves no signal, or None. Each step adds noise of standard deviation z*C to every coordinate of a sum of
    clipped gradients whose norm is at most B*C (C the clip); over the run, sqrt(T)*z*C per coordinate
    against at most T*B*C. Past z > B*sqrt(T) the noise of the whole run exceeds, in every coordinate, the
    largest total signal the run could carry (every example's clipped gradient aligned with that coordinate
    at every step): no parameter of any model, even a single one, is learned above the noise. The threshold
    is where the run's best case fails, so the warning never fires for a run that could learn. At small
    epsilon z grows about as q*sqrt(T)/epsilon, so the ratio falls as 1/(n*epsilon): the cure is a larger
    epsilon or more examples, not more steps or larger batches."""
    if not (steps and batch_size > 0 and z > batch_size * steps ** 0.5):
        return None
    return (f"the noise multiplier {z:.6g} calibrated to epsilon={epsilon:g} leaves no signal: each step adds "
            f"noise of standard deviation z*C = {z:.6g}*C to every coordinate of a sum of clipped gradients whose "
            f"norm is at most B*C = {batch_size:g}*C ({z / batch_size:.3g}x), and over the {steps} steps the noise "
            f"per coordinate (sqrt(T)*z*C) still exceeds the largest total signal (T*B*C) "
            f"{z / (batch_size * steps ** 0.5):.3g}x, so no parameter is learned above the noise (C: the clip). "
            f"Raise epsilon or train on more examples (the ratio falls about as 1/(n*epsilon)); more steps or "
            f"larger batches raise the noise with them")


def report(engine: Any, steps: int, delta: float | None = None) -> PrivacyReport:
    """The engine's guarantee after ``steps`` steps (at ``delta``, default the run's), with the caveats of the run
    (``DPEngine.privacy``): the accountant runs once."""
    rep = privacy.account(engine.spec, steps, engine.delta if delta is None else delta, engine.accountant,
                          engine.plan.basis)
    if engine.algo.private and engine.key.reproducible:
        rep = rep.with_caveat(SEEDED_CAVEAT)
    if engine.algo.private and engine.undrawn_steps:
        rep = rep.with_caveat(undrawn_caveat(engine.undrawn_steps, engine.steps_taken, engine.sample_rate))
    if engine.algo.private and getattr(engine, "transformed_steps", 0):
        rep = rep.with_caveat(transformed_caveat(engine.transformed_steps, engine.steps_taken))
    if engine.algo.private and getattr(engine, "unproven_steps", 0):  # (set by the Opacus interface's ``follow``)
        rep = rep.with_caveat(UNPROVEN_CAVEAT.format(engine.unproven_steps, engine.steps_taken))
    for line in fetch_caveats(engine) if engine.algo.private else ():  # the loader's re-fetch check (refetch)
        rep = rep.with_caveat(line)
    if engine.algo.private and getattr(getattr(engine, "sampler", None), "passed_over", 0):  # (None while built)
        rep = rep.with_caveat(SKIPPED_CAVEAT.format(engine.sampler.passed_over))
    return rep


UNPROVEN_CAVEAT = ("{} of the {} steps trained a loss the training loop computed that could not be proved a sum of "
                   "per-example terms (a value of the batch read out of torch before the backward, an in-place change "
                   "through an alias, a custom autograd.Function): the sensitivity of those steps rests on what the "
                   "loop did with it, which nothing bounds")


def origin(engine: Any, x: Any, y: Any, indices: Tensor | None) -> tuple[bool, bool]:
    """(whether the step's batch is the one the sampler drew last, ``drawn_by_sampler``; whether its inputs
    and targets are the batch a ``PoissonLoader`` fetched for those indices, ``engine.drawn``: True where no
    loader fetched them). Taken before the step (the forward could change ``x``); counted by ``count_origin``
    once the step is released."""
    fetched = getattr(engine.sampler, "fetched", None)
    # (a loss of the loop's own output gradients: its targets are those gradients, the inputs are compared)
    compared = (x, y) if getattr(engine.loss_fn, "compares_targets", True) else x
    same = fetched is None or indices is None or not torch.equal(fetched[0], indices.detach().cpu()) \
        or same_inputs(compared, fetched[1])
    return drawn_by_sampler(engine, indices), same


def count_origin(engine: Any, origin: tuple[bool, bool]) -> None:
    """A released step's batch in the caveats' counts (``origin``)."""
    engine.undrawn_steps += not origin[0]
    engine.transformed_steps += not origin[1]


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
                  "step used them, left without a step: a break, a peek with next(iter(loader)), or a step on them failed): a loop that chooses batches by their content (skipping small or empty ones, "
                  "redrawing) includes examples at another rate than the accounted q")


SEEDED_CAVEAT = ("batches and noise derived from a user-given seed (a reproducible run): the guarantee holds only "
                 "while that seed stays secret and unguessable; anyone who has it can recompute the batches and "
                 "subtract the noise")

