"""DiceSGD's sound calibration: the secant search (`dice.calibrate`) against the bisection it replaced.

    python benchmarks/dice_calibration.py

For each configuration, in one process with every in-process cache cleared before each search (and the
calibration cache on disk off: ``CLIPBIAS_CACHE=off`` is set here): CPU time
and the number of sound-bound evaluations (at the report's grid 1e-3 and at the search's coarse grid
1e-2) of ``dice.calibrate(..., "sound")``, and of the bisection (``search.smallest_noise`` between
DPSGD's PLD-calibrated z, less 0.2%, and the conservative bound's z, as ``calibrate`` did before; the
DPSGD calibration is part of its time). Checks, at the report's grid, that each answer meets the
target and that a z 0.1% smaller does not.
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import time
from pathlib import Path

from clipbias.privacy import dice, gaussian, pld, search
from clipbias.privacy.dice import DiceParams

CONFIGS = [  # epsilon, q, T, C1, C2, B (r = B C2 / C1)
    (3.0, 256 / 60000, 2340, 1.0, 0.01 / 256, 256),   # Fashion-MNIST, the default r = 0.01
    (8.0, 256 / 60000, 2340, 1.0, 0.01 / 256, 256),
    (1.0, 256 / 60000, 2340, 1.0, 0.1 / 256, 256),    # r = 0.1
    (3.0, 0.01, 500, 1.0, 0.002, 10),                 # r = 0.02
    (1.0, 0.05, 300, 0.5, 0.002, 50),                 # r = 0.2
    (3.0, 0.01, 1000, 1.0, 0.1, 10),                  # r = 1 (the canary configuration's ratio)
    (8.0, 0.02, 200, 1.0, 1e-5, 10),                  # r = 1e-4: about DPSGD
]
DELTA = 1e-5
_sound = dice.sound_epsilon
_uncached = dice._sound_epsilon.__wrapped__
CALLS: collections.Counter = collections.Counter()


@functools.lru_cache(maxsize=4096)
def counting(r, q, steps, z, delta, discretization=dice.SOUND_DISCRETIZATION):
    """``dice._sound_epsilon``, which both searches reach (the secant directly), counting the evaluations
    that are not cache hits, per grid."""
    CALLS[discretization] += 1
    return _uncached(r, q, steps, z, delta, discretization)


def fresh() -> None:
    CALLS.clear()
    for f in (dice._sound_epsilon, pld.one_step_pld, gaussian.calibrate, dice.calibrate):
        f.cache_clear()


def bisection(eps: float, p: DiceParams) -> float:
    z_cons = gaussian.calibrate(eps, DELTA, 1.0, p.steps, "pld") * (1 + 2 * p.ratio)
    lo = gaussian.calibrate(eps, DELTA, p.sample_rate, p.steps, "pld") * (1 - 2e-3)

    def ok(z: float) -> bool:
        try:
            return dice.sound_epsilon(p, z, DELTA) <= eps
        except gaussian.NoiseTooSmallError:
            return False
    return search.smallest_noise(ok, lo, z_cons)


def run(fn, eps: float, p: DiceParams) -> tuple[float, float, int, int, bool]:
    fresh()
    t0 = time.process_time()
    z = fn(eps, p)
    cpu = time.process_time() - t0
    final, coarse = CALLS[dice.SOUND_DISCRETIZATION], CALLS[dice.SOUND_COARSE]
    ok = _sound(p, z, DELTA) <= eps < _sound(p, z * (1 - 1e-3), DELTA)
    return z, cpu, final, coarse, ok


def main() -> int:
    os.environ["CLIPBIAS_CACHE"] = "off"  # dice.calibrate would otherwise return a stored answer
    dice._sound_epsilon = counting  # both searches look it up at call time
    cpu_name = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name")), "?")
    print(f"# {cpu_name}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    print("| epsilon | q | T | r | bisection: z | CPU s | evaluations | secant: z | CPU s | evaluations 1e-3 + 1e-2 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    bad, tb, ts = 0, 0.0, 0.0
    for eps, q, steps, c1, c2, b in CONFIGS:
        p = DiceParams(q, steps, c1, c2, b)
        zb, cb, nb, _, okb = run(bisection, eps, p)
        zs, cs, ns, nc, oks = run(lambda e, pp: dice.calibrate(e, DELTA, pp, "sound"), eps, p)
        bad += (not okb) + (not oks)
        tb, ts = tb + cb, ts + cs
        print(f"| {eps:g} | {q:.4g} | {steps} | {p.ratio:g} | {zb:.5f} | {cb:.2f} | {nb} | {zs:.5f} | {cs:.2f} | "
              f"{ns} + {nc} |", flush=True)
    print(f"\ntotal CPU: bisection {tb:.2f} s, secant {ts:.2f} s; failed checks: {bad}; "
          f"load average {os.getloadavg()[0]:.2f} at the end")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
