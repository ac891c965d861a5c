"""The noise-multiplier search every calibrator uses: the smallest z whose epsilon is at most a target.

Epsilon is monotone in z (more noise is never worse), and log epsilon is close to linear in log z
(slope -1 for small epsilon, about -2 for large). ``calibrate_levels`` exploits both:

1. ``approach``, once per cheap accountant (Renyi DP, then a coarse PLD grid): a secant on
   (log z, log epsilon) from the previous level's estimate and slope. Each cheap level only moves
   the starting point; nothing it says is trusted.
2. ``confirm``, with the final accountant (the one every report uses): evaluate just above the
   estimate, then just below, moving by the same secant until a z that meets the target and a z at
   most ``rel_tol`` (relative) below it that does not have both been evaluated. The answer is that
   upper end: its final-accountant epsilon is <= target, so a calibration never overshoots, and no
   z smaller by more than ``rel_tol`` was seen to meet it. Typically two final evaluations.

DiceSGD's bounds use the same two phases (``clipbias/privacy/dice.py``): the sound bound aims on a
coarser PLD grid, the paper's with its own closed form. ``smallest_noise`` is the plain bisection, kept
as the reference those searches are measured against (``benchmarks/dice_calibration.py``, tests).
"""

from __future__ import annotations

import math
from typing import Callable

REL_TOL = 1e-3  # the calibration's relative tolerance on z
_MAX_STEP = math.log(4.0)  # a secant step moves z by at most 4x
_SLOPE = (-8.0, -0.2)  # the secant slope d log eps / d log z, clamped (a flat or rising pair: noise)

EpsOf = Callable[[float], float]


def _log(e: float) -> float:
    if e != e or e == math.inf:  # NaN or inf: a refusal or an unbounded epsilon reads as too little noise
        return math.inf
    return math.log(e) if e > 0 else -700.0


class _Secant:
    """The log-log line through the last two evaluations, or the last one and the previous slope."""

    def __init__(self, target: float, slope: float) -> None:
        self.lt, self.slope, self.last = math.log(target), slope, None

    def root(self, z: float, e: float) -> float:
        """Where the line through (z, e) meets the target; z doubled when e is infinite."""
        le, lz = _log(e), math.log(z)
        if le == math.inf:
            self.last = None
            return 2.0 * z
        if self.last is not None and self.last[0] != lz:
            s = (le - self.last[1]) / (lz - self.last[0])
            if s < 0:
                self.slope = min(max(s, _SLOPE[0]), _SLOPE[1])
        self.last = (lz, le)
        step = (self.lt - le) / self.slope
        return z * math.exp(min(max(step, -_MAX_STEP), _MAX_STEP))


def approach(eps_of: EpsOf, target: float, z: float, slope: float, rel_tol: float, floor: float,
             ceiling: float, max_evals: int = 40) -> tuple[float, float]:
    """A z where ``eps_of(z)`` is about ``target`` (the secant's step below ``rel_tol``, or stuck at
    ``floor``/``ceiling``), and the slope it ended with. A cheap accountant that answers 0 cannot resolve
    epsilons this small (Renyi DP's largest order, a coarse grid: far below its target, as for epsilon
    1e-4): the level stops there, at the last z it resolved and the slope it was given, and the next level
    aims from it (it never decides the answer: ``confirm`` does)."""
    line, resolved = _Secant(target, slope), None
    for _ in range(max_evals):
        e = eps_of(z)
        if e <= 0:
            return (z if resolved is None else resolved), slope
        resolved = z
        new = min(max(line.root(z, e), floor), ceiling)
        if abs(math.log(new / z)) < rel_tol:
            return new, line.slope
        z = new
    return z, line.slope


def confirm(eps_of: EpsOf, target: float, z: float, slope: float, rel_tol: float = REL_TOL,
            floor: float = 0.0, ceiling: float = 1e6, max_evals: int = 200) -> float:
    """The smallest z (to ``rel_tol``) with ``eps_of(z) <= target``, searched from the estimate ``z``:
    returns an evaluated z that meets the target and either is ``floor`` or has a failing z at most
    ``rel_tol * z`` below it; ``math.inf`` when even ``ceiling`` fails."""
    line = _Secant(target, slope)
    lo = hi = None  # the largest z seen failing, the smallest seen meeting the target
    cand, tries = (z * (1 + rel_tol / 2) if z > floor else floor), 0  # at the floor: try the floor itself
    for _ in range(max_evals):
        e = eps_of(cand)
        if e <= target:
            hi = cand if hi is None else min(hi, cand)
        else:
            lo = cand if lo is None else max(lo, cand)
        if hi is not None and (hi <= floor or (lo is not None and hi - lo <= rel_tol * hi)):
            return hi
        if hi is None and lo >= ceiling:
            return math.inf
        r = line.root(cand, e)
        if hi is None:  # only failures so far: go up, past the estimate
            cand = min(ceiling, max(r * (1 + rel_tol / 2), lo * (1 + rel_tol)))
        elif lo is None:  # only successes: the next try ends the search if it fails
            cand = max(floor, min(hi * (1 - 0.99 * rel_tol), r * (1 + rel_tol / 2)))
        else:  # a bracket: secant, or bisection once the secant keeps missing
            tries += 1
            guess = r * (1 + rel_tol / 2) if tries <= 3 else 0.5 * (lo + hi)
            cand = min(hi * (1 - 0.99 * rel_tol), max(guess, lo + 0.25 * (hi - lo)))
    raise RuntimeError(f"noise calibration did not converge within {max_evals} evaluations "
                       f"(bracket {lo!r}, {hi!r})")  # pragma: no cover - the bracket shrinks every step


def calibrate_levels(target: float, levels: list[tuple[EpsOf, float]], final: EpsOf, start: float = 1.0,
                     rel_tol: float = REL_TOL, floor: float = 0.0, ceiling: float = 1e6) -> float:
    """``approach`` with each cheap ``(eps_of, its rel_tol)`` of ``levels`` in turn, then ``confirm``
    with ``final``: the smallest z (to ``rel_tol``) whose final epsilon is <= ``target``, ``math.inf``
    when ``ceiling`` is not enough."""
    z, slope = min(max(start, floor), ceiling), -1.0
    for eps_of, tol in levels:
        z, slope = approach(eps_of, target, z, slope, tol, floor, ceiling)
    return confirm(final, target, z, slope, rel_tol, floor, ceiling)


def smallest_noise(ok: Callable[[float], bool], lo: float, hi: float, rel_tol: float = REL_TOL) -> float:
    """The smallest z in (lo, hi] with ``ok(z)`` (a monotone predicate: more noise is never worse),
    to ``rel_tol`` relative tolerance. Returns the upper end of the bracket, so the answer always
    satisfies ``ok``: a calibration never overshoots its epsilon. When ``ok(hi)`` fails (a
    discretised bound can sit a hair above its analytic bracket) the bracket first moves up 1% at a
    time. The reference the secant searches are measured against (no calibrator uses it)."""
    while not ok(hi):
        lo, hi = hi, hi * 1.01
    while hi - lo > rel_tol * hi:
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi
