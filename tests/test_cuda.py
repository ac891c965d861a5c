"""CUDA: every algorithm makes the same update on the GPU as on the CPU, the GPU noise and
perturbation have the stated scale, empty batches work there, a CUDA run checkpoints and resumes
exactly, and the diagnostics record the same numbers from GPU gradients.

Skipped where torch sees no CUDA device (CI is CPU-only). On a GPU machine:
``python -m pytest tests/test_cuda.py``. TF32 is switched off here so that the GPU computes the same
float32 arithmetic as the CPU and the comparisons can be tight (training itself leaves torch's
defaults alone: TF32 changes the gradients' rounding, never the clipping bound or the noise).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn

from clipbias.analysis import diagnostics
from clipbias.config import AlgoConfig
from clipbias.cli import main
from clipbias.engine.core import SEEDED_CAVEAT, DPEngine
from clipbias.grads.rows import FuncGradients
from clipbias.algorithms import batchnorm_variant
from clipbias.randomness import Purpose, SecretKey, keyed_normal, normals, snapped_gaussian
from clipbias.randomness.chacha import chacha20_words, keystream, words_of
from clipbias.models import build_model
from clipbias.run.training import TrainConfig, load_checkpoint, prepare_splits, train
from tests.interrupt import interrupt_after_first_epoch

from test_methods import CLASSES, D_IN, N, tiny_cnn  # the same tiny model and data shape

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def exact_float32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def params_of(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().cpu() for p in model.parameters() if p.requires_grad])


ALGOS = [("dpsgd", {}), ("normalized", {}), ("dice", {}), ("dice-adam", {}), ("dice-auto", {}),
         ("perturb", {"k": 0.5}), ("self-aug", {"K": 2}), ("inner-outer", {"K0": 2}), ("p-avg", {"p": 2}),
         ("batch-clip", {"p": 3}), ("dpgd-momentum", {}), ("dice-perturb", {"k": 0.5}),
         ("dice-self-aug", {"K": 2})]


def _run(algo: str, extra: dict, device: torch.device, steps: int = 3) -> torch.Tensor:
    """``steps`` engine steps on ``device`` on the rows path (``auto`` would take the fast path for this
    model: its float64 sums round differently from the rows path's float32 ones, which can move a
    release by one grid step), noise included: the secret draws are ChaCha20 keystream on either
    device, so the noise and the perturbations are the same numbers on the CPU and on CUDA (up to the
    last bits of float64 log/cos; the release grid absorbs them)."""
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(N, 1, D_IN, D_IN, generator=g)).to(device)  # large gradients: clipping binds
    y = torch.randint(0, CLASSES, (N,), generator=g).to(device)
    model = tiny_cnn()
    if algo == "batch-clip":
        model = batchnorm_variant(model)
        extra = {**extra, "public": torch.randn(6, 1, D_IN, D_IN, generator=g).to(device)}
    model = model.to(device)
    bs = float(N) if algo == "dpgd-momentum" else 8.0
    eng = DPEngine(model, algo, n=N, batch_size=bs, steps=steps, noise_multiplier=5.0, accountant="rdp",
                   dice_accounting="conservative", noise_seed=0, max_physical_batch=5, grad_path="rows",
                   config=AlgoConfig(lr=0.1, clip=0.5, extra=extra))
    for _ in range(steps):
        idx = eng.sampler.sample()
        eng.step(x[idx.to(device)], y[idx.to(device)], idx)
    return params_of(model)


@pytest.mark.parametrize("algo,extra", ALGOS, ids=[a for a, _ in ALGOS])
def test_every_algorithm_makes_the_cpu_update_on_cuda(algo, extra):
    before = params_of(tiny_cnn())
    cpu, gpu = _run(algo, extra, torch.device("cpu")), _run(algo, extra, CUDA)
    assert not torch.equal(cpu, before)
    assert torch.allclose(cpu, gpu, rtol=1e-4, atol=1e-5), float((cpu - gpu).abs().max())


def test_gpu_noise_has_the_stated_scale_and_an_empty_batch_is_noise_only():
    """An empty Poisson batch: the update is the noise alone, std z C / B per coordinate, drawn on the GPU."""
    torch.manual_seed(0)
    model = nn.Linear(200, 50).to(CUDA)
    z, c, b, lr = 2.0, 0.5, 8.0, 1.0
    eng = DPEngine(model, "dpsgd", n=100, batch_size=b, steps=4, noise_multiplier=z, accountant="rdp",
                   noise_seed=0, config=AlgoConfig(lr=lr, clip=c))
    before = params_of(model)
    empty = torch.zeros(0, 200, device=CUDA), torch.zeros(0, dtype=torch.long, device=CUDA)
    losses = eng.step(*empty, torch.zeros(0, dtype=torch.long))
    assert losses.numel() == 0 and eng.steps_taken == 1
    w = (params_of(model) - before) / -lr
    assert w.numel() == 10050
    assert float(w.mean()) == pytest.approx(0.0, abs=4 * z * c / b / w.numel() ** 0.5)
    assert float(w.std()) == pytest.approx(z * c / b, rel=0.03)


def test_gpu_perturbation_is_keyed_and_standard_normal():
    """On CUDA zeta_i is a pure function of (key, step, example), N(0, 1) in every coordinate, and the
    same numbers as on the CPU (to float64 rounding of log and cos)."""
    key = SecretKey.from_seed(3)
    a = keyed_normal(key, Purpose.PERTURB, 5, list(range(64)), 4000, CUDA, torch.float64)
    assert a.device.type == "cuda"
    assert torch.equal(a[10:], keyed_normal(key, Purpose.PERTURB, 5, list(range(10, 64)), 4000, CUDA, torch.float64))
    assert not torch.equal(a, keyed_normal(key, Purpose.PERTURB, 6, list(range(64)), 4000, CUDA, torch.float64))
    assert torch.allclose(a.cpu(), keyed_normal(key, Purpose.PERTURB, 5, list(range(64)), 4000, "cpu", torch.float64),
                          rtol=1e-12, atol=1e-12)
    assert abs(float(a.mean())) < 4 / (a.numel() ** 0.5)
    assert float(a.var()) == pytest.approx(1.0, rel=0.01)


def test_gpu_keystream_and_noise_equal_the_cpu_ones():
    """The torch ChaCha20 on CUDA gives OpenSSL's words; large draws use it on the device; the
    snapped release is bit-identical to the CPU's."""
    key, nonce = bytes(range(32)), bytes(range(12))
    assert torch.equal(chacha20_words(key, nonce, 4096, 7, CUDA).cpu(),
                       torch.from_numpy(words_of(keystream(key, nonce, 64 * 4096, 7)).astype("int64")))
    k, n = SecretKey.from_seed(11), (1 << 22) + 3  # two whole chunks in one torch call, then a partial one
    gpu, cpu = normals(k, Purpose.NOISE, 4, 0, n, CUDA), normals(k, Purpose.NOISE, 4, 0, n)
    assert torch.allclose(gpu.cpu(), cpu, rtol=1e-12, atol=1e-12)
    x = torch.linspace(-3, 3, n, dtype=torch.float64)
    assert torch.equal(snapped_gaussian(x.to(CUDA), 0.25, k, 4).cpu(), snapped_gaussian(x, 0.25, k, 4))


@pytest.mark.parametrize("blocks,counter", [(1, 0), (257, 12345), (4096, 7), (300, (1 << 32) - 300),
                                            (513, (1 << 31) - 7)])
def test_triton_and_torch_keystreams_on_cuda_equal_openssl(blocks, counter):
    """Both GPU ChaCha20 kernels give OpenSSL's words: partial programs, a counter that crosses 2^31
    (the int32 sign bit) and the last blocks of the 32-bit counter."""
    pytest.importorskip("triton")
    key, nonce = bytes(range(32)), bytes(range(100, 112))
    want = torch.from_numpy(words_of(keystream(key, nonce, 64 * blocks, counter)).astype("int64"))
    for kernel in ("triton", "torch"):
        assert torch.equal(chacha20_words(key, nonce, blocks, counter, CUDA, kernel=kernel).cpu(), want), kernel


def test_gpu_noise_stream_round_trips_through_state_dict():
    model = nn.Linear(30, 4).to(CUDA)
    eng = DPEngine(model, "dpsgd", n=100, batch_size=8.0, steps=4, noise_multiplier=1.0, accountant="rdp",
                   config=AlgoConfig(lr=1.0, clip=1.0))
    state = eng.pipeline.state_dict()
    v = torch.zeros(124, device=CUDA)
    first = eng.pipeline.noise(v)
    eng.pipeline.load_state_dict(state)
    assert torch.equal(first, eng.pipeline.noise(v))


@pytest.mark.parametrize("name", ["cnn-gn", "resnet20-enhanced", "gru-norm"])
def test_per_example_gradients_agree_with_the_cpu(name):
    torch.manual_seed(0)
    model = build_model(name, (1, 28, 28), 10)
    x, y = torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,))
    g_cpu, l_cpu = FuncGradients(model)(x, y)
    g_gpu, l_gpu = FuncGradients(model.to(CUDA))(x.to(CUDA), y.to(CUDA))
    assert torch.allclose(l_cpu, l_gpu.cpu(), rtol=1e-4, atol=1e-5)
    assert torch.allclose(g_cpu, g_gpu.cpu(), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("layer, shape", [
    (nn.Conv2d(3, 5, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2)), (6, 3, 9, 8)),
    (nn.Conv2d(1, 16, 8, stride=2, padding=3), (4, 1, 28, 28)),
    (nn.Conv1d(4, 6, 3, stride=3, padding=2, dilation=2), (5, 4, 17)),
])
def test_every_conv_kernel_on_cuda_equals_the_cpu(layer, shape):
    """The fast path's three per-example conv kernels (cuDNN's grouped weight gradient, a dilated
    forward convolution, im2col) give the CPU's im2col result on the GPU, in float64."""
    from clipbias.grads.conv_rows import KERNELS
    layer = layer.double()
    a = torch.randn(*shape, dtype=torch.float64)
    g = torch.randn_like(layer(a))
    want = KERNELS["unfold"](layer, a, g)
    layer = layer.to(CUDA)
    for name, kernel in KERNELS.items():
        got = kernel(layer, a.to(CUDA), g.to(CUDA)).cpu()
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), name


@pytest.mark.parametrize("name,batch_size", [("cnn", 256), ("resnet20-gn", 64), ("resnet20-gn", 400)])
def test_auto_takes_the_fast_path_for_proven_conv_models_on_cuda(name, batch_size):
    """On a GPU the fast path was the faster for the proven convolutional models at every batch
    measured, past the formed budget too (on the CPU resnet20-gn at B = 400 stays on rows)."""
    e = DPEngine(build_model(name, (1, 28, 28), 10).to(CUDA), "dpsgd",
                 n=5000, batch_size=batch_size, steps=10, noise_multiplier=1.0, grad_path="auto")
    assert e.fast is not None and e.grad_path_note.startswith("fast")


def _fast_run(device: torch.device, algo: str, make_model, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Three fast-path steps of ``make_model()`` on ``device`` (the same batches and keyed noise on either device)."""
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(N, 1, D_IN, D_IN, generator=g)).to(device, dtype)
    y = torch.randint(0, CLASSES, (N,), generator=g).to(device)
    model = make_model().to(device, dtype)
    eng = DPEngine(model, algo, n=N, batch_size=8.0, steps=3, noise_multiplier=5.0, accountant="rdp",
                   noise_seed=0, grad_path="fast", config=AlgoConfig(lr=0.1, clip=0.5))
    for _ in range(3):
        idx = eng.sampler.sample()
        eng.step(x[idx.to(device)], y[idx.to(device)], idx)
    return params_of(model)


@pytest.mark.parametrize("algo", ["dpsgd", "dice"])
def test_fast_path_update_on_cuda_equals_the_cpu(algo):
    """The book-keeping fast path (kernel choice, probes, float64 bounds) makes the CPU's update on the GPU."""
    assert torch.allclose(_fast_run(CUDA, algo, tiny_cnn), _fast_run(torch.device("cpu"), algo, tiny_cnn),
                          rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("algo", ["dpsgd", "dice"])
def test_the_ghost_norm_on_cuda_makes_the_cpu_update(algo, monkeypatch):
    """Past the formed budget (where ``auto`` now sends a GPU's convolutional layers at large batches)
    a layer takes the ghost norm, its rounding bound and float64 sums: in float64 the GPU's update is
    the CPU's to 1e-10."""
    import clipbias.grads.fast as fc
    from clipbias.grads.layers.linear import Matrix
    monkeypatch.setattr(fc, "FORMED_BYTES", -1)
    ghosts = []
    init = Matrix.__init__

    def spy(self, m, a, g, ghost):
        init(self, m, a, g, ghost)
        ghosts.append(self.ghost)
    monkeypatch.setattr(Matrix, "__init__", spy)

    def wide():  # the second convolution: 4 positions, o k = 16 x 72, so the ghost norm is the cheaper
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 8, 3), nn.Tanh(), nn.Conv2d(8, 16, 3), nn.Tanh(), nn.Flatten(),
                             nn.Linear(16 * (D_IN - 4) ** 2, CLASSES))
    gpu = _fast_run(CUDA, algo, wide, torch.float64)
    assert any(ghosts)
    cpu = _fast_run(torch.device("cpu"), algo, wide, torch.float64)
    assert torch.allclose(gpu, cpu, rtol=1e-10, atol=1e-12), float((gpu - cpu).abs().max())


@pytest.mark.parametrize("b", [2, 8])
def test_fast_path_probe_refuses_a_one_example_mixing_on_cuda(b):
    """The probe's ``vmap``ped batches of one on the GPU: a model that shifts every row when the batch
    holds a canary is refused at every step, whichever examples the probe draws."""
    from clipbias.errors import ConfigError
    from clipbias.grads.fast import BookKeeping
    from clipbias.step import clip_scale
    from test_fastclip import _Canary, _canary_batch
    torch.manual_seed(0)
    m, (x, y) = _Canary().to(CUDA), _canary_batch(b)
    bk = BookKeeping(m)
    for _ in range(20):
        with pytest.raises(ConfigError, match="lets examples see each other"):
            bk(x.to(CUDA), y.to(CUDA), lambda n: clip_scale(n, 1.0), False)


def test_banded_noise_on_cuda_makes_the_cpu_update():
    """``--bands``: the classes, the banded releases and their inverse give the CPU's weights on the GPU."""
    def run(device):
        g = torch.Generator().manual_seed(1)
        x = (3 * torch.randn(N, 1, D_IN, D_IN, generator=g)).to(device)
        y = torch.randint(0, CLASSES, (N,), generator=g).to(device)
        model = tiny_cnn().to(device)
        eng = DPEngine(model, "dpsgd", n=N, batch_size=4.0, steps=6, noise_multiplier=2.0, accountant="rdp",
                       noise_seed=0, bands=3, config=AlgoConfig(lr=0.1, clip=0.5, momentum=0.9))
        for _ in range(6):
            idx = eng.sampler.sample()
            eng.step(x[idx.to(device)], y[idx.to(device)], idx)
        return params_of(model)
    assert torch.allclose(run(CUDA), run(torch.device("cpu")), rtol=1e-4, atol=1e-5)


BASE = TrainConfig(data="digits", model="mlp", algo="dice", epsilon=3.0, delta=1e-5, epochs=3,
                   batch_size=64, lr=0.5, clip=1.0, ef_clip=1.0 / 64, accountant="rdp", device="cuda",
                   reproducible_noise=True)



def test_cuda_run_interrupted_and_resumed_equals_uninterrupted(tmp_path):
    """The checkpoint is written on the CPU and read back onto the GPU (error feedback, noise stream)."""
    splits = prepare_splits(BASE)
    assert splits.x_train.device.type == "cuda"
    full = train(dataclasses.replace(BASE, out=str(tmp_path / "a")), splits=splits)
    # seeded noise (so that two runs can be compared) is never certified; the epsilon is still computed
    assert full["certified"] is False and full["caveats"] == [SEEDED_CAVEAT]
    assert 0 < full["epsilon"] <= 3  # (DiceSGD's sound bound needs z = 22.6 here: ~12 % accuracy, on the CPU too)

    cfg_b = dataclasses.replace(BASE, out=str(tmp_path / "b"))
    interrupt_after_first_epoch(cfg_b, splits)
    resumed = train(dataclasses.replace(cfg_b, resume=True), splits=splits)
    a, b = load_checkpoint(tmp_path / "a"), load_checkpoint(tmp_path / "b")
    for k in a["model"]:
        assert torch.allclose(a["model"][k], b["model"][k], rtol=0, atol=1e-6), k
    ea = [s["e"] for s in a["engine"]["pipeline"].values() if "e" in s][0]
    eb = [s["e"] for s in b["engine"]["pipeline"].values() if "e" in s][0]
    assert ea.device.type == "cpu" and torch.allclose(ea, eb, rtol=0, atol=1e-6)
    assert resumed["epsilon"] == full["epsilon"]
    assert resumed["test_accuracy"] == pytest.approx(full["test_accuracy"], abs=1e-3)


def test_instruments_on_gpu_rows_equal_the_cpu_ones():
    g = torch.randn(40, 300, generator=torch.Generator().manual_seed(0))
    ref = g.mean(0) + 0.1
    cpu = diagnostics.strip_arrays(diagnostics.instruments(g, 1.0, ref, projections=3, seed=1))
    gpu = diagnostics.strip_arrays(diagnostics.instruments(g.to(CUDA), 1.0, ref.to(CUDA), projections=3, seed=1))
    assert gpu == cpu


def test_diagnose_cli_on_cuda(tmp_path, capsys):
    out = tmp_path / "diag"
    rc = main(["diagnose", "--data", "digits", "--model", "mlp", "--algo", "dpsgd", "--epsilon", "3",
               "--epochs", "1", "--batch-size", "50", "--lr", "0.5", "--subset", "200", "--record-size", "60",
               "--reference-size", "200", "--track-size", "8", "--track-reference-size", "50",
               "--steps-at", "0,end", "--projections", "4", "--device", "cuda", "--out", str(out), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    res = json.loads((out / "diagnostics.json").read_text())
    assert [r["step"] for r in res["records"]] == [0, 4]
    assert res["noise_correlation"]["iterations"] == 4
    assert (out / "projections.png").stat().st_size > 5000


@pytest.mark.parametrize("path", ["rows", "fast"])
def test_clipped_sums_are_full_float32_under_tf32(path):
    """With TF32 allowed for matrix products (what ``torch.set_float32_matmul_precision("high")``
    does on a GPU) the clipped sum ``s @ rows`` would round each row to 10 bits before its factor.
    Rows path: the rows themselves may be TF32 products (their norms are taken from the same rows),
    but one example's contribution must be exactly its row times its factor (to float32 rounding;
    TF32 errs by ~1e-4). Fast path: its forward, backward and sums run at full float32, so the
    contribution is the float64 clipped gradient to float32 accuracy."""
    from clipbias.grads.rows import FuncGradients, ParamSums
    from clipbias.grads.fast import BookKeeping
    from clipbias.step import clip_scale
    torch.manual_seed(0)
    model = nn.Linear(256, 512).to(CUDA)
    x, y = torch.randn(1, 256, device=CUDA), torch.tensor([3], device=CUDA)
    fg = FuncGradients(model)
    agg = ParamSums(fg) if path == "rows" else BookKeeping(model)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        got, _, _, norms = agg(x, y, lambda n: clip_scale(n, 0.5), False)
        assert torch.backends.cuda.matmul.allow_tf32  # restored
        rows, _ = fg.per_param(x, y)  # the same (TF32) rows the rows path summed
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    if path == "rows":
        row = torch.cat([r.reshape(-1) for r in rows])
        want = (row * clip_scale(norms, 0.5).to(row.dtype)).double().cpu()
    else:
        m64 = nn.Linear(256, 512).double()
        m64.load_state_dict({k: v.double().cpu() for k, v in model.state_dict().items()})
        nn.functional.cross_entropy(m64(x.double().cpu()), y.cpu()).backward()
        want = torch.cat([m64.weight.grad.flatten(), m64.bias.grad.flatten()])
        want = want * min(1.0, 0.5 / float(want.norm()))
    assert float((got.double().cpu() - want).norm() / want.norm()) < 1e-5
    assert float(got.double().norm()) <= 0.5 * (1 + 1e-6)


@pytest.mark.parametrize("strategy", ["taylor", "blt"])
def test_correlated_noise_on_cuda_makes_the_cpu_update_and_resumes_from_a_cpu_state(strategy):
    """Banded and BLT noise: the same weights on the GPU as on the CPU, and a state saved to the CPU
    (as ``clipbias train`` writes it) resumes on the GPU to the uninterrupted run's weights."""
    def run(device, resume_after=None):
        g = torch.Generator().manual_seed(1)
        x = (3 * torch.randn(N, 1, D_IN, D_IN, generator=g)).to(device)
        y = torch.randint(0, CLASSES, (N,), generator=g).to(device)

        def engine(model):
            return DPEngine(model, "dpsgd", n=N, batch_size=4.0, steps=8, noise_multiplier=2.0, accountant="rdp",
                            noise_seed=0, bands=3, bands_strategy=strategy,
                            config=AlgoConfig(lr=0.1, clip=0.5, momentum=0.9))
        torch.manual_seed(0)
        model = tiny_cnn().to(device)
        eng = engine(model)
        for t in range(8):
            if t == resume_after:
                state = {k: v for k, v in eng.state_dict().items()}
                state = torch.utils._pytree.tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, state)
                fresh = tiny_cnn().to(device)
                fresh.load_state_dict(model.state_dict())
                eng, model = engine(fresh), fresh
                eng.load_state_dict(state)
            idx = eng.sampler.sample()
            eng.step(x[idx.to(device)], y[idx.to(device)], idx)
        return params_of(model)
    cpu = run(torch.device("cpu"))
    assert torch.allclose(run(CUDA), cpu, rtol=1e-4, atol=1e-5)
    assert torch.allclose(run(CUDA, resume_after=4), cpu, rtol=1e-4, atol=1e-5)
