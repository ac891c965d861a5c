"""torch.distributed (gloo, 2 CPU processes) gives the single-process run: the same weights (up to
float rounding and rare single steps of the noise grid) and the same epsilon with the same seed and
--reproducible-noise, one failing rank stops every rank with the same error and nothing updated,
refusals are clear. The test session's pair of spawned ranks (conftest's ``two_ranks``) runs the 2-process side
of every test but the torchrun one (``ranks_scenario``)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clipbias.errors import ConfigError, NonFiniteGradientError, ResumeMismatchError
from clipbias.run.training import TrainConfig, load_checkpoint, train

ROOT = Path(__file__).resolve().parent.parent
# digits: 1347 examples, B = 64 -> 21 steps; a fixed noise multiplier (no calibration)
BASE = TrainConfig(data="digits", model="mlp", algo="dpsgd", noise_multiplier=1.0, delta=1e-5, epochs=1,
                   batch_size=64, lr=0.5, clip=1.0, seed=3, reproducible_noise=True)


# inner-outer: past iterates and outer momentum; dpgd-momentum: one momentum buffer per example (full
# batch, 3 steps), sharded by owner and gathered into the checkpoint; p-avg: groups processed whole by
# one rank; dpsgd --grad-path fast: the book-keeping sums per rank
METHODS = [{"algo": "dpsgd"}, {"algo": "dice"}, {"algo": "inner-outer", "extra": {"K0": 2}},
           {"algo": "dpgd-momentum", "batch_size": 1347, "epochs": 3}, {"algo": "p-avg"},
           {"algo": "dpsgd", "grad_path": "fast"}, {"algo": "adaptive", "extra": {"count_noise": 3.2}}]


DISK_CASES = [{"algo": "disk", "momentum": 0.5}, {"algo": "disk", "grad_path": "fast", "extra": {"kappa": 0.5}},
              {"algo": "inner-outer+disk", "extra": {"K0": 1}}]
CASES = {"methods": METHODS, "disk": DISK_CASES}  # the trainings the 2 ranks run (``ranks``), by test


def _two_process_configs(ranks: str | Path, name: str) -> list[TrainConfig]:
    return [dataclasses.replace(BASE, **m, out=str(Path(ranks) / f"{name}-{i}")) for i, m in enumerate(CASES[name])]


def _train_ranks(rank: int, ranks: str) -> None:
    for name in CASES:
        out = [train(cfg, plot=False) for cfg in _two_process_configs(ranks, name)]
        torch.save([{"epsilon": r["epsilon"], "world_size": r["world_size"], "steps": r["steps"]} for r in out],
                   Path(ranks) / f"{name}.{rank}")


def _same_up_to_grid_steps(w1: dict, w2: dict, cfg: TrainConfig) -> None:
    """Two runs' weights agree to float rounding except where float summation order moved a released
    coordinate to the neighbouring point of the noise grid (spacing g = noise_grid(z C / B)): each
    weight within a few ulp or a few lr g of the other, and at most 3 % of the weights off by more
    than rounding (a flip needs the pre-noise sum within float error of a grid boundary: rare, more so
    the larger the grid; adaptive clipping's shrinking clip shrinks its grid). A mechanism difference
    (noise added twice, a wrong share) moves every weight by about lr z C / B = 256 lr g or more."""
    from clipbias.randomness import noise_grid
    step = cfg.lr * noise_grid(cfg.noise_multiplier * cfg.clip / cfg.batch_size) * (4 if cfg.algo == "adaptive" else 1)
    off = total = 0
    for k in w1:
        diff = (w1[k] - w2[k]).abs()
        assert float(diff.max()) <= 4 * step + 1e-6, f"{cfg.algo} {k}: {float(diff.max()):.2e} > 4 lr g"
        off += int((diff > 1e-5 * w1[k].abs() + 1e-6).sum())
        total += diff.numel()
    assert off <= 0.03 * total, f"{cfg.algo}: {off} of {total} weights moved by a grid step"


def _initial(cfg: TrainConfig) -> dict:
    from clipbias.run.build import build_run
    from clipbias.run.splits import splits_for
    return {k: v.clone() for k, v in build_run(dataclasses.replace(cfg, out=None), splits_for(cfg, None, None))
            .model.state_dict().items()}


def _one_and_two_processes(tmp_path, ranks: Path, name: str):
    """Each case of ``CASES[name]`` trained in this process, and as the 2 ranks of ``ranks`` trained it: (1-process
    configs, 2-process configs, 1-process results, each rank's results)."""
    torch.set_num_threads(1)
    ones = [dataclasses.replace(c, out=str(tmp_path / f"{i}-1")) for i, c in enumerate(_two_process_configs(ranks, name))]
    single = [train(c, plot=False) for c in ones]
    return ones, _two_process_configs(ranks, name), single, [torch.load(ranks / f"{name}.{r}") for r in range(2)]


def ranks_scenario(rank: int, out: str) -> None:
    """What the session's 2 ranks (conftest's ``two_ranks``, ``tests/ranks.py``) run in their process group for
    this module: the trainings (``test_two_processes_give_the_single_process_run``,
    ``test_disk_on_two_processes_...``), the failing rank and the resumed run (``test_a_failing_rank_...``), the
    sharded model (``test_fully_shard_...``)."""
    _train_ranks(rank, out)
    _nan_rank(rank, str(Path(out) / "nan"))
    _sharded_rank(rank, str(Path(out) / "fsdp"))


def ranks_before_group(rank: int, world: int, port: int, out: str) -> None:
    """First, in the fresh processes: the group of ``init_from_env`` and its threads
    (``test_destroying_the_group_ends_its_threads``)."""
    if Path("/proc/self/task").is_dir():  # (the test counts threads through /proc: Linux)
        _threads_outlive_the_group(rank, world, port, str(Path(out) / "left"))


@pytest.fixture
def ranks(two_ranks) -> Path:
    """This module's results in the session's 2 ranks (``ranks_scenario``, ``ranks_before_group``)."""
    return two_ranks / "test_distributed"


@pytest.mark.slow
def test_two_processes_give_the_single_process_run(tmp_path, ranks):
    """dpsgd, dice (error feedback), inner-outer (stored iterates, outer momentum), dpgd-momentum
    (per-example state), p-avg (group rows) and dpsgd on the fast path: the 2-process weights equal
    the 1-process ones up to float rounding and rare single steps of the noise grid
    (``_same_up_to_grid_steps``), epsilon is identical, and so is the private per-example state."""
    ones, twos, single, per_rank = _one_and_two_processes(tmp_path, ranks, "methods")
    for i, (one, two, res1) in enumerate(zip(ones, twos, single)):
        assert res1["world_size"] == 1 and all(r[i]["world_size"] == 2 for r in per_rank)
        assert all(r[i]["epsilon"] == res1["epsilon"] and r[i]["steps"] == res1["steps"] > 1 for r in per_rank)
        w1, w2 = load_checkpoint(one.out)["model"], load_checkpoint(two.out)["model"]
        _same_up_to_grid_steps(w1, w2, one)
        init = _initial(one)
        assert sum(float((w1[k] - init[k]).norm()) for k in w1) > 0.1  # trained weights, not two inits
        assert load_checkpoint(two.out)["world_size"] == 2
    buf1, buf2 = (load_checkpoint(c.out)["engine"]["pipeline"]["per_sample.0"] for c in (ones[3], twos[3]))
    assert bool(buf2["seen"].all()) and torch.equal(buf1["seen"], buf2["seen"])  # every example's buffer
    assert float((buf1["buf"] - buf2["buf"]).norm() / buf1["buf"].norm()) < 1e-5  # gathered from 2 ranks


@pytest.mark.slow
def test_disk_on_two_processes_gives_the_single_process_run(tmp_path, ranks):
    """DiSK (the previous iterate and the filter, identical on every rank) on the summed rows, on the
    fast path, and chained with inner-outer's outer momentum over stored iterates: 2 processes give the
    1-process weights up to rounding and rare grid steps, the same epsilon and the same filter state."""
    ones, twos, single, per_rank = _one_and_two_processes(tmp_path, ranks, "disk")
    for i, (one, two, res1) in enumerate(zip(ones, twos, single)):
        assert all(r[i]["epsilon"] == res1["epsilon"] and r[i]["world_size"] == 2 for r in per_rank)
        c1, c2 = load_checkpoint(one.out), load_checkpoint(two.out)
        _same_up_to_grid_steps(c1["model"], c2["model"], one)
        assert c2["engine"]["rows"]["prev"] is not None
        f1, f2 = (c["engine"]["pipeline"]["post"] for c in (c1, c2))
        g1, g2 = (f["0"]["g"] if "0" in f else f["g"] for f in (f1, f2))
        assert float((g1 - g2).norm()) <= 1e-3 * float(g1.norm())


# ---------------------------------------------------------------- a failing rank
def _nan_rank(rank: int, result: str) -> None:
    from clipbias.engine.core import DPEngine
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    n = 40
    x, y = torch.randn(n, 4), torch.arange(n) % 3
    x[1] = float("nan")  # example 1 is owned by rank 1 (1 % 2)
    eng = DPEngine(model, "dice", n=n, batch_size=n, steps=3, noise_multiplier=1.0, noise_seed=5)
    before = [p.detach().clone() for p in model.parameters()]
    ef_before = eng.pipeline.error_feedback.e
    idx = eng.local_share(torch.arange(n))
    msg = None
    try:
        eng.step(x[idx], y[idx], idx)
    except NonFiniteGradientError as e:
        msg = str(e)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    state = (eng.steps_taken, eng.pipeline.error_feedback.e is ef_before, unchanged)
    x[1] = 0.0  # the ranks are still in step: the next (good) step updates every rank alike
    eng.step(x[idx], y[idx], idx)
    torch.save({"msg": msg, "state": state, "w": [p.detach() for p in model.parameters()],
                "refused": _refusals(), "secret": _secret_streams_run()}, f"{result}.{rank}")
    _interrupted_and_resumed(Path(result).parent / "resumed")


class _Stop(Exception):
    pass


def _interrupted_and_resumed(out: Path) -> None:
    """dpgd-momentum (per-example buffers) on 2 ranks, stopped after epoch 1 of 3, resumed."""
    cfg = dataclasses.replace(RESUMED, out=str(out))

    def stop(rec: dict) -> None:
        if rec["epoch"] == 1:
            raise _Stop

    with pytest.raises(_Stop):
        train(cfg, on_epoch_end=stop, plot=False)
    train(dataclasses.replace(cfg, resume=True), plot=False)


def _secret_streams_run() -> list:
    """Weights after 3 steps with OS-CSPRNG streams (no noise seed): each rank drew its own seeds, and
    only rank 0's, broadcast, keep the ranks on one sample and one noise."""
    from clipbias.engine.core import DPEngine, run_steps
    torch.manual_seed(1)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(60, 4), torch.arange(60) % 3
    eng = DPEngine(model, "dice", n=60, batch_size=20, steps=3, noise_multiplier=1.0)
    run_steps(eng, x, y)
    return [p.detach().clone() for p in model.parameters()]


RESUMED = dataclasses.replace(BASE, algo="dpgd-momentum", batch_size=1347, epochs=3)


def test_a_failing_rank_stops_every_rank_and_unsplittable_sources_are_refused(tmp_path, ranks):
    """Also: a 2-rank run checkpointed by rank 0 (the per-example buffers gathered), stopped and
    resumed at 2 ranks, ends where one uninterrupted process ends."""
    straight = dataclasses.replace(RESUMED, out=str(tmp_path / "straight"))
    train(straight, plot=False)
    w1, w2 = load_checkpoint(straight.out)["model"], load_checkpoint(ranks / "resumed")["model"]
    _same_up_to_grid_steps(w1, w2, RESUMED)
    assert load_checkpoint(ranks / "resumed")["epoch"] == 3
    b1, b2 = (load_checkpoint(d)["engine"]["pipeline"]["per_sample.0"]["buf"] for d in (straight.out, ranks / "resumed"))
    assert float((b1 - b2).norm() / b1.norm()) < 1e-4  # each example's buffer once, after a resume too
    r0, r1 = (torch.load(ranks / f"nan.{r}") for r in range(2))
    assert r0["msg"] is not None and r0["msg"] == r1["msg"]  # rank 0's data was fine: it stops too
    assert "example(s) [1]" in r0["msg"] and "rank 1 of 2" in r0["msg"] and "nothing was updated" in r0["msg"]
    assert r0["state"] == r1["state"] == (0, True, True)
    assert all(torch.equal(a, b) for a, b in zip(r0["w"], r1["w"]))
    assert all(torch.equal(a, b) for a, b in zip(r0["secret"], r1["secret"]))  # secret seeds: one run
    assert "`algorithm='dpsgd'` cannot run on 2 processes: this source needs the whole batch" in r0["refused"]


def _refusals() -> str | None:
    """A row source that declares it cannot be split is refused by name before any work."""
    from clipbias.engine.core import DPEngine
    from clipbias.grads.rows import FuncGradients, PerExampleRows

    class WholeBatch(PerExampleRows):
        distributed_refusal = "this source needs the whole batch"

    model = torch.nn.Linear(4, 3)
    try:
        DPEngine(model, "dpsgd", n=10, batch_size=5, steps=1, noise_multiplier=1.0,
                 grads=WholeBatch(FuncGradients(model)))
    except ConfigError as e:
        return str(e)
    return None


def _threads_outlive_the_group(rank: int, world: int, port: int, result: str) -> None:
    """The group of ``init_from_env``, then an optimizer (its first build imports torch._dynamo, which
    imports torch.distributed.nn.functional), then ``destroy_process_group``: the native threads the
    group started (gloo's loop and workers) must be gone, not left to interpreter shutdown."""
    import torch.distributed as dist
    from clipbias import distributed
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    before = set(os.listdir("/proc/self/task"))
    assert distributed.init_from_env("cpu")
    torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    dist.barrier()
    dist.destroy_process_group()
    left = set(os.listdir("/proc/self/task")) - before
    names = sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in left
                   if Path(f"/proc/self/task/{t}").exists())
    Path(f"{result}.{rank}").write_text(" ".join(names))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through /proc (Linux)")
def test_destroying_the_group_ends_its_threads(ranks):
    """A group still referenced after destroy_process_group keeps gloo's threads alive into interpreter
    shutdown, where a worker freeing a late work's tensors aborts the process (a rare SIGABRT). (The ranks
    ran it first, in their fresh processes: ``ranks_before_group``.)"""
    assert [(ranks / f"left.{r}").read_text() for r in range(2)] == ["", ""]


# ---------------------------------------------------------------- the command line under torchrun
def test_torchrun_module_entry_point_and_resume_at_another_world_size(tmp_path):
    """Without --out rank 0 creates one new run directory and every rank uses it; with that --out a
    second run is refused on every rank; resuming at another world size is refused."""
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "clipbias",
           "train", "--data", "digits", "--model", "logreg", "--algo", "dice", "--noise-multiplier", "1",
           "--epochs", "1", "--batch-size", "64", "--lr", "0.5", "--seed", "1", "--reproducible-noise",
           "--quiet", "--threads", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("test accuracy") == 1  # rank 0 alone reports
    [out] = list((tmp_path / "runs").iterdir())  # one directory, shared by the ranks
    assert p.stdout.count(f"run directory: runs/{out.name}") == 1
    assert sorted(f.name for f in out.iterdir()) == ["checkpoint.pt", "curves.png", "results.json"]
    import json
    res = json.loads((out / "results.json").read_text())
    assert res["world_size"] == 2 and res["steps"] == 21
    cmd += ["--out", str(out)]
    again = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert again.returncode != 0  # rank 0 found a finished run in --out: every rank stops (none waits)
    assert again.stderr.count("clipbias train: error: --out") == 2 and "already holds" in again.stderr
    cfg = dataclasses.replace(BASE, algo="dice", model="logreg", noise_multiplier=1.0, seed=1, out=str(out),
                              resume=True)
    with pytest.raises(ResumeMismatchError, match="written by a run on 2 process"):
        train(cfg)


# ---------------------------------------------------------------- a model sharded with fully_shard (FSDP2)
def _sharded_model() -> torch.nn.Module:
    """float64 (the sums are then exact to rounding); 7 and 9 rows: shards of unequal size on 2 ranks."""
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Tanh(), torch.nn.LayerNorm(9))
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), block, torch.nn.Linear(9, 3)).double()


def _sharded_run(model: torch.nn.Module, algo: str = "dpsgd") -> tuple:
    """dpsgd with SGD momentum (RDP accounting: quick), 2 steps in micro-batches of 4 (the ranks run different numbers
    of forward and backward passes), then a step whose batch holds a NaN example (refused everywhere, nothing
    updated), then that batch without it. Returns (engine, the refusal's message, weights before it, after it)."""
    from clipbias.config import AlgoConfig
    from clipbias.engine.core import DPEngine, run_steps
    x, y = torch.randn(60, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), torch.arange(60) % 3
    eng = DPEngine(model, algo, n=60, batch_size=20, steps=3, noise_multiplier=1.0, noise_seed=5,
                   accountant="rdp", max_physical_batch=4, config=AlgoConfig(lr=0.5, clip=1.0, momentum=0.9))
    run_steps(eng, x, y, 2)
    whole = lambda: [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in model.parameters()]
    glob = eng.sampler.sample()
    bad = int(glob[glob % 2 == 1][0])  # owned by rank 1 of 2
    idx, x[bad] = eng.local_share(glob), float("nan")
    before, msg = whole(), None
    try:
        eng.step(x[idx], y[idx], idx)
    except NonFiniteGradientError as e:
        msg = str(e)
    after = whole()
    x[bad] = 0.0
    eng.step(x[idx], y[idx], idx)
    return eng, msg, before, after


_COLLECTIVES = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_gather", "all_gather_object",
                "broadcast", "broadcast_object_list", "reduce_scatter_single", "reduce_scatter_tensor", "barrier")


def _counted(run):
    """``run()``'s result, with the calls of every torch.distributed collective it made, by name, and the rounds of
    the sharded sums this rank padded with zeros (fewer micro-batches than another rank, or a failed one)."""
    import torch.distributed as dist

    from clipbias.engine.sharded import ShardedSums
    calls: dict[str, int] = {}
    padded = [0]
    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    pad, reduce = ShardedSums.pad, ShardedSums._reduce
    freed: list = []  # per all-reduce of a round this rank ran: (its last round, every unit resharded)

    def reducing(self, slot, piece, out, own=False):
        if piece is not None:
            freed.append((self.rounds + 1 == self.mine, all(g.is_sharded for g in self.groups)))
        return reduce(self, slot, piece, out, own)

    def counting(name, fn):
        def call(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        return call

    def padding(self):
        padded[0] += self.total * len(self.order) - self.calls
        return pad(self)
    try:
        for name, fn in saved.items():
            setattr(dist, name, counting(name, fn))
        ShardedSums.pad, ShardedSums._reduce = padding, reducing
        calls["freed"] = freed
        return run(), calls, padded[0]
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        ShardedSums.pad, ShardedSums._reduce = pad, reduce


def _sharded_rank(rank: int, result: str) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor
    model = _sharded_model()
    fully_shard(model[2])
    fully_shard(model)
    (eng, msg, before, after), calls, padded = _counted(lambda: _sharded_run(model))
    local = {n: (isinstance(p, DTensor), tuple(p.to_local().shape),
                 tuple(eng.optimizer.state[p]["momentum_buffer"].to_local().shape))
             for n, p in model.named_parameters()}
    held = sum(t.to_local().numel() for p in model.parameters() for t in (p, eng.optimizer.state[p]["momentum_buffer"]))
    whole = _sharded_model()
    fully_shard(whole[2])
    fully_shard(whole)
    dice = _sharded_run(whole, "dice")[0]  # error feedback: the sums and update whole on every rank
    sums = {"local_dim": eng._sharded.local_dim, "acc": eng._sharded.acc.numel(), "dim": eng.rows.layout.dim,
            "held": held, "dice": dice._sharded is None, "dice_w": [p.full_tensor() for p in whole.parameters()],
            "dice_note": dice.grad_path_note}
    refused = {}
    for name, kw, shard in [("rows", {"grad_path": "rows"}, "all"), ("p-avg", {"algo": "p-avg"}, "all"),
                            ("no root", {}, "block"), ("cast", {}, "cast"), ("layer", {}, "layer")]:
        m = _sharded_model()
        if shard in ("block", "layer"):
            fully_shard(m[2] if shard == "block" else m[0])
        if shard != "block":
            fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32 if shard == "cast" else None))
        try:
            from clipbias.engine.core import DPEngine
            DPEngine(m, kw.get("algo", "dpsgd"), n=60, batch_size=20, steps=3, noise_multiplier=1.0, noise_seed=5,
                     accountant="rdp", grad_path=kw.get("grad_path", "auto"))
        except ConfigError as e:
            refused[name] = str(e)
    torch.save({"w": [p.full_tensor() for p in model.parameters()], "epsilon": eng.privacy().epsilon, "msg": msg,
                "unchanged": all(torch.equal(a, b) for a, b in zip(before, after)), "local": local,
                "refused": refused, "steps": eng.steps_taken, "calls": calls, "padded": padded, "sums": sums},
               f"{result}.{rank}")


def test_fully_shard_gives_the_single_process_run(ranks):
    """A model sharded with fully_shard on 2 ranks (a block and the root; shards of unequal size) trains to the
    weights of the unsharded model in one process, float64, with the same epsilon: the per-example norms are
    whole, the noise is added once; parameters and optimizer state stay sharded, a NaN example on one rank
    stops both and updates nothing, and what the path cannot cover is refused by name."""
    torch.set_num_threads(1)
    model = _sharded_model()  # the one-process run
    eng, msg, before, after = _sharded_run(model)
    assert eng.steps_taken == 3 and all(torch.equal(a, b) for a, b in zip(before, after))
    init = list(_sharded_model().parameters())
    assert sum(float((p - q).detach().norm()) for p, q in zip(model.parameters(), init)) > 0.5  # trained
    for rank in range(2):
        res = torch.load(ranks / f"fsdp.{rank}")
        assert res["steps"] == 3 and res["epsilon"] == eng.privacy().epsilon
        assert max(float((a - b).detach().abs().max()) for a, b in zip(res["w"], model.parameters())) <= 1e-12
        assert res["unchanged"] and res["msg"] is not None and "rank 1 of 2" in res["msg"]
        assert msg is not None and msg.split(" [rank")[0] == res["msg"].split(" [rank")[0]
        shards = {"0.weight": (4, 5) if rank == 0 else (3, 5), "2.0.weight": (5, 7) if rank == 0 else (4, 7)}
        for name, rows in shards.items():
            assert res["local"][name] == (True, rows, rows)  # a DTensor shard, its momentum the same shard
        got = res["refused"]
        assert set(got) == {"rows", "p-avg", "no root", "cast", "layer"}
        assert "fast path only" in got["rows"] and "grad_path='rows'" in got["rows"]
        assert "fast path only" in got["p-avg"] and "p-avg" in got["p-avg"]
        assert "not itself a fully_shard module" in got["no root"]
        assert "MixedPrecisionPolicy" in got["cast"]
        assert "applied to the layer '0' (Linear) itself" in got["layer"]


def test_sharded_sums_keep_every_rank_in_step_and_shard_the_step(ranks):
    """The sharded step (dpsgd: the sums, noise and update sharded, engine/sharded.py): every rank issues the same
    collectives, as many of each, though the ranks ran different numbers of micro-batches (one padded rounds with
    zeros) and one failed a step; each rank holds its slice of the processed sum and about half of the parameters
    and momentum, and frees the gathered model before the sums of its last micro-batch. dice (error feedback) keeps the whole sums and still gives the one-process weights."""
    torch.set_num_threads(1)
    got = [torch.load(ranks / f"fsdp.{r}") for r in range(2)]
    freed = [g["calls"].pop("freed") for g in got]
    assert got[0]["calls"] == got[1]["calls"] and got[0]["calls"]["all_reduce"] > 10
    for f in freed:  # the gathered parameters freed (every unit resharded) for the sums of a rank's last round only
        assert {last for last, _ in f} == {True, False} and all(last == sharded for last, sharded in f)
    assert got[0]["padded"] + got[1]["padded"] > 0  # the shares' micro-batch counts differed in some step
    d = _sharded_model()
    whole = sum(p.numel() for p in d.parameters())
    assert sum(g["sums"]["local_dim"] for g in got) == whole == got[0]["sums"]["dim"]
    for g in got:
        assert g["sums"]["acc"] == g["sums"]["local_dim"] < 0.65 * whole  # the processed sum: this rank's slice
        assert g["sums"]["held"] < 0.65 * 2 * whole  # parameters and momentum: its shards (7 and 9 rows: 4 + 3, 5 + 4)
    assert all(g["sums"]["dice"] and "sums and update whole on every rank" in g["sums"]["dice_note"] for g in got)
    _sharded_run(d, "dice")
    for g in got:
        assert max(float((a - b).detach().abs().max()) for a, b in zip(g["sums"]["dice_w"], d.parameters())) <= 1e-12


def test_a_ranks_noise_is_its_coordinates_of_the_one_process_draw():
    """``sharded.normals_at``: the normals of coordinates start .. stop of a noise draw, the whole draw's at those
    positions (across a chunk boundary of the stream, from inside a chunk, and at its start), in pieces of at most
    ``_PIECE`` normals whatever the alignment of start and stop."""
    from clipbias.engine.sharded import _CHUNK, _PIECE, normals_at
    from clipbias.randomness import Purpose, SecretKey
    from clipbias.randomness.draws import normals
    key = SecretKey.of(7)
    whole = normals(key, Purpose.NOISE, 3, 0, _CHUNK + 1000)
    for start, stop in [(_CHUNK - 5, _CHUNK + 7), (11, 40), (0, 3), (_CHUNK, _CHUNK + 1000), (17, _PIECE + 1),
                        (_PIECE - 3, 3 * _PIECE + 5), (_CHUNK - 2 * _PIECE - 9, _CHUNK + 999)]:
        got = torch.full((stop - start,), float("nan"), dtype=torch.float64)
        for off, z in normals_at(key, 3, start, stop, "cpu"):
            assert 0 < len(z) <= _PIECE
            got[off:off + len(z)] = z
        assert torch.equal(got, whole[start:stop])
