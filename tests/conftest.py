"""Test-session settings.

One intra-op thread: the suite's tensors are tiny, and on the 2-core CI machine a 2-thread pool
that competes with other processes was measured 10x slower (docs/methods.md, "Benchmark").
"""

import torch

torch.set_num_threads(1)
