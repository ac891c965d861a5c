"""The private step of a model sharded with ``fully_shard`` whose sums, noise and update are sharded too.

A rank holds its slice of every parameter (FSDP2's ``Shard(0)``: rows ``[r0, r1)`` of each parameter), and
of everything the step makes of the size of the model: the processed sum, the noisy update, the noise's
normals and the gradient handed to the optimizer (docs/architecture.md, "Sharded models"):

* **Sums.** The ranks' per-example norms are computed on the gathered model (``distributed.unsharded``), over
  every layer of every unit, before any factor is applied; then each layer's clipped sum (one parameter at a
  time, in the model's layer order) is all-reduced and each rank keeps its rows of it. Every rank runs the same
  number of such rounds per step, ``K = max_r ceil(share_r / max_physical_batch)``: a rank with fewer
  micro-batches (or a failed one) all-reduces zeros for the rest (``pad``), so the collectives of a step depend
  on the global batch's size alone, never on the data or on which rank holds what. A rank frees the gathered
  parameters after its last micro-batch's forward, backward and check (``_model_done``: resharding is local),
  so its last sums and the release run on 1/N of the model.
* **Noise once.** Each rank draws the normals of its own coordinates of the one-process noise vector (the same
  key, draw counter and stream positions: ``normals_at``, ``_PIECE`` normals at a time) and adds them to its
  slice in place; every coordinate is drawn by exactly one rank and the ranks' slices together are the
  one-process release.
* **Update.** The slice is this rank's shards' update, wrapped as DTensors (``distributed.shard_like``).

It applies to the steps whose release is coordinate-wise after the sums (``applies``): no error feedback (its
feedback clips the whole buffer), one band of Gaussian noise (banded and BLT noise keep d-vectors of state), no
post stage, no tied weights, parameters sharded ``Shard(0)`` on one mesh dimension. Other sharded steps all-reduce
whole sums and apply ``shard_like`` slices of the whole update (``aggregate``)."""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor

from ..grads.fast import BookKeeping
from ..grads.precision import full_float32
from ..randomness import Purpose, SecretKey
from ..randomness.draws import _CHUNK_PAIRS, _normals_of, _stream_runs
from ..randomness.key import nonce
from ..randomness.noise import noise_grid, snap
from ..step import GaussianNoise

_CHUNK = 2 * _CHUNK_PAIRS  # normals per chunk of the stream (``randomness.draws``)
_PIECE = 1 << 16  # normals a rank draws and adds at a time (``normals_at``): 0.5 MiB of float64 a temporary


def applies(engine, agg) -> str | None:
    """Why ``engine``'s sharded step cannot shard its sums and update (module doc), or None where it can."""
    from torch.distributed.tensor import DTensor, Shard
    p = engine.pipeline
    if type(agg) is not BookKeeping or agg.ties:
        return "tied weights"
    if p.error_feedback is not None or p.reference or p.post is not None or len(p.per_sample) != 1:
        return "error feedback or a post stage"
    if p.noise is not None and (type(p.noise) is not GaussianNoise or p.noise.bands != 1):
        return "banded or BLT noise"
    if any(not isinstance(q, DTensor) or q.device_mesh.ndim != 1 or tuple(q.placements) != (Shard(0),) or q.dim() == 0
           for q in engine.params):
        return "a parameter not sharded Shard(0) on one mesh dimension"
    return None


def normals_at(key: SecretKey, draw: int, start: int, stop: int, device: torch.device | str):
    """The standard normals ``start .. stop`` of the noise draw ``draw`` (``normals(key, NOISE, draw, 0, n)[start:stop]``
    for any n >= stop, the same values), as ``(offset from start, values)`` pieces of at most ``_PIECE`` normals
    (pair i of a chunk is the same whatever pairs are asked for: a piece's temporaries stay small)."""
    address = nonce(Purpose.NOISE, draw, 0)
    for chunk in range(start // _CHUNK, -(-stop // _CHUNK)):
        first = chunk * _CHUNK
        lo_pair = (max(start, first) - first) // 2 // 8 * 8  # (keystream blocks hold 8 pairs' integers)
        hi_pair = min(_CHUNK_PAIRS, -(-(stop - first) // 2))
        for p0 in range(lo_pair, hi_pair, _PIECE // 2):
            pairs = min(_PIECE // 2, hi_pair - p0)
            z = _normals_of(_stream_runs(key, address, chunk, pairs, first=p0), torch.device(device))
            at = first + 2 * p0  # the draw's position of z[0]
            lo, hi = max(start, at) - at, min(stop, at + len(z)) - at
            if hi > lo:
                yield at + lo - start, z[lo:hi]


class ShardedSums:
    """A fully_shard model's sums, noise and update sharded (module doc): ``__call__`` is the fast path's aggregate
    of one micro-batch, returning this rank's slice of the global clipped sum's share of that micro-batch
    (every rank's contributions all-reduced layer by layer); ``gathered`` the step's context (the whole model
    gathered, the rounds padded); ``finish`` the release of this rank's slice; ``unflatten`` its shards' pieces."""

    def __init__(self, engine, agg: BookKeeping) -> None:
        self.engine, self.agg = engine, agg
        self.rows = []  # per parameter, layout order: (layout offset, numel, row length, first row, rows, slice offset)
        offset = local = 0
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        for q in engine.params:
            shape, start = compute_local_shape_and_global_offset(q.shape, q.device_mesh, q.placements)
            row = math.prod(q.shape[1:])
            self.rows.append((offset, q.numel(), row, start[0], shape[0], local))
            offset, local = offset + q.numel(), local + shape[0] * row
        self.local_dim = local  # this rank's coordinates of the update
        self.order = [s for slots in agg.slots for s in slots]  # a round's all-reduces: the model's layer order
        self.rounds = self.total = self.calls = self.mine = 0  # this step's rounds: run, agreed, this rank's; all-reduces
        self.groups: list = []  # the model's FSDP parameter groups (``gathered``)
        self.acc: Tensor | None = None  # this rank's slice of the step's processed sum (``zeros``)

    def zeros(self, dtype: torch.dtype, device: torch.device) -> Tensor:
        """The step's processed sum, this rank's slice, zero: every round (the padding ones too) adds into it."""
        self.acc = torch.zeros(self.local_dim, dtype=dtype, device=device)
        return self.acc

    # ---------------------------------------------------------------- the sums
    def _reduce(self, slot: int, piece: Tensor | None, out: Tensor, own: bool = False) -> None:
        """One parameter's clipped sum of this micro-batch: every rank's (``piece``; None: this rank adds zeros, a
        padding round) all-reduced, this rank's rows added into ``out``. ``own``: ``piece`` is reduced in place (its
        storage is the caller's, read by nothing else), else a copy."""
        import torch.distributed as dist
        off, n, row, r0, nr, at = self.rows[slot]
        buf = out.new_zeros(n) if piece is None else piece.reshape(-1).to(out.dtype, copy=not own)
        if not buf.is_contiguous():
            buf = buf.contiguous()
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        self.calls += 1
        out[at:at + nr * row] += buf[r0 * row:(r0 + nr) * row]

    def __call__(self, x, y, scale, reference: bool, at=None):
        """``BookKeeping.__call__`` of one micro-batch (norm-scaling, no reference sum), its clipped sum all-reduced
        per parameter and this rank's slice of it added to the step's (``zeros``): (0, None, losses, norms)."""
        agg = self.agg
        if getattr(agg, "sum_precision", "float64") != "float64" or at is not None:
            return self._assembled(x, y, scale, reference, at)
        losses, rules, _ = agg._rules(x, y)
        self._model_done()
        norms = torch.sqrt(sum(r.sq for r in rules))  # over every layer of every unit, before any factor
        dtype = self.engine.params[0].dtype
        if not bool(torch.isfinite(norms).all()):  # the caller refuses the step; this round is padded with zeros
            return torch.zeros(0, dtype=dtype), None, losses, norms
        S = torch.stack([scale(norms)])
        with full_float32():  # as BookKeeping's sums
            for r, slots in zip(rules, agg.slots):
                for s, t in zip(slots, r.sums(S)):  # t: [1, ...], the rule's own new tensor unless it is a view
                    self._reduce(s, t[0], self.acc, own=t._base is None and t[0].is_contiguous())
        self.rounds += 1
        return self.acc.new_zeros(()), None, losses, norms.to(dtype)

    def _assembled(self, x, y, scale, reference: bool, at):
        """``BookKeeping.__call__`` itself, its assembly of the per-layer sums (``_assemble``) replaced by this round's
        all-reduces (the other sum precisions: every layer's sums are held at once, then reduced one by one)."""
        agg = self.agg

        def assemble(per_layer: list) -> Tensor:
            for pieces, slots in zip(per_layer, agg.slots):
                for s, t in zip(slots, pieces):
                    self._reduce(s, t, self.acc)
            self.rounds += 1
            return self.acc.new_zeros(())
        def rules(*args, **kwargs):
            got = type(agg)._rules(agg, *args, **kwargs)
            if at is None:  # (DiSK's two points run the rules twice: not on this route, ``applies``)
                self._model_done()
            return got
        agg._assemble, agg._rules = assemble, rules  # (instance attributes: the class's methods again once deleted)
        try:
            return agg(x, y, scale, reference, at)
        finally:
            del agg._assemble, agg._rules

    def _model_done(self) -> None:
        """After a micro-batch's forward, backward and check: on this rank's last micro-batch of the step the
        gathered parameters are freed (every unit resharded: local, no collective) before its sums and their
        all-reduces, which read the layers' inputs and output gradients, not the weights. The sums' peak then
        holds 1/N of the model instead of all of it (docs/architecture.md, "Sharded models")."""
        if self.rounds + 1 >= self.mine:
            for g in self.groups:
                g.reshard()

    @contextlib.contextmanager
    def gathered(self, examples: int):
        """The step's sums: the number of rounds agreed (one all-reduce of the micro-batch counts), the whole model
        gathered (``distributed.unsharded``), then every round this rank did not run all-reduced with zeros."""
        import torch.distributed as dist

        from .. import distributed
        dev = self.engine.params[0].device
        self.mine = -(-examples // self.engine.max_physical_batch)  # this rank's micro-batches
        mine = torch.tensor([self.mine], dtype=torch.int64, device=dev)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        self.total, self.rounds, self.calls = int(mine), 0, 0
        self.groups = distributed._fsdp_groups(self.engine.model)  # (inside, ``plain`` hides the units' class)
        try:
            with distributed.unsharded(self.engine.model):
                yield
        finally:
            self.pad()

    def pad(self) -> None:
        """The all-reduces of this step's rounds that this rank has not made (fewer micro-batches, a failed one, or
        a round cut short by an error), in their order, with zeros: every rank makes ``total`` rounds."""
        while self.calls < self.total * len(self.order):
            self._reduce(self.order[self.calls % len(self.order)], None, self.acc)
        self.rounds = self.total

    # ---------------------------------------------------------------- the release
    def finish(self, processed: Tensor, reference: Tensor | None) -> Tensor:
        """``Pipeline.finish`` of this rank's slice of the global processed sum: divided by B, the adaptive clip's
        release where it moves, and this rank's coordinates of the step's one noise draw."""
        p = self.engine.pipeline
        v = processed / p.divisor
        last = p.per_sample[-1] if p.per_sample else None
        if last is not None and last.dynamic:  # adaptive clipping: its own release (a collective) and the std
            last.release(v.device)
            if p.noise is not None:
                p.noise.follow(last.bound)
        noise = p.noise
        if noise is None or noise.std == 0:
            return v
        noise._pending = (noise.draws + 1, [], [])  # as GaussianNoise.__call__ with one band: committed by the step
        return self._noisy(v, noise)

    def _noisy(self, v: Tensor, noise: GaussianNoise) -> Tensor:
        """``round_g(v + std Z)`` on this rank's coordinates, Z the one-process draw's normals at those coordinates
        (``snapped_gaussian``'s arithmetic, element by element: the same values as the one-process release)."""
        g = noise_grid(noise.std)
        for off, n, row, r0, nr, at in self.rows:
            start = off + r0 * row
            for k, z in normals_at(noise.key, noise.draws, start, start + nr * row, v.device):
                piece = slice(at + k, at + k + len(z))
                v[piece] = snap(v[piece].to(torch.float64), z.mul_(noise.std), g)  # (in place: ``v`` is finish's own)
        return v

    def unflatten(self, update: Tensor, public: list | None) -> list[Tensor]:
        """This rank's slice of the update as its shards' local pieces (``param.to_local()``'s shapes), with this
        rank's rows of ``public`` (whole per-parameter gradients) added."""
        pieces = []
        for i, (q, (off, n, row, r0, nr, at)) in enumerate(zip(self.engine.params, self.rows)):
            u = update[at:at + nr * row]
            if public is not None and public[i] is not None:
                u = u + public[i].to(u.device, u.dtype).reshape(-1)[r0 * row:(r0 + nr) * row]
            pieces.append(u)
        return pieces
