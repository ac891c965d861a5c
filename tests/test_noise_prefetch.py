"""The noise drawn ahead (``clipbias.randomness.prefetch``, ``DPEngine(noise_prefetch=...)``): the same released bits
as the noise drawn on the critical path, step by step, across a checkpoint taken while a draw is in flight, a
failed and retried step, banded and BLT noise, the stored behaviour runs, and ranks that differ in the setting."""

from __future__ import annotations

import copy
import threading
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.errors import ConfigError, NonFiniteGradientError
from clipbias.randomness import SecretKey, normals, prefetch, snapped_gaussian
from clipbias.randomness.key import Purpose
from clipbias.randomness.prefetch import NormalsPrefetch

KEY = SecretKey.from_seed(11)
THREAD = "clipbias-noise-prefetch"


class Spy:
    """Counts the draws made ahead (``prefetch.normals`` in the worker) and the normals a release took from them;
    ``gate``: when set, a draw ahead waits for it (a draw held in flight)."""

    def __init__(self, monkeypatch) -> None:
        self.drawn, self.taken, self.gate = [], 0, None
        draw, take = prefetch.normals, NormalsPrefetch.take

        def drawing(key, purpose, step, index, count, device="cpu", **kw):
            assert threading.current_thread().name == THREAD
            self.drawn.append(step)
            if self.gate is not None:
                assert self.gate.wait(30)
            return draw(key, purpose, step, index, count, device, **kw)

        def taking(ahead, *args):
            z = take(ahead, *args)
            self.taken += z is not None
            return z
        monkeypatch.setattr(prefetch, "normals", drawing)
        monkeypatch.setattr(NormalsPrefetch, "take", taking)


def data(n: int = 120, d: int = 10):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, d, generator=g), torch.randint(0, 3, (n,), generator=g)


def engine(prefetch_on, algo="dpsgd", bands=1, strategy="taylor", n=120, seed=5, device="cpu", **kw) -> DPEngine:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 3)).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # BLT's advice on its number of classes
        return DPEngine(model, algo, n=n, batch_size=12, steps=8, noise_multiplier=1.0, noise_seed=seed, bands=bands,
                        bands_strategy=strategy, accountant="rdp", config=AlgoConfig(lr=0.3, clip=1.0, momentum=0.5),
                        noise_prefetch=prefetch_on, **kw)


def weights(eng: DPEngine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in eng.model.parameters()]


def same_state(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(u, v) for u, v in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def no_prefetch_thread() -> bool:
    return not any(t.name == THREAD for t in threading.enumerate())


def test_a_draw_made_ahead_is_the_draw_and_is_taken_only_at_its_address():
    count = 2 * (1 << 21) + 3  # three pieces of the noise stream, the last odd
    want = normals(KEY, Purpose.NOISE, 4, 0, count)
    ahead = NormalsPrefetch()
    ahead.start(KEY, Purpose.NOISE, 4, count, "cpu")
    assert ahead.take(KEY, Purpose.NOISE, 5, count, "cpu") is None  # another draw
    assert ahead.take(KEY, Purpose.NOISE, 4, count - 1, "cpu") is None
    assert ahead.take(SecretKey.from_seed(12), Purpose.NOISE, 4, count, "cpu") is None
    z = ahead.take(KEY, Purpose.NOISE, 4, count, "cpu")
    assert torch.equal(z, want)
    assert ahead.take(KEY, Purpose.NOISE, 4, count, "cpu") is None and not ahead.pending  # handed over
    x = torch.randn(count, generator=torch.Generator().manual_seed(2)) * 3
    for dtype in (torch.float64, torch.float32):
        assert torch.equal(snapped_gaussian(x, 0.37, KEY, 4, dtype=dtype, normals=want.clone()),
                           snapped_gaussian(x, 0.37, KEY, 4, dtype=dtype))
    assert not torch.equal(snapped_gaussian(x, 0.37, KEY, 4, normals=want.clone()),
                           snapped_gaussian(x, 0.37, KEY, 5))
    ahead.start(KEY, Purpose.NOISE, 5, count, "cpu")  # the next draw, into the same vector
    again = ahead.take(KEY, Purpose.NOISE, 5, count, "cpu")
    assert again.data_ptr() == z.data_ptr() and torch.equal(again, normals(KEY, Purpose.NOISE, 5, 0, count))
    with pytest.raises(ValueError, match="float64"):
        snapped_gaussian(x, 0.37, KEY, 5, normals=again.float())
    ahead.start(KEY, Purpose.NOISE, 6, count, "cpu")
    ahead.clear()
    assert not ahead.pending and ahead.take(KEY, Purpose.NOISE, 6, count, "cpu") is None and no_prefetch_thread()


CASES = [dict(), dict(bands=3), dict(bands=4, strategy="optimized"), dict(bands=4, strategy="blt"), dict(algo="dice"),
         dict(algo="adaptive"), dict(grad_path="fast")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c.values()) or "dpsgd")
def test_updates_are_bit_identical_with_and_without_the_draws_made_ahead(case, monkeypatch):
    """Every step's parameters, then the whole private state (the noise's draw counter, the banded noise's
    past inputs and outputs, BLT's sums, the feedback buffer): the same bits. The engine drew every step's
    normals ahead, in the background thread, and took them; none outlives its step."""
    x, y = data()
    spy = Spy(monkeypatch)
    on, off = engine(True, **case), engine(False, **case)
    for step in range(6):
        for eng in (on, off):
            idx = eng.sampler.sample()
            eng.step(x[idx], y[idx], idx)
            assert no_prefetch_thread() and not eng.pipeline.noise._ahead.pending
        assert all(torch.equal(a, b) for a, b in zip(weights(on), weights(off))), f"step {step}"
    assert same_state(on.state_dict(), off.state_dict())
    assert spy.drawn == list(range(6)) and spy.taken == 6  # the engine with noise_prefetch=False drew none ahead


@pytest.mark.parametrize("case", [dict(), dict(bands=4, strategy="blt"), dict(bands=3)], ids=["dpsgd", "blt", "bands"])
def test_a_checkpoint_taken_while_a_draw_is_in_flight_resumes_to_the_same_bits(case, monkeypatch):
    """A checkpoint taken during step 4, while that step's normals are being drawn ahead (held in flight),
    neither consumes nor skips a draw: the run that took it and a run resumed from it (with the draws made
    ahead or not) end with the bits of a run that took no checkpoint."""
    x, y = data()

    def steps(eng, k):
        for _ in range(k):
            idx = eng.sampler.sample()
            eng.step(x[idx], y[idx], idx)

    plain = engine(False, **case)
    steps(plain, 6)
    spy = Spy(monkeypatch)
    spy.gate = threading.Event()
    eng = engine(True, **case)
    spy.gate.set()
    steps(eng, 3)
    spy.gate.clear()
    saved = {"model": copy.deepcopy(eng.model.state_dict())}  # the weights change only as the step ends

    def hook(module, args):
        if "engine" not in saved:
            assert eng.pipeline.noise._ahead.pending and not spy.gate.is_set()  # the draw is in flight
            saved["engine"] = copy.deepcopy(eng.state_dict())
            spy.gate.set()
    handle = eng.model.register_forward_pre_hook(hook)
    steps(eng, 1)
    handle.remove()
    assert saved["engine"]["steps_taken"] == 3 and saved["engine"]["pipeline"]["noise"]["draws"] == 3
    steps(eng, 2)
    assert all(torch.equal(a, b) for a, b in zip(weights(eng), weights(plain)))
    for again in (False, True):
        resumed = engine(again, **case)
        resumed.model.load_state_dict(saved["model"])
        resumed.load_state_dict(copy.deepcopy(saved["engine"]))
        steps(resumed, 3)
        assert all(torch.equal(a, b) for a, b in zip(weights(resumed), weights(plain))), f"resumed, prefetch {again}"
        assert same_state(resumed.state_dict()["pipeline"], plain.state_dict()["pipeline"])
    assert spy.drawn == [0, 1, 2, 3, 4, 5, 3, 4, 5]  # the resumed run with draws ahead asks for draws 3, 4, 5


def test_a_failed_step_keeps_its_draw_for_the_retry(monkeypatch):
    """A step refused for a NaN gradient (after its normals started) leaves no thread and keeps the draw; the
    retry takes it (drawn once), and the run ends with the bits of a run that never failed."""
    x, y = data()
    spy = Spy(monkeypatch)
    plain, eng = engine(False, algo="dice"), engine(True, algo="dice")
    warnings.filterwarnings("ignore", message="DPEngine.step got a batch")  # fixed batches, not the sampler's
    for step in range(4):
        idx = torch.arange(12 * step, 12 * step + 12)
        if step == 2:
            bad = x[idx].clone()
            bad[0, 0] = float("nan")
            with pytest.raises(NonFiniteGradientError):
                eng.step(bad, y[idx], idx)
            assert no_prefetch_thread() and eng.pipeline.noise._ahead.pending and eng.steps_taken == 2
        eng.step(x[idx], y[idx], idx)
        plain.step(x[idx], y[idx], idx)
    assert all(torch.equal(a, b) for a, b in zip(weights(eng), weights(plain)))
    assert same_state(eng.state_dict()["pipeline"], plain.state_dict()["pipeline"])
    assert spy.drawn == [0, 1, 2, 3] and spy.taken == 4


def test_a_copy_of_the_noise_stage_holds_no_draw_and_turning_it_off_frees_the_buffer():
    stage = engine(True).pipeline.noise
    stage.draw_ahead(1000, "cpu")
    twin = copy.deepcopy(stage)
    assert stage._ahead.pending and not twin._ahead.pending and twin.draws == stage.draws
    stage.commit()
    assert not stage._ahead.pending and stage._ahead._buffer is not None  # kept for the next draw
    stage.prefetch = False
    stage.draw_ahead(1000, "cpu")
    assert not stage._ahead.pending and stage._ahead._buffer is None


def test_the_setting(monkeypatch):
    """Off by default (measured slower on the 2-core CPU: ``prefetch.DEFAULT``), on where asked for."""
    assert prefetch.wanted(True) and not prefetch.wanted(False) and not prefetch.wanted(None)
    monkeypatch.setattr(prefetch, "DEFAULT", True)
    assert prefetch.wanted(None) and not prefetch.wanted(False)
    with pytest.raises(ConfigError, match="noise_prefetch"):
        engine("yes")
    assert engine(None).pipeline.noise.prefetch is None


@pytest.mark.parametrize("algo", ["dpsgd", "dice", "adaptive", "disk"])
def test_the_stored_runs_give_the_same_bits_with_every_draw_made_ahead(algo, monkeypatch):
    """``tests/test_behaviour.py``'s fixed-seed runs (``clipbias train``'s path) with the default setting made to draw
    every release's normals ahead: the stored numbers (on their machine bit for bit: results, final weights, private
    engine state)."""
    from tests.behaviour import fingerprint, numbers
    from tests.test_behaviour import GOLDEN, close, summaries_close
    monkeypatch.setattr(prefetch, "DEFAULT", True)
    spy = Spy(monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the stored numbers were computed with one thread
    try:
        got, want = numbers(algo), GOLDEN["cases"][algo]
    finally:
        torch.set_num_threads(threads)
    assert spy.taken > 0 and spy.taken == len(spy.drawn)
    assert got["engine_exact"] == want["engine_exact"]
    assert close(got["results"], want["results"])
    assert summaries_close(got["model_summary"], want["model_summary"])
    assert summaries_close(got["engine_floats"], want["engine_floats"])
    if want.get("fingerprint", GOLDEN["fingerprint"]) == fingerprint():
        assert got["results"] == want["results"] and got["model"] == want["model"] and got["engine"] == want["engine"]


# ---------------------------------------------------------------- two ranks, one drawing ahead and one not
def ranks_scenario(rank: int, out: str) -> None:
    """Rank 0 draws its noise ahead, rank 1 does not: the same 4 updates on both (``tests/ranks.py``)."""
    from clipbias.engine.loop import run_steps
    taken = []
    take = NormalsPrefetch.take

    def taking(ahead, *args):
        z = take(ahead, *args)
        taken.append(z is not None)
        return z
    NormalsPrefetch.take = taking
    try:
        eng = engine(rank == 0, seed=7)
        x, y = data()
        run_steps(eng, x, y, 4)
    finally:
        NormalsPrefetch.take = take
    torch.save({"w": weights(eng), "taken": taken, "steps": eng.steps_taken, "world": eng.world_size},
               Path(out) / f"w.{rank}")


def test_ranks_drawing_ahead_or_not_release_the_same_updates(two_ranks):
    got = [torch.load(two_ranks / "test_noise_prefetch" / f"w.{r}") for r in range(2)]
    assert [g["steps"] for g in got] == [4, 4] and [g["world"] for g in got] == [2, 2]
    assert got[0]["taken"] == [True] * 4 and got[1]["taken"] == []
    assert all(torch.equal(a, b) for a, b in zip(got[0]["w"], got[1]["w"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_side_stream_gives_the_same_bits(monkeypatch):
    """On a GPU the draw ahead runs on a side stream in the thread; large enough for the device keystream."""
    x = torch.randn(300_001, device="cuda", dtype=torch.float64)
    ahead = NormalsPrefetch()
    ahead.start(KEY, Purpose.NOISE, 2, x.numel(), x.device)
    z = ahead.take(KEY, Purpose.NOISE, 2, x.numel(), x.device)
    assert z is not None and torch.equal(z, normals(KEY, Purpose.NOISE, 2, 0, x.numel(), "cuda"))
    assert torch.equal(snapped_gaussian(x, 0.5, KEY, 2, normals=z), snapped_gaussian(x, 0.5, KEY, 2))
    ahead.clear()
    xs, ys = data()
    spy = Spy(monkeypatch)
    on, off = engine(True, device="cuda"), engine(False, device="cuda")
    for _ in range(3):
        for eng in (on, off):
            idx = eng.sampler.sample()
            eng.step(xs[idx].cuda(), ys[idx].cuda(), idx)
    assert all(torch.equal(a, b) for a, b in zip(weights(on), weights(off)))
    assert spy.drawn == [0, 1, 2] and spy.taken == 3
