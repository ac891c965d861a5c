"""Behaviour identity: every algorithm's fixed-seed run gives the stored numbers bit for bit.

``tests/data/behaviour.json`` was produced by ``python -m tests.behaviour`` before the one-step
redesign (issue 13). A refactor must not change one bit of any results.json number (accuracy,
losses, epsilon, noise multiplier), of the final weights, or of the private engine state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.behaviour import CASES, numbers

GOLDEN = json.loads((Path(__file__).parent / "data" / "behaviour.json").read_text())


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the stored numbers were computed with one thread
    yield
    torch.set_num_threads(n)


def test_every_algorithm_has_a_stored_case():
    from clipbias.algorithms import ALGORITHMS
    assert set(GOLDEN) == set(CASES) == set(ALGORITHMS)


@pytest.mark.parametrize("algo", sorted(CASES))
def test_fixed_seed_run_is_bit_identical(algo):
    got = numbers(algo)
    want = GOLDEN[algo]
    assert got["results"] == want["results"]
    assert got["model"] == want["model"], "final weights differ"
    assert got["engine"] == want["engine"], "private engine state (feedback buffer, RNG states) differs"
