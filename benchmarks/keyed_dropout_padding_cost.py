"""What padding-independent keyed dropout costs per step: a ``DPEngine.step`` of the red team's tiny GPT-2
(benchmarks/redteam/session/dropout_padding.py: 2 layers, 32 wide, 2 heads, dropout 0.1 on hidden states and
SDPA attention weights, 8 examples right-padded to ``--width`` tokens) with the masks of
``clipbias.randomness.forward`` (one stream per call, Szudzik layout of the attention weights: ``new``)
against the layout before it (one stream per example and pass, each call after the previous call's blocks,
row-major over the padded shape: ``before``, reimplemented here as ``_before_keep``), interleaved in one
process, medians of ``--reps`` rounds; also the time inside the mask function alone.

Usage::

    python benchmarks/keyed_dropout_padding_cost.py --reps 7 --path fast --width 20
    python benchmarks/keyed_dropout_padding_cost.py --reps 3 --masks
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import pathlib
import statistics
import sys
import time
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's clipbias
import numpy as np  # noqa: E402
import torch  # noqa: E402

from clipbias.config import AlgoConfig
from clipbias.data.text import sequence_loss
from clipbias.engine import DPEngine
from clipbias.randomness import Purpose, forward
from clipbias.randomness.chacha import BLOCK_BYTES
from clipbias.randomness.draws import stream

_here = pathlib.Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("dropout_padding", _here / "redteam" / "session" / "dropout_padding.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

assert hasattr(forward, "layout"), f"{forward.__file__}: not the per-call layout"
_new_keep = forward.KeyedForward._keep


def _before_keep(self, per_example, p, device):
    """The masks before per-call streams: row-major over the padded shape, call c after call c - 1's blocks."""
    ids = self._rows()
    if self.calls == 0:
        self._before_offset = 0
    m = math.prod(per_example)
    nbytes = 4 * m
    counter = self._before_offset
    self._before_offset, self.calls = counter + -(-nbytes // BLOCK_BYTES), self.calls + 1
    t = np.uint32(min(int((1.0 - p) * 2.0 ** 32), 2 ** 32 - 1))
    rows = {i: stream(self.key, Purpose.FORWARD, self.step, i, nbytes, counter).view("<u4") < t
            for i in dict.fromkeys(ids)}
    keep = np.stack([rows[i] for i in ids])
    return torch.from_numpy(keep).view(len(ids), *per_example).to(device)


def masks_only(reps: int) -> None:
    """The mask function alone, B = 8, on larger per-example shapes: hidden states [512, 768] (row-major,
    no gather), square attention weights [12, 512, 512] and a cross-attention-like [12, 128, 512] (the
    stream is read up to 512^2 per head: 4x the elements)."""
    from clipbias.randomness import SecretKey
    key = SecretKey.from_seed(1)
    for shape in [(512, 768), (12, 512, 512), (12, 128, 512)]:
        res = {}
        for arm, fn in (("new", _new_keep), ("before", _before_keep)):
            ts = []
            for _ in range(reps + 1):
                with forward.keyed(key, 0), forward.examples(list(range(8))), forward.one_pass():
                    t0 = time.perf_counter()
                    fn(forward.active(), shape, 0.1, torch.device("cpu"))
                    ts.append(time.perf_counter() - t0)
            res[arm] = statistics.median(ts[1:]) * 1e3
        print(f"masks of {list(shape)}, B 8: {res['new']:.1f} ms new vs {res['before']:.1f} ms before "
              f"({res['new'] / res['before']:.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--masks", action="store_true", help="the mask function alone on larger shapes")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--path", default="fast")
    ap.add_argument("--width", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.masks:
        masks_only(a.reps)
        return
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 100, (8, a.width), generator=g)
    x, y = bench.batch(tokens, [a.width] * 8, a.width)
    eng = DPEngine(bench.gpt2(0.1), "dpsgd", n=64, batch_size=8, steps=10 ** 6, noise_multiplier=1.0,
                   accountant="rdp", loss_fn=sequence_loss, grad_path=a.path, config=AlgoConfig(lr=1e-3, clip=1.0),
                   noise_seed=3)
    times = {"new": [], "before": []}
    inside = {"new": [], "before": []}
    for r in range(a.reps + 1):
        for arm, fn in (("new", _new_keep), ("before", _before_keep)):
            spent = [0.0]

            def timed(self, *args, fn=fn, spent=spent):
                t0 = time.perf_counter()
                try:
                    return fn(self, *args)
                finally:
                    spent[0] += time.perf_counter() - t0
            forward.KeyedForward._keep = timed
            try:
                t0 = time.perf_counter()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    eng.step(x, y, torch.arange(8))
                dt = time.perf_counter() - t0
            finally:
                forward.KeyedForward._keep = _new_keep
            if r:  # the first round warms up
                times[arm].append(dt)
                inside[arm].append(spent[0])
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    ins = {k: statistics.median(v) * 1e3 for k, v in inside.items()}
    print(f"tiny GPT-2, B 8, width {a.width}, {a.path} path, {a.threads} thread(s), {a.reps} reps: step "
          f"{med['new']:.1f} ms new vs {med['before']:.1f} ms before ({med['new'] / med['before']:.3f}x); "
          f"in the mask function {ins['new']:.2f} vs {ins['before']:.2f} ms")


if __name__ == "__main__":
    main()
