"""p-averaged clipping (Xiao et al. Section 3.3): clip the mean gradient of a group of examples.

Grouping that keeps the sensitivity bounded. Chopping the batch into consecutive groups of exactly
p (the paper's Appendix E) is not a function of single examples: adding one example shifts every
later group, and the sum of clipped group means can then change by up to 2C per group. Instead each
sampled example joins one of ``m = max(1, round(B / p))`` groups uniformly at random, independently
of everything else (a keyed draw, fresh every step); group sizes are then about p on average. The
released quantity is ``sum_j clip(mean_{i in group j} g_i, C)`` over the non-empty groups, divided
by m, plus Gaussian noise.

Sensitivity (add/remove one example x). Condition on the Poisson draws and group choices of every
other example and on x's own group choice j: only group j changes, from ``clip(mean_j, C)`` (or 0 if
the group was empty) to ``clip(mean_{j with x}, C)``. Both have norm <= C, so the sum moves by at
most 2C (and by at most C when the group was empty). x is present with probability q. Each
conditional pair of output distributions is therefore the Poisson-subsampled Gaussian pair with
sensitivity 2C, and the mixture over the data-independent randomness is no less private (joint
convexity of the hockey-stick divergence). So: Poisson-subsampled Gaussian, rate q, noise multiplier
z relative to S = 2C (noise std ``2 z C`` on the sum of m group terms, ``2 z C / m`` on the update).

Not a free lunch: at the same (epsilon, delta, q, T) z is the same as DPSGD's, but the update is an
average over m = B/p terms with noise std ``2 z C / m = 2 p (z C / B)``: 2p times DPSGD's noise for
a signal of the same size (the paper's "factor 2p"). ``noise_ratio_vs_dpsgd`` reports it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from ..data import batch
from ..config import AlgoConfig, Setting, integer
from ..grads.rows import FuncGradients, LossFn, RowSource, check_finite
from ..randomness import PROBE_STEP, Purpose, SecretKey, batch_keys, forward, int_list, keyed_ints
from ..step import Clip
from .base import Algorithm, Parts, register


def num_groups(p: int, expected_batch_size: float) -> int:
    """m = max(1, round(B / p)): a public constant (B is the expected batch size, never realised)."""
    return max(1, round(expected_batch_size / p))


def noise_ratio_vs_dpsgd(p: int, expected_batch_size: float) -> float:
    """Noise std on the update of p-avg over DPSGD's at equal z: ``2 B / m`` (= 2p when p | B)."""
    return 2.0 * expected_batch_size / num_groups(p, expected_batch_size)


class GroupClip(Clip):
    """Clip of a group mean: rows have norm <= C, but one example moves the sum by up to 2C."""

    def __init__(self, c: float) -> None:
        super().__init__(c)
        self.bound = 2.0 * self.c  # the add/remove sensitivity of the sum over groups


class GroupMeanGradients(RowSource):
    """Rows = means of the per-example gradients of each non-empty random group (one yield per step)."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, p: int, groups: int, key: SecretKey | None = None) -> None:
        self.fg = FuncGradients(model, loss_fn)
        self.layout = self.fg.layout
        self.p, self.groups, self.key = int(p), int(groups), key

    def assign(self, keys: list[int], step: int, groups: int | None = None) -> Tensor:
        """Each key's group in ``[0, groups)``: uniform, independent, fresh per step."""
        return keyed_ints(self.key, Purpose.GROUP, step, keys, 1, groups or self.groups).flatten()

    def owners(self, indices: Tensor, step: int, world: int) -> Tensor:
        """A group is processed whole by one rank (``group % world``): the clipped group means of the
        ranks then add up to the one-process sum (clipping a mean is not additive over its members)."""
        return self.assign(int_list(indices), step) % world

    def iter_rows(self, x: batch.Batch, y: batch.Batch, indices: Tensor | None, step: int, max_physical_batch: int,
                  groups: int | None = None) -> Iterator[tuple[Tensor, Tensor, Tensor | None]]:
        b = batch.size(x)
        if b == 0:
            return
        groups = groups or self.groups
        gid = self.assign(batch_keys(indices, 0, b), step, groups)
        d, dev = self.layout.dim, self.fg.device()
        dt = next(self.fg.model.parameters()).dtype  # a float64 model's group means in float64
        sums = torch.zeros(groups, d, device=dev, dtype=dt)
        counts = torch.zeros(groups, device=dev, dtype=dt)
        losses = []
        for start in range(0, b, max_physical_batch):
            sl = slice(start, start + max_physical_batch)
            with forward.examples(indices[sl] if indices is not None else None):  # keyed dropout masks
                g, loss = self.fg(batch.take(x, sl), batch.take(y, sl))
            check_finite(g, indices[sl] if indices is not None else None)
            gi = gid[sl].to(g.device)
            sums.index_add_(0, gi, g)
            counts.index_add_(0, gi, torch.ones_like(gi, dtype=g.dtype))
            losses.append(loss)
        keep = counts > 0
        yield sums[keep] / counts[keep].unsqueeze(1), torch.cat(losses), None

    def probe(self, x: batch.Batch, y: batch.Batch, max_physical_batch: int = 512) -> Tensor:
        """Group means of the probe batch, in groups of about p within it (probe randomness)."""
        parts = [g for g, _, _ in self.iter_rows(x, y, None, PROBE_STEP, max_physical_batch,
                                                 groups=num_groups(self.p, batch.size(x)))]
        return torch.cat(parts) if parts else torch.zeros(0, self.layout.dim)


P_AVG = Setting("p", 4, "an integer >= 2", integer(2), "--p",
                help="p-avg: examples per group (in expectation); batch-clip: group size (1 private + p - 1 public)")


def _note(cfg: AlgoConfig, s: dict) -> str:
    return (f"add/remove L2 sensitivity 2C = {2 * cfg.clip:g}: each sampled example joins one of m = round(B/p) "
            f"random groups and changes that group's clipped mean (norm <= C before and after) by at most "
            f"2C; Poisson-subsampled Gaussian at rate q with noise multiplier z relative to 2C. Not a free "
            f"lunch: the averaged update's noise is 2B/m (= 2p) times DPSGD's at equal z")


P_AVG_METHOD = register(Algorithm(
    "p-avg", "p-averaged clipping: clip the mean gradient of random groups (Xiao et al. Sec. 3.3)", True,
    "gaussian", lambda cfg, s, b, key: Parts([GroupClip(cfg.clip)], divisor=float(num_groups(s["p"], b))),
    schema=(P_AVG,),
    source=lambda model, loss_fn, cfg, s, *, n, batch_size, key: GroupMeanGradients(
        model, loss_fn, s["p"], num_groups(s["p"], batch_size), key),
    note=_note))
