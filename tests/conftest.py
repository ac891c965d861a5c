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


def _pin_worker() -> None:
    """Under pytest-xdist, worker i of n keeps the cores i, i + n, ... of those it may use (when there are at
    least n): the commands' ``--threads`` default (the cores this process may use) then starts no thread pool
    that competes with the other workers for their cores (a 2-thread pool beside a busy worker ran a whole
    `clipbias compare` 2x slower), and what a test starts (a ``clipbias train`` subprocess, spawned ranks)
    shares its worker's cores."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not (worker.startswith("gw") and count.isdigit() and hasattr(os, "sched_setaffinity")):
        return
    cores, i, n = sorted(os.sched_getaffinity(0)), int(worker[2:]), int(count)
    if len(cores) >= n > 1:
        os.sched_setaffinity(0, cores[i % n::n])


_pin_worker()


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


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def two_ranks(request, tmp_path_factory) -> Path:
    """The folder where one pair of spawned gloo ranks (``tests/ranks.py``) ran the 2-process scenario of every
    test module that has a selected test using this fixture: ``two_ranks / "test_x"`` for ``tests/test_x.py``.
    Once per test session: under pytest-xdist the first worker to need it spawns the ranks in the folder its
    workers share, holding a lock, and a worker that needs it meanwhile waits for their files."""
    import torch.multiprocessing as mp
    from filelock import FileLock  # (a dependency of torch)

    from tests import ranks
    modules = sorted({item.path.stem for item in request.session.items if "two_ranks" in item.fixturenames})
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the folder of this session's workers
    out = root / "two-ranks"
    with FileLock(str(out) + ".lock"):
        if not (out / "done").is_file():
            shutil.rmtree(out, ignore_errors=True)  # (what a failed try left)
            out.mkdir()
            mp.spawn(ranks.run, args=(2, (_free_port(), _free_port()), str(out), modules), nprocs=2, join=True)
            (out / "done").touch()
    return out


@pytest.fixture(autouse=True)
def _no_spot_probes():
    """The graph proof's secret spot probes (``clipbias.grads.proof.SPOT``: one proven step in 16 keeps its probe)
    off, so that tests counting probes are exact; ``tests/test_guard_round9.py`` turns them on. (Not through
    ``monkeypatch``: a test's ``monkeypatch.undo()`` would turn them back on.)"""
    from clipbias.grads import proof
    saved, proof.SPOT = proof.SPOT, 0
    yield
    proof.SPOT = saved
