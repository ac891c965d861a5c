"""The private loader's check that fetch and collate are a function of the example alone.

The accounting assumes that row i of a step's batch, and the model's computation on it, depend on
example i alone. A Dataset or collate that draws randomness by fetch order (its own seeded generator,
a counter, torch's, numpy's or Python's global generator, a collator's ``torch.Generator``), or a
collate whose rows depend on the other examples (padding to the batch's longest, in-batch statistics)
breaks that: one example added moves the others' rows. At every step ``PoissonLoader.batches``:

* compares torch's, numpy's and Python's global generator states before and after each batch's fetch
  and collate (in the process that fetched it: the main one or a DataLoader worker): a moved generator
  is randomness drawn by fetch order;
* picks one example of the batch in secret (``Purpose.REFETCH``), fetches it again alone twice at the
  same step (so ``clipbias.example_generator`` draws what it drew in the batch), collates each alone,
  and compares: two different results are randomness of the fetch or the collate; one result that
  differs from the example's row of the batch is a row that depends on the batch. Where the shapes
  differ the row must equal the example collated alone on the alone one's extent (a collate that pads
  to the batch's longest example): that is sound only for a model that ignores the padding, which is
  taken to hold for a dict batch whose ``attention_mask`` marks the padding with 0 on the right (and
  whose padded ``labels`` are -100, ignored by the loss), as Hugging Face's collators and models do;
  any other padded batch is reported.

What was seen makes the run uncertified: ``engine.fetch_caveats`` counts, for each kind, the steps at
which it was seen; ``engine.privacy()`` states each kind's caveat (``caveats``), with the fix, and a
warning is given when a kind is first seen. docs/privacy.md ("Fetch and collate") states what this
does not see.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np
import torch
from torch import Tensor

from ..data.text import IGNORE
from ..randomness import Purpose, secret_int

FIX = ("draw per-example randomness from clipbias.example_generator() (keyed by the run's secret key, the step and "
       "the example, so the same whatever else is fetched)")

CAVEATS = {
    "generator": ("the dataset's __getitem__ or the collate_fn drew from {what} at {n} step(s) (torchvision's random "
                  "transforms draw from torch's): those generators are public functions of the seed and hand out "
                  "their draws in fetch order, so one example's presence moves the others' rows, which the accounting "
                  "does not allow for; " + FIX),
    "random": ("an example fetched and collated alone twice came out different at {n} step(s): the dataset's "
               "__getitem__ or the collate_fn draws randomness of its own (a generator object such as a collator's "
               "seed=..., a counter, state that changes between calls), which goes by fetch order, so one example's "
               "presence moves the others' rows; " + FIX),
    "batch": ("an example's row of the collated batch differed from the same example collated alone at {n} step(s): "
              "the collate_fn (or a batched __getitems__) makes rows that depend on the other examples of the batch "
              "(in-batch statistics, order, truncation), which the accounting does not allow for; make each row a "
              "function of its example alone"),
    "padding": ("the collate_fn pads each batch to its longest example at {n} step(s) and the batch has no "
                "attention_mask marking the padding on the right: a model that reads the padding (a recurrent "
                "model's last time step, a mean over the sequence) gives each example an output that depends on the "
                "others' lengths; pad to a fixed length, or return a dict whose attention_mask is 0 on right padding "
                "(and labels -100 there) for a model that ignores masked positions"),
    "left padding": ("the collate_fn pads on the left (or elsewhere than after the example) at {n} step(s): an "
                     "example's tokens then sit at positions that move with the batch's longest example; pad on the "
                     "right (tokenizer.padding_side = 'right') or to a fixed length"),
    "reads padding": ("the model's outputs for an example differed with and without the batch's padding at {n} "
                      "step(s), its attention_mask notwithstanding: the model reads masked positions (XLNet's "
                      "last-token pooling, a mean over the sequence that ignores the mask), so each example's output "
                      "depends on the others' lengths; pad to a fixed length, or use a model that ignores masked "
                      "positions"),
    "label padding": ("the collate_fn pads labels with values other than -100 at {n} step(s): the loss then reads "
                      "the padding, whose length depends on the batch's longest example; pad labels with -100"),
}

_GENERATORS = ("torch's global generator", "numpy's global generator", "Python's random generator")


def generator_states() -> tuple:
    """The states of torch's CPU generator, numpy's global one and Python's ``random``."""
    state = np.random.get_state()
    return torch.get_rng_state(), state[1].tobytes() + repr(state[2:]).encode(), random.getstate()


def moved(before: tuple) -> tuple[str, ...]:
    """The names of the generators whose state changed since ``before`` (``generator_states``)."""
    now = generator_states()
    return tuple(name for name, a, b in zip(_GENERATORS, before, now)
                 if not (torch.equal(a, b) if isinstance(a, Tensor) else a == b))


def note(engine: Any, kind: str, what: tuple[str, ...] = ()) -> None:
    """Count one step at which ``kind`` was seen (``engine.fetch_caveats``); warn when it is the first."""
    seen = engine.__dict__.setdefault("fetch_caveats", {})
    first = kind not in seen
    seen[kind] = seen.get(kind, 0) + 1
    if what:
        names = engine.__dict__.setdefault("fetch_generators", [])
        names.extend(w for w in what if w not in names)
    if first and engine.algo.private:
        warnings.warn(f"clipbias: this run is no longer certified: {caveat(engine, kind)}", stacklevel=4)


def caveat(engine: Any, kind: str) -> str:
    what = " and ".join(getattr(engine, "fetch_generators", None) or [_GENERATORS[0]])
    return CAVEATS[kind].format(n=engine.fetch_caveats[kind], what=what)


def caveats(engine: Any) -> list[str]:
    """The caveats of what the check saw (``accounting.report``)."""
    return [caveat(engine, kind) for kind in getattr(engine, "fetch_caveats", None) or {}]


def check(engine: Any, alone: Callable[[int, int], Any], idx: Tensor, data: Any, step: int | None,
          generators: tuple[str, ...]) -> None:
    """The check of one step's batch ``data`` (example indices ``idx``, fetched for ``step``, having moved
    ``generators``): ``alone(i, step)`` fetches and collates example i alone."""
    if generators:
        note(engine, "generator", generators)
    if step is None or len(idx) == 0:
        return
    j = secret_int(engine.key, Purpose.REFETCH, step) % len(idx)
    before = generator_states()
    first, second = alone(int(idx[j]), step), alone(int(idx[j]), step)
    again = moved(before)
    if again:
        if not generators:
            note(engine, "generator", again)
        return
    if not _same(first, second):
        note(engine, "random")
        return
    kind = _row_kind(data, j, first)
    if kind is not None:
        note(engine, kind)
    elif _padded(data, j, first):  # padding taken to be ignored: the step holds the model to it (``probe``)
        engine.__dict__["padding_probe"] = (idx.clone(), j, first)


def _padded(data: Any, j: int, alone: Any) -> bool:
    """Whether row ``j`` of the batch is longer than the example alone in some leaf (right padding)."""
    return any(isinstance(b, Tensor) and isinstance(a, Tensor) and b.dim() > 1 and a.dim() == b.dim()
               and a.shape[0] == 1 and j < b.shape[0] and b[j].shape != a[0].shape
               for (_, b), (_, a) in zip(_leaves(data), _leaves(alone)))


def probe(engine: Any, model: Any, x: Any, indices: Tensor | None, guarded: Callable) -> None:
    """Hold the model to the padding the loader's check took to be ignored (``check``): in eval mode, without a
    graph, its outputs for the checked example alone and as its padded row of this step's batch ``x``; outputs
    that differ (on the example's own extent) are noted ``reads padding``. Runs once per step at most, on the
    step whose batch the check saw; the forwards under ``guarded`` (the state guard: they may not write the
    model either)."""
    seen = engine.__dict__.pop("padding_probe", None)
    if seen is None or indices is None:
        return
    idx, j, alone = seen
    if not torch.equal(idx, indices.detach().cpu()) or j >= len(idx):
        return
    alone = alone[0] if isinstance(alone, (tuple, list)) else alone
    if not isinstance(alone, Mapping):
        return
    device = next(iter(engine.params)).device
    if isinstance(x, Mapping):
        if any(k not in alone for k in x):
            return
        one = {k: alone[k].to(device) if isinstance(alone[k], Tensor) else alone[k] for k in x}
        row = {k: v[j:j + 1] if isinstance(v, Tensor) and v.dim() > 0 else v for k, v in x.items()}
        call_one, call_row = (lambda: model(**one)), (lambda: model(**row))
    else:  # a positional call on the dict's entries (``model(inputs["input_ids"])``): each matched to its entry
        args = tuple(x) if isinstance(x, (tuple, list)) else (x,)
        one = _positional(args, alone, j, device)
        if one is None:  # (not matched: the padding the model reads is not known to be ignored)
            note(engine, "padding")
            return
        row = tuple(v[j:j + 1] if isinstance(v, Tensor) and v.dim() > 0 else v for v in args)
        call_one, call_row = (lambda: model(*one)), (lambda: model(*row))
    was = model.training
    try:
        model.eval()
        with torch.no_grad():
            a, b = guarded(call_one), guarded(call_row)
    finally:
        model.train(was)
    if not _same_extent(a, b):
        note(engine, "reads padding")


def _positional(args: tuple, alone: Mapping, j: int, device: Any) -> tuple | None:
    """The example collated alone as the positional call's arguments: each tensor argument (row ``j`` of the
    batch, padded) matched to the entry of ``alone`` whose values it holds on that entry's extent; None where
    one matches none."""
    out = []
    for v in args:
        if not isinstance(v, Tensor) or v.dim() == 0:
            out.append(v)
            continue
        match = next((t for t in alone.values() if isinstance(t, Tensor) and t.dim() == v.dim() and t.shape[0] == 1
                      and t.dtype == v.dtype and all(m <= n for m, n in zip(t.shape[1:], v.shape[1:]))
                      and _equal(t[0], v[j][tuple(slice(0, m) for m in t.shape[1:])])), None)
        if match is None:
            return None
        out.append(match.to(device))
    return tuple(out)


def _same_extent(a: Any, b: Any) -> bool:
    """Whether the outputs ``a`` (the example alone) and ``b`` (its padded row) agree on ``a``'s extent, to
    float32's rounding of a masked attention."""
    la, lb = _leaves(a), _leaves(b)
    if [p for p, _ in la] != [p for p, _ in lb]:
        return False
    for (_, s), (_, t) in zip(la, lb):
        if not isinstance(s, Tensor) or not s.is_floating_point():
            continue
        if s.dim() != t.dim() or any(m > n for m, n in zip(s.shape, t.shape)):
            return False
        t = t[tuple(slice(0, m) for m in s.shape)].to(s.dtype)
        scale = float(s.abs().max()) if s.numel() else 0.0
        if not torch.allclose(s, t, rtol=1e-3, atol=1e-4 * max(scale, 1e-6)):
            return False
    return True


def _equal(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    b = b.to(a.device)
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _same(a: Any, b: Any) -> bool:
    """Two collated batches with the same structure and values (tensors compared exactly, NaN = NaN)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and _equal(a, b)
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # an object without a truth value of ==: not compared
        return True


def _leaves(data: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    if isinstance(data, Mapping):
        return [leaf for k in data for leaf in _leaves(data[k], path + (k,))]
    if isinstance(data, (tuple, list)) and not all(isinstance(v, (str, int, float, bool)) for v in data):
        return [leaf for i, v in enumerate(data) for leaf in _leaves(v, path + (i,))]
    return [(path, data)]


def _row_kind(data: Any, j: int, alone: Any) -> str | None:
    """None where row ``j`` of the collated batch is the example collated alone (``alone``, a batch of one),
    else the caveat's kind: ``batch``, ``padding``, ``left padding`` or ``label padding``."""
    rows, ones = _leaves(data), _leaves(alone)
    if [p for p, _ in rows] != [p for p, _ in ones]:
        return "batch"
    padded: dict[tuple, Tensor] = {}
    for (path, b), (_, a) in zip(rows, ones):
        if not isinstance(b, Tensor) or not isinstance(a, Tensor):
            if isinstance(b, Tensor) != isinstance(a, Tensor):
                return "batch"
            continue  # a list of strings, a number: no example dimension to compare
        if b.dim() == 0 or a.dim() == 0 or a.shape[0] != 1 or j >= b.shape[0]:
            if not _equal(b, a):
                return "batch"
            continue
        r, a0 = b[j], a[0]
        if r.shape == a0.shape:
            if not _equal(r, a0):
                return "batch"
            continue
        if r.dim() != a0.dim() or r.dtype != a0.dtype or any(s > t for s, t in zip(a0.shape, r.shape)):
            return "batch"
        head = tuple(slice(0, s) for s in a0.shape)
        if _equal(r[head], a0):
            padded[path] = r
            continue
        tail = tuple(slice(t - s, t) for s, t in zip(a0.shape, r.shape))
        return "left padding" if _equal(r[tail], a0) else "batch"
    if not padded:
        return None
    return _padding_kind(data, padded, {path: a[0] for path, a in ones if path in padded})


def _padding_kind(data: Any, padded: dict[tuple, Tensor], alone: dict[tuple, Tensor]) -> str | None:
    """A row padded on the right (each padded leaf equals the example alone on its extent): None where the
    batch is a dict whose ``attention_mask`` marks the padding with 0 and whose padded ``labels`` are -100
    there, else ``padding``, ``left padding`` or ``label padding``."""
    if isinstance(data, Mapping):  # Hugging Face's convention: the labels an entry of the dict
        inputs, mask_path, labels_path = data, ("attention_mask",), ("labels",)
    elif isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], Mapping):  # (inputs, labels)
        inputs, mask_path, labels_path = data[0], (0, "attention_mask"), (1,)
    else:
        return "padding"
    if "attention_mask" not in inputs:
        return "padding"
    mask = padded.get(mask_path)
    if mask is None:  # the mask has the example's own length while another input is padded
        return "padding"
    rest = _outside(mask, alone[mask_path].shape)
    if rest is None or bool((rest != 0).any()):
        return "padding"
    labels = padded.get(labels_path)
    if labels is not None:
        rest = _outside(labels, alone[labels_path].shape)
        if rest is not None and bool((rest != IGNORE).any()):
            return "label padding"
    return None


def _outside(row: Tensor, extent: torch.Size) -> Tensor | None:
    """The elements of ``row`` outside its leading ``extent`` (flattened), None where there are none."""
    keep = torch.ones(row.shape, dtype=torch.bool)
    keep[tuple(slice(0, s) for s in extent)] = False
    return row[keep.to(row.device)] if bool(keep.any()) else None
