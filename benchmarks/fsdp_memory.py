"""Peak memory per rank of a private step: one process, data-parallel replicas (N gloo ranks) and a model sharded
with ``fully_shard`` (N gloo ranks), on the CPU.

The model is an MLP of ``--blocks`` blocks (Linear(width, width), ReLU, LayerNorm), float32, trained with dpsgd on
the fast path, SGD with momentum (``--optimizer adam``: Adam), ``--steps`` steps of expected batch ``--batch``
on random data. Sharded, every block is a ``fully_shard`` unit and the model the root; its parameters are created
on the meta device and materialised as shards, so no rank ever holds the whole model outside a step. Each
configuration runs in fresh processes with ``MALLOC_MMAP_THRESHOLD_=65536`` (every tensor above 64 KiB is its own
mapping, returned to the system when freed, so the resident size follows the live tensors). Per rank:

* ``peak MB``: the peak resident size (``ru_maxrss``) minus the resident size before the model was built (the
  interpreter, torch, clipbias and the process group): the parameters, gradients, optimizer state, the step's
  sums, noise and update, activations and the data, at their peak;
* ``held MB``: the bytes of the tensors this rank holds between steps: its parameters (or shards) and optimizer
  state (the gradients are cleared after each step);
* ``x one``: the largest rank's peak over the one-process peak.

``--modes``: ``one`` (one process), ``ddp`` (N ranks, every rank a full replica), ``fsdp`` (N ranks, sharded: the
model gathered for the sums, the sums, noise and update sharded), ``fsdp-whole`` (the same with the sums, noise and
update whole on every rank: the path of the steps ``clipbias.engine.sharded`` does not cover, such as error
feedback). Usage::

    python benchmarks/fsdp_memory.py                          # 25.2M parameters: one, ddp, fsdp at 2 and 4 ranks
    python benchmarks/fsdp_memory.py --ranks 4 --modes one,fsdp,fsdp-whole --optimizer adam
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _model(args, meta: bool):
    import torch
    from torch import nn
    with torch.device("meta" if meta else "cpu"):
        blocks = [nn.Sequential(nn.Linear(args.width, args.width), nn.ReLU(), nn.LayerNorm(args.width))
                  for _ in range(args.blocks)]
        return nn.Sequential(nn.Linear(args.inputs, args.width), nn.ReLU(), *blocks, nn.Linear(args.width, 10))


def rank_main(rank: int, world: int, port: int, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed.nn.functional  # noqa: F401  (before the group: clipbias.distributed.init_from_env)
    import torch.distributed as dist
    torch.set_num_threads(args.threads)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    if args.mode == "fsdp-whole":
        import clipbias.engine.sharded as sharded
        sharded.applies = lambda engine, agg: "whole sums (benchmark)"
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(args.n, args.inputs, generator=g), torch.randint(0, 10, (args.n,), generator=g)
    _train(argparse.Namespace(**{**vars(args), "width": 8, "blocks": 1, "steps": 1}), x, y)  # warm-up: the imports
    before = _rss_mb()
    t0 = time.perf_counter()
    model, eng = _train(args, x, y)
    peak = _peak_mb() - before
    held = sum(t.to_local().numel() * t.element_size() if hasattr(t, "to_local") else t.numel() * t.element_size()
               for t in [*model.parameters(), *(v for s in eng.optimizer.state.values() for v in s.values()
                                                if torch.is_tensor(v) and v.dim() > 0)])
    res = {"rank": rank, "peak_mb": peak, "held_mb": held / 2**20, "seconds": time.perf_counter() - t0,
           "params": sum(p.numel() for p in model.parameters()), "note": eng.grad_path_note}
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(res, fh)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _train(args, x, y):
    """The model of ``args`` built (sharded for the fsdp modes) and trained ``args.steps`` steps: (model, engine)."""
    import torch
    from clipbias.config import AlgoConfig
    from clipbias.engine.core import DPEngine, run_steps
    torch.manual_seed(0)
    if args.mode.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard
        model = _model(args, meta=True)
        for block in model[2:2 + args.blocks]:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cpu")
        with torch.no_grad():  # every rank initialises its own shards (the benchmark does not need equal weights)
            for p in model.parameters():
                p.to_local().normal_(0, 0.02)
    else:
        model = _model(args, meta=False)
    config = AlgoConfig(lr=0.1, clip=1.0, momentum=0.9 if args.optimizer == "sgd" else 0.0,
                        optimizer=None if args.optimizer == "sgd" else "adam")
    eng = DPEngine(model, "dpsgd", n=args.n, batch_size=args.batch, steps=args.steps, noise_multiplier=1.0,
                   noise_seed=1, accountant="rdp", grad_path="fast", max_physical_batch=args.batch, config=config)
    run_steps(eng, x, y, args.steps)
    return model, eng


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(args) -> None:
    """One configuration in this (fresh) process: its ranks spawned, their results printed as one JSON line."""
    import tempfile

    import torch.multiprocessing as mp
    world = 1 if args.mode == "one" else args.world
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank")
        if world == 1:
            rank_main(0, 1, 0, args, out)
        else:
            mp.spawn(rank_main, args=(world, _free_port(), args, out), nprocs=world, join=True)
        ranks = []
        for r in range(world):
            with open(f"{out}.{r}") as fh:
                ranks.append(json.load(fh))
    print(json.dumps({"mode": args.mode, "world": world, "ranks": ranks}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="See the module docstring for the "
                                 "columns.", formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="2,4", help="world sizes of the ddp and fsdp modes (default 2,4)")
    ap.add_argument("--modes", default="one,ddp,fsdp", help="one, ddp, fsdp, fsdp-whole (default one,ddp,fsdp)")
    ap.add_argument("--width", type=int, default=2048, help="width of the blocks (default 2048)")
    ap.add_argument("--blocks", type=int, default=6, help="number of blocks, each a fully_shard unit (default 6)")
    ap.add_argument("--inputs", type=int, default=256, help="input features (default 256)")
    ap.add_argument("--n", type=int, default=2048, help="examples (default 2048)")
    ap.add_argument("--batch", type=int, default=32, help="expected batch size, also max_physical_batch (default 32)")
    ap.add_argument("--steps", type=int, default=3, help="steps (default 3)")
    ap.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="SGD with momentum 0.9, or Adam")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        return child(args)
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    runs = [("one", 1)] if "one" in args.modes.split(",") else []
    runs += [(m, int(w)) for w in args.ranks.split(",") for m in args.modes.split(",") if m != "one"]
    base = None
    print(f"{'mode':<11} {'ranks':>5} {'params':>10} {'peak MB (max rank)':>19} {'held MB':>8} {'x one':>6} {'s':>6}")
    for mode, world in runs:
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", mode, "--world", str(world)] + [
            f"--{k}={v}" for k, v in vars(args).items() if k not in ("mode", "world", "ranks", "modes")]
        got = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
        peak = max(r["peak_mb"] for r in got["ranks"])
        held = max(r["held_mb"] for r in got["ranks"])
        base = peak if mode == "one" else base
        ratio = f"{peak / base:.2f}" if base else "-"
        secs = max(r["seconds"] for r in got["ranks"])
        print(f"{mode:<11} {world:>5} {got['ranks'][0]['params'] / 1e6:>9.1f}M {peak:>19.0f} {held:>8.0f} {ratio:>6} "
              f"{secs:>6.1f}", flush=True)


if __name__ == "__main__":
    main()
