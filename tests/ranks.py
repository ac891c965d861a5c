"""One pair of spawned gloo ranks for the test session (the ``two_ranks`` fixture of conftest.py).

A spawned rank's start (torch, clipbias and torch._dynamo imported afresh, a gloo group) takes 3.3 s of CPU, more
than most of what the 2-process tests run in it, so the tests that need two ranks share one pair: each of their
modules defines ``ranks_scenario(rank, out)``, run by both ranks inside one process group, in module order, writing
its results under ``out`` (its own folder) for its tests to read. A module may also define
``ranks_before_group(rank, world, port, out)``: run first, in the fresh processes, before any group exists (with a
port of its own). A scenario leaves the process as it found it (it restores what it patches), since the next
module's runs in the same process; one that raises fails every test that uses the ranks, with its traceback.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import torch


def run(rank: int, world: int, ports: tuple[int, int], out: str, modules: list[str]) -> None:
    """The spawn target: every ``ranks_before_group`` of ``modules``, then one gloo group for every
    ``ranks_scenario``; module ``tests.test_x`` writes under ``out/test_x``."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    mods = [importlib.import_module(f"tests.{name}") for name in modules]
    for name, mod in zip(modules, mods):
        (Path(out) / name).mkdir(exist_ok=True)
        if hasattr(mod, "ranks_before_group"):
            env = dict(os.environ)
            mod.ranks_before_group(rank, world, ports[0], str(Path(out) / name))
            os.environ.clear()
            os.environ.update(env)  # the variables that group set, no more
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[1]))
    import torch.distributed.nn.functional as _defaults  # noqa: F401  before the group: see distributed.init_from_env
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name, mod in zip(modules, mods):
            if hasattr(mod, "ranks_scenario"):
                mod.ranks_scenario(rank, str(Path(out) / name))
                dist.barrier()
    finally:
        dist.destroy_process_group()
