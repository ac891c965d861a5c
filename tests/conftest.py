"""Test-session settings.

One intra-op thread: the suite's tensors are tiny, and on the 2-core CI machine a 2-thread pool
that competes with other processes was measured 10x slower (docs/methods.md, "Benchmark").

Calibrations are cached for the session in a fresh temporary directory (never the user's cache):
the many tests that train the same small configuration calibrate its noise once per test process
and re-check the cached value against the target on every later use (``privacy.cache``), so every
asserted epsilon is still computed by the accountant. tests/test_engine.py checks the cache itself
in a directory of its own.
"""

import atexit
import os
import shutil
import tempfile

import pytest
import torch

torch.set_num_threads(1)
_CALIBRATIONS = tempfile.mkdtemp(prefix="clipbias-test-calibrations-")
atexit.register(shutil.rmtree, _CALIBRATIONS, True)
os.environ["CLIPBIAS_CACHE"] = _CALIBRATIONS


@pytest.fixture(autouse=True)
def _one_thread():
    """The commands set torch's thread count to the available cores (``--threads`` default); put the
    test process back to one thread after each test, so one CLI test does not make every later test
    of its process compete with the other test process for both cores."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
