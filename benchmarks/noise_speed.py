"""Time of the release's noise on the CPU: ``snapped_gaussian`` over ``--size`` float32 coordinates (the
ChaCha20 keystream, float64 Box-Muller, exact rounding onto the grid), in ns per coordinate.

``--against COMMIT`` loads ``clipbias/randomness/draws.py`` and ``noise.py`` as they were at COMMIT (``git
show``) beside the checkout's, checks that both give the same values, and alternates the two ``--reps`` times
(a ratio in one process, so that the machine's load falls on both alike)::

    PYTHONPATH=. python benchmarks/noise_speed.py --size 30000000 --reps 4 --against d2404ad~1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from speed import cpu_description

ROOT = Path(__file__).resolve().parents[1]


def old_noise(commit: str):
    """``clipbias.randomness.noise`` as it was at ``commit``, importing that commit's ``draws``."""
    tmp = Path(tempfile.mkdtemp())
    mods = {}
    for name in ("draws", "noise"):
        src = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:clipbias/randomness/{name}.py"],
                             capture_output=True, text=True, check=True).stdout
        src = src.replace("from .draws import", "from .draws_at import")
        (tmp / f"{name}_at.py").write_text(src)
        spec = importlib.util.spec_from_file_location(f"clipbias.randomness.{name}_at", tmp / f"{name}_at.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods["noise"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=30_000_000)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--against", default=None, help="a commit whose noise code to time beside the checkout's")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from clipbias.randomness import noise
    from clipbias.randomness.key import SecretKey
    key = SecretKey(bytes(range(32)), reproducible=True)  # a fixed key: a timing, nothing released
    x = torch.randn(a.size, generator=torch.Generator().manual_seed(0)) * 1e-3
    arms = {"checkout": noise}
    if a.against:
        arms[a.against] = old_noise(a.against)
        same = torch.equal(*(m.snapped_gaussian(x, 0.7, key, 1, dtype=torch.float32) for m in arms.values()))
        if not same:
            raise SystemExit(f"the noise at {a.against} and the checkout's differ")
    times = {k: [] for k in arms}
    for r in range(a.reps + 1):
        for k, m in arms.items():
            t = time.perf_counter()
            m.snapped_gaussian(x, 0.7, key, 2 + r, dtype=torch.float32)
            if r:
                times[k].append(time.perf_counter() - t)
    out = {"cpu": cpu_description(), "threads": a.threads, "size": a.size, "command": " ".join(sys.argv),
           "seconds": times, "ns_per_coordinate": {k: 1e9 * statistics.median(v) / a.size for k, v in times.items()}}
    if a.against:
        out["same_values"] = True
        out["ratio_checkout_over_against"] = statistics.median(times["checkout"]) / statistics.median(times[a.against])
    print(json.dumps({k: v for k, v in out.items() if k != "seconds"}, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
