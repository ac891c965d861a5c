"""Test-session settings.

One intra-op thread: the suite's tensors are tiny, and on the 2-core CI machine a 2-thread pool
that competes with other processes was measured 10x slower (docs/methods.md, "Benchmark").

Calibrations are cached for the test session in a fresh temporary directory (never the user's
cache), shared by the session's pytest-xdist workers: the tests that train the same small
configuration calibrate its noise once, and every later use re-checks the cached value against
its target epsilon (``privacy.cache``), so every asserted epsilon is still computed by the
accountant. tests/test_engine.py checks the cache itself in a directory of its own.
"""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


def _calibration_dir() -> str:
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # the same in every worker of one session
    if run is None:
        return tempfile.mkdtemp(prefix="clipbias-test-calibrations-")
    path = Path(tempfile.gettempdir()) / f"clipbias-test-calibrations-{run}"
    path.mkdir(exist_ok=True)
    return str(path)


_CALIBRATIONS = _calibration_dir()
atexit.register(shutil.rmtree, _CALIBRATIONS, True)  # a worker still running re-creates it if it writes
os.environ["CLIPBIAS_CACHE"] = _CALIBRATIONS


@pytest.fixture(autouse=True)
def _one_thread():
    """The commands set torch's thread count to the available cores (``--threads`` default); put the
    test process back to one thread after each test, so one CLI test does not make every later test
    of its process compete with the other test process for both cores."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
