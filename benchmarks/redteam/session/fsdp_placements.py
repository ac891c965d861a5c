"""Red team, fully_shard: does each rank's shard receive the slice of the one noisy update that FSDP2
gave it, when the shards are not FSDP2's default (Shard(1) through shard_placement_fn), uneven, or
on more ranks than a parameter has rows (empty shards)?  3 gloo ranks, float64, 3 steps of dpsgd with
the same noise seed, compared with the unsharded model in one process: the largest weight difference
(0 up to float64 rounding: one draw, every slice where it belongs)."""
import os
import pathlib
import socket
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

WORLD = 3


def model():
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(7, 2), torch.nn.Tanh())  # 2 rows on 3 ranks: an empty shard
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), block, torch.nn.Linear(2, 3)).double()


def train(m):
    from clipbias.config import AlgoConfig
    from clipbias.engine.core import DPEngine, run_steps
    x, y = torch.randn(60, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), torch.arange(60) % 3
    eng = DPEngine(m, "dpsgd", n=60, batch_size=20, steps=3, noise_multiplier=1.0, noise_seed=5, accountant="rdp",
                   max_physical_batch=4, config=AlgoConfig(lr=0.5, clip=1.0, momentum=0.9))
    run_steps(eng, x, y, 3)
    return eng


def rank_main(rank, port, out, dim):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed.nn.functional as _defaults  # noqa: F401
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard
        m = model()
        place = (lambda p: Shard(dim if p.dim() > dim and p.shape[dim] % WORLD == 0 else 0))  # FSDP2: dim 1 even only
        fully_shard(m[2], shard_placement_fn=place)
        fully_shard(m, shard_placement_fn=place)
        try:
            eng = train(m)
            res = {"w": [p.full_tensor() for p in m.parameters()], "eps": eng.privacy().epsilon,
                   "local": [tuple(p.to_local().shape) for p in m.parameters()]}
        except Exception as e:  # noqa: BLE001
            res = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        torch.save(res, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def main():
    one = model()
    eng = train(one)
    worst = 0.0
    for dim in (0, 1):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = tempfile.mktemp()
        mp.spawn(rank_main, args=(port, out, dim), nprocs=WORLD, join=True)
        for r in range(WORLD):
            res = torch.load(f"{out}.{r}")
            if "error" in res:
                print(f"Shard({dim}) rank {r}: {res['error']}")
                continue
            d = max(float((a - b).detach().abs().max()) for a, b in zip(res["w"], one.parameters()))
            worst = max(worst, d)
            print(f"Shard({dim}) rank {r}: local shapes {res['local']}; max |w - unsharded| {d:.2e}; "
                  f"epsilon equal {res['eps'] == eng.privacy().epsilon}")
    return worst


if __name__ == "__main__":
    main()
