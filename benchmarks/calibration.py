"""Time and check `clipbias calibrate` over the supported range, CLI start included, no disk cache.

    python benchmarks/calibration.py            # 40 grid configurations + 12 drawn at random (~3 min)
    python benchmarks/calibration.py --quick    # 8 of them
    python benchmarks/calibration.py --pld      # one-step PLD: dp-accounting's constructor vs fast_pld

Every configuration runs `python -m clipbias calibrate --algo dpsgd ... --json` in a fresh process with
CLIPBIAS_CACHE=off (wall and CPU time of that process), then checks here, with the accountant every
report uses (PLD at its default grid), that the answer never overshoots (epsilon(z) <= target) and is
the smallest to the stated tolerance (epsilon(z (1 - 1e-3)) > target). The grid: epsilon in
{0.5, 1, 3, 10} x q in {1e-3, 1e-2, 0.1} x T in {10, 1000, 10^4}, and the four corners at T = 1; the
random ones (a fixed numpy seed: public benchmark inputs, nothing secret) draw epsilon, q, T and delta
log-uniformly in [0.5, 10], [1e-3, 0.1], [1, 10^4], [1e-7, 1e-4]. Prints one row per configuration, then
the median and maximum times and the number of overshoots (which must be 0).
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-3


def configurations(quick: bool) -> list[tuple[float, float, int, float]]:
    grid = [(e, q, t, 1e-5) for e, q, t in itertools.product((0.5, 1.0, 3.0, 10.0), (1e-3, 1e-2, 0.1),
                                                             (10, 1000, 10000))]
    grid += [(e, q, 1, 1e-5) for e, q in itertools.product((0.5, 10.0), (1e-3, 0.1))]
    rng = np.random.default_rng(20261125)
    drawn = [(float(np.exp(rng.uniform(np.log(0.5), np.log(10)))), float(np.exp(rng.uniform(np.log(1e-3), np.log(0.1)))),
              int(np.exp(rng.uniform(0, np.log(1e4)))), float(10 ** rng.uniform(-7, -4))) for _ in range(12)]
    every = grid + drawn
    return every[::7] + drawn[:1] if quick else every


def run_cli(eps: float, q: float, steps: int, delta: float) -> tuple[float, float, float, float]:
    """(z, its epsilon as reported, wall s, CPU s) of one CLI calibration in a fresh process."""
    env = {**os.environ, "CLIPBIAS_CACHE": "off", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "clipbias", "calibrate", "--algo", "dpsgd", "--epsilon", repr(eps), "--delta",
           repr(delta), "--sample-rate", repr(q), "--steps", str(steps), "--json"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr}")
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    got = json.loads(out.stdout)
    return got["noise_multiplier"], got["epsilon"], wall, cpu


def pld_builds() -> None:
    """Seconds to build one step's PLD at the default grid: the library's constructor and the vectorised
    one (min of 3), at noise multipliers a calibration visits."""
    from dp_accounting.pld import privacy_loss_distribution as PLD

    from clipbias.privacy import fast_pld
    print("| z | q | dp-accounting s | fast_pld s | ratio |\n|---|---|---|---|---|")
    for z, q in [(0.25, 1e-3), (0.7, 256 / 60000), (3.0, 0.1)]:
        lib = min(_time(lambda: PLD.from_gaussian_mechanism(z, value_discretization_interval=1e-4,
                                                            sampling_prob=q)) for _ in range(3))
        mine = min(_time(lambda: fast_pld.gaussian_pld(z, q, 1e-4)) for _ in range(3))
        print(f"| {z:g} | {q:.4g} | {lib:.3f} | {mine:.3f} | {lib / mine:.1f} |", flush=True)
    print("\nDiceSGD's sound step (mixture of N(2r, z^2) and N(2r + 1, z^2) at 1 - q and q), grid 1e-3:\n"
          "| z | q | r | dp-accounting s | fast_pld s | ratio |\n|---|---|---|---|---|---|")
    for z, q, r in [(1.0, 0.01, 0.5), (1.0, 0.01, 2.0), (3.0, 256 / 60000, 0.1)]:
        shifts, probs = (2 * r, 2 * r + 1), (1 - q, q)
        lib = min(_time(lambda: PLD.from_mixture_gaussian_mechanism(z, list(shifts), list(probs),
                                                                    value_discretization_interval=1e-3))
                  for _ in range(3))
        mine = min(_time(lambda: fast_pld.mixture_pld(z, shifts, probs, 1e-3)) for _ in range(3))
        print(f"| {z:g} | {q:.4g} | {r:g} | {lib:.3f} | {mine:.3f} | {lib / mine:.1f} |", flush=True)


def _time(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def main() -> int:
    from clipbias.privacy import gaussian, pld
    if "--pld" in sys.argv[1:]:
        pld_builds()
        return 0
    quick = "--quick" in sys.argv[1:]
    cpu_name = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name")), platform.processor())
    print(f"# {cpu_name}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    print("| epsilon | q | T | delta | z | epsilon(z) | epsilon(z (1 - 1e-3)) | wall s | CPU s | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    walls, cpus, bad = [], [], 0
    for eps, q, steps, delta in configurations(quick):
        z, reported, wall, cpu = run_cli(eps, q, steps, delta)
        above = gaussian.epsilon(z, q, steps, delta, "pld")
        below = gaussian.epsilon(z * (1 - TOL), q, steps, delta, "pld") if z * (1 - TOL) >= pld.PLD_MIN_NOISE \
            else float("inf")
        ok = above <= eps and reported == above and (below > eps or z == pld.PLD_MIN_NOISE)
        bad += not ok
        walls.append(wall)
        cpus.append(cpu)
        print(f"| {eps:.4g} | {q:.4g} | {steps} | {delta:.2g} | {z:.5f} | {above:.5f} | {below:.5f} | {wall:.2f} | "
              f"{cpu:.2f} | {'yes' if ok else 'NO'} |", flush=True)
    print(f"\n{len(walls)} configurations: wall median {statistics.median(walls):.2f} s, max {max(walls):.2f} s; "
          f"CPU median {statistics.median(cpus):.2f} s, max {max(cpus):.2f} s; failed checks: {bad}; "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
