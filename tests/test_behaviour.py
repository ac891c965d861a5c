"""Behaviour identity: every algorithm's fixed-seed run gives the stored numbers.

``tests/data/behaviour.json`` was produced by ``python -m tests.behaviour`` (first before the
one-step redesign, issue 13; a case added later by ``--add`` on another machine records its own
``fingerprint``). On the machine that produced a case (same torch, CPU capability and CPU model: its
``fingerprint``) a refactor must not change one bit of any results.json number
(accuracy, losses, epsilon, noise multiplier), of the final weights, or of the private engine state.

On another machine float kernels round differently (measured: a fresh AMD EPYC AVX2 machine gave
training losses differing by ~2e-6 relative and one test example's prediction flipped), so there
the float numbers are compared within tolerances that rounding stays far inside and a changed
formula does not, and the exact-valued engine state (secret RNG states, counters) still bit for bit.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.behaviour import CASES, fingerprint, numbers

GOLDEN = json.loads((Path(__file__).parent / "data" / "behaviour.json").read_text())
REL = 1e-4  # relative tolerance for float results off the golden machine (measured drift: 2.4e-6)
ACCURACY_ABS = 0.01  # a few of the few hundred test predictions may flip


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the stored numbers were computed with one thread
    yield
    torch.set_num_threads(n)


def test_every_algorithm_has_a_stored_case():
    """One golden case per registered method (``python -m tests.behaviour --add NAME`` writes a new one's), and
    ``CASES`` sets only registered methods' settings."""
    from clipbias.algorithms import ALGORITHMS
    assert set(GOLDEN["cases"]) == set(ALGORITHMS) >= set(CASES)


def close(got, want, key: str = "") -> bool:
    """Exact for strings, ints and structure; float.hex values within the tolerances above."""
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(
            close(got[k], want[k], k) for k in want)
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and all(
            close(g, w, key) for g, w in zip(got, want))
    if isinstance(want, str) and want.startswith(("0x", "-0x")) and isinstance(got, str):
        a, b = float.fromhex(got), float.fromhex(want)
        return math.isclose(a, b, rel_tol=REL, abs_tol=ACCURACY_ABS if "accuracy" in key else 1e-9)
    if isinstance(want, float):
        return math.isclose(got, want, rel_tol=REL, abs_tol=1e-9)
    return got == want


@pytest.mark.parametrize("algo", sorted(GOLDEN["cases"]))
def test_fixed_seed_run_gives_the_stored_numbers(algo):
    got, want = numbers(algo), GOLDEN["cases"][algo]
    assert got["engine_exact"] == want["engine_exact"], "secret RNG states or counters differ"
    assert close(got["results"], want["results"]), (got["results"], want["results"])
    assert summaries_close(got["model_summary"], want["model_summary"]), "final weights differ beyond rounding"
    assert summaries_close(got["engine_floats"], want["engine_floats"]), "feedback buffer / momenta differ"
    if want.get("fingerprint", GOLDEN["fingerprint"]) == fingerprint():  # the case's machine: bit for bit
        assert got["results"] == want["results"]
        assert got["model"] == want["model"], "final weights differ"
        assert got["engine"] == want["engine"], "private engine state (feedback buffer, RNG states) differs"


def summaries_close(got: list[float], want: list[float]) -> bool:
    """[sum, sum of squares, sum of |x|] of a state's floats: the sum may cancel (a feedback buffer's entries
    of both signs), and its rounding is bounded by the sum of the magnitudes, so it is compared within
    ``REL`` of that; the other two within ``REL`` of themselves."""
    (s, q, a), (ws, wq, wa) = got, want
    return abs(s - ws) <= REL * max(wa, 1e-9) + 1e-9 and close([q, a], [wq, wa])


def test_tolerance_is_tight_enough_to_see_a_changed_number():
    """The off-machine comparison must still fail for a change a refactor could make: a loss off by
    0.5 %, an epsilon off by 0.2 %, an accuracy off by 2 points."""
    want = {"train_loss": (1.0).hex(), "epsilon": (3.0).hex(), "test_accuracy": (0.8).hex()}
    assert close(dict(want), want)
    assert close({**want, "train_loss": (1.0 + 2e-6).hex()}, want)
    assert not close({**want, "train_loss": (1.005).hex()}, want)
    assert not close({**want, "epsilon": (3.006).hex()}, want)
    assert not close({**want, "test_accuracy": (0.82).hex()}, want)
    assert summaries_close([0.0528223, 0.25383, 41.4673], [0.0528331, 0.25383, 41.4673])  # rounding of a sum
    assert not summaries_close([0.0528 + 0.01, 0.25383, 41.4673], [0.0528, 0.25383, 41.4673])  # 2.4e-4 of |x|
