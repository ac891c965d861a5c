"""Test-session settings.

One intra-op thread: the suite's tensors are tiny, and on the 2-core CI machine a 2-thread pool
that competes with other processes was measured 10x slower (docs/methods.md, "Benchmark").
"""

import os

import torch

torch.set_num_threads(1)
# no disk cache of calibrations in the suite (tests/test_engine.py checks the cache in a temporary directory)
os.environ["CLIPBIAS_CACHE"] = "off"
