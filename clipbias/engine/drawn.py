"""Whether the batch a step runs on is the batch the private loader drew: one check for every integration.

The engine's sampler draws each batch in secret, and its accounting covers the batch as drawn. Between
the loader that yields it and the step, the user's code may change it: an augmentation in the training
loop (Opacus-style loops), in a LightningModule's ``on_after_batch_transfer`` or ``training_step``, an
in-place edit of the yielded tensors, a permutation of the rows. Randomness in such a change is torch's
public generator, not the engine's keyed per-example randomness, and nothing bounds how it couples the
examples, so a step on a changed batch is counted and the run is reported uncertified.

Every door's loader is a ``PoissonLoader``: as it yields a batch it keeps a copy with the sampler's draw
(``sampler.fetched``: an in-place edit of the yielded tensors changes them, not the copy), and
``DPEngine.step`` compares what it is given with that copy before it computes anything
(``accounting.origin``). ``engine.transformed_steps`` counts the released steps whose tensors are not the
fetched ones, and ``engine.privacy()`` carries ``TRANSFORMED_CAVEAT`` (``accounting.report``): one check
that an integration cannot forget, since it is the engine's. Moving a tensor to a device or casting it is
not a change; a tensor is compared on the CPU in the dtype the step was given (``same_inputs``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..data import batch

TRANSFORMED_CAVEAT = ("{} of the {} steps called the model on inputs other than the batch the data loader drew (a "
                      "transform in the training loop or a hook, or an in-place edit of the batch): randomness in "
                      "such a transform (augmentation) is not the engine's secret per-example randomness, and "
                      "nothing bounds how it couples examples; transform in the Dataset instead")


def same_inputs(x: Any, drawn: Any) -> bool:
    """Whether every tensor the model was called with is one of the drawn batch's tensors (moved or cast: the
    same shape and values): ``model(x)``, ``model(batch["inputs"])``, ``model(**batch)`` all are. Compared in
    the recorded tensor's dtype (the drawn tensor cast to it): casting the recorded one to the drawn dtype
    would truncate, and ``x.float() + delta`` with ``0 <= delta < 1`` would pass for a uint8 batch."""
    pool = batch.leaves(drawn)
    return all(any(_same_rows(t, d) for d in pool) for t in batch.leaves(x))


def _same_rows(t: Any, d: Any) -> bool:
    """``t`` is ``d`` moved, cast or reshaped row by row: the same rows, each with the same elements in the same
    (row-major) order (``x.view(len(x), -1)``, ``x.flatten(1)``: the MNIST-MLP loop). A permutation of a row's
    elements or any arithmetic is not (a rearrangement could depend on the other rows)."""
    if t.dim() == 0 or d.dim() == 0 or t.shape[0] != d.shape[0] or t.numel() != d.numel():
        return False
    # the same number of rows and the same elements in row-major order: each row is the same block of them
    return torch.equal(t.detach().to("cpu").reshape(-1), d.to(t.dtype).reshape(-1))


def transformed_caveat(transformed: int, steps: int) -> str:
    return TRANSFORMED_CAVEAT.format(transformed, steps)
