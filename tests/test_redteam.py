"""Red-team regressions: ways a training loop or a model made a run report ``certified: true`` while its
per-example sensitivity exceeded C or its randomness was public (benchmarks/redteam/integrations/ measures each)."""

from __future__ import annotations

import importlib.util
import pathlib
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import clipbias
from clipbias.config import AlgoConfig
from clipbias.engine import DPEngine
from clipbias.errors import ConfigError

D = 4


def _linear():
    m = nn.Linear(D, 1, bias=False)
    nn.init.zeros_(m.weight)
    return m


def _private(model, x, y, **kw):
    pe = clipbias.PrivacyEngine()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    m, o, l = pe.make_private(module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
                              noise_multiplier=1.0, max_grad_norm=1.0, criterion=lambda out, t: out.sum(), **kw)
    return pe, m, o, l


def _one_step(pe, loader, body):
    for xb, yb in loader:
        if len(xb):
            body(xb, yb)
            return pe.privacy_report()


def test_a_batch_mixed_in_place_in_the_loop_is_not_the_batch_as_drawn():
    """benchmarks/redteam/integrations/a1_inplace_mix.py: x.add_(x.mean(0)) mutates the drawn tensor itself, so comparing the model's
    input with the drawn batch compared it with itself (16 C between neighbours, certified)."""
    pe, model, opt, loader = _private(_linear(), torch.randn(32, D), torch.zeros(32, dtype=torch.long))

    def body(xb, yb):
        xb.add_(xb.mean(0, keepdim=True))
        model(xb).sum().backward()
        opt.step()
    assert not _one_step(pe, loader, body).certified


def test_a_batch_mixed_in_place_after_the_forward_is_not_the_batch_as_drawn():
    pe, model, opt, loader = _private(_linear(), torch.randn(32, D), torch.zeros(32, dtype=torch.long))

    def body(xb, yb):
        model(xb).sum().backward()
        xb.add_(xb.mean(0, keepdim=True))  # the engine reads the recorded (mutated) tensor at step()
        opt.step()
    assert not _one_step(pe, loader, body).certified


class _WithLabels(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = _linear()

    def forward(self, x, labels=None):
        return self.lin(x)


def test_labels_rewritten_in_the_loop_are_not_the_batch_as_drawn():
    """benchmarks/redteam/integrations/a2_labels_kwarg.py: model(x=..., labels=...) takes the targets from the keyword, which was not
    compared with the drawn batch (every example given the target's label: 16 C, certified)."""
    pe, model, opt, loader = _private(_WithLabels(), torch.randn(32, D), torch.randint(0, 3, (32,)))

    def body(xb, yb):
        model(x=xb, labels=yb.max().expand_as(yb).clone()).sum().backward()
        opt.step()
    assert not _one_step(pe, loader, body).certified


def test_a_sub_unit_perturbation_of_an_integer_batch_is_not_a_cast():
    """benchmarks/redteam/integrations/a4_cast_truncation.py: the model's float input was cast (truncated) to the drawn uint8 dtype
    before the comparison, so x.float() + delta with 0 <= delta < 1 (from other examples) passed."""
    x = torch.randint(0, 255, (32, D), dtype=torch.uint8)
    pe, model, opt, loader = _private(_linear(), x, torch.zeros(32, dtype=torch.long))

    def body(xb, yb):
        xf = xb.float()
        model(xf + 0.5 * torch.sigmoid(xf.mean())).sum().backward()
        opt.step()
    assert not _one_step(pe, loader, body).certified
    pe2, model2, opt2, loader2 = _private(_linear(), x, torch.zeros(32, dtype=torch.long))
    assert _one_step(pe2, loader2, lambda xb, yb: (model2(xb.float()).sum().backward(), opt2.step())).certified


class _Running(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = _linear()
        self.register_buffer("running", torch.zeros(D))

    def forward(self, x):
        if self.training:
            self.running = 0.9 * self.running + 0.1 * x.mean(0)  # reassigned, not updated in place
        return self.lin(x - self.running)


def test_a_forward_that_reassigns_a_buffer_is_refused_and_restored():
    """benchmarks/redteam/integrations/a3_buffers.py: `self.running = 0.9 * self.running + ...` replaces the buffer object, whose
    version counter the check read, so the private batch's mean reached the released state_dict, noise-free."""
    net = _Running()
    pe, model, opt, loader = _private(net, torch.randn(32, D), torch.zeros(32, dtype=torch.long))
    for xb, yb in loader:
        if len(xb):
            try:
                model(xb).sum().backward()
            except ConfigError:
                pass
            break
    assert torch.equal(net.running, torch.zeros(D))


def test_skipping_or_redrawing_batches_makes_the_run_uncertified():
    """benchmarks/redteam/integrations/a5_batch_selection.py: a loop that keeps only batches of its choosing (here: of at least 4 rows)
    stays certified though the target's inclusion rate among the released steps is q' = 1.32 q."""
    n, B = 40, 4
    eng = DPEngine(nn.Linear(3, 2), "dpsgd", n=n, batch_size=B, steps=5, noise_multiplier=1.0,
                   config=AlgoConfig(lr=0.1))
    x, y = torch.randn(n, 3), torch.zeros(n, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            idx = eng.sampler.sample()
            while len(idx) < B:
                idx = eng.sampler.sample()
            eng.step(x[idx], y[idx], idx)
        if eng.sampler.skipped == 0:  # no draw was short in any of the 5 steps (p ~ 0.06): pass one over now
            eng.sampler.sample()
            eng.sampler.sample()
    assert eng.sampler.skipped >= 1
    assert not eng.privacy().certified
    assert any("passed over" in c for c in eng.privacy().caveats)


class _AtenMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, 2)

    def forward(self, x):
        g = torch.Generator().manual_seed(99)  # the model's own generator: public, by batch position
        return self.lin(x * torch.ops.aten.bernoulli.p(torch.ones(x.shape[0], 1), 0.5, generator=g))


def test_a_draw_from_a_models_own_generator_through_aten_is_refused():
    """benchmarks/redteam/integrations/d2_aten_own_generator.py: neither refused by name (aten OpOverloads are not in the list) nor
    after the fact (no global generator moves): a position-assigned public mask, 2.83 C between neighbours."""
    eng = DPEngine(_AtenMask(), "dpsgd", n=16, batch_size=16, steps=1, noise_multiplier=1.0,
                   config=AlgoConfig(lr=0.1), grad_path="rows")
    idx = eng.sampler.sample()
    x, y = torch.randn(16, D), torch.zeros(16, dtype=torch.long)
    try:
        eng.step(x[idx], y[idx], idx)
    except ConfigError as e:
        assert "generator" in str(e)
        return
    raise AssertionError("a forward drawing from its own torch.Generator through torch.ops.aten was not refused "
                         f"(certified={eng.privacy().certified})")


_BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "redteam" / "session"


def _load(name: str):
    """A benchmarks/redteam/session script as a module (its measurement functions)."""
    spec = importlib.util.spec_from_file_location(f"redteam_{name}", _BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_cancelling_tied_example_does_not_round_the_others_away():
    """Tied Embedding/head: one example whose two uses cancel exactly (true clipped contribution 0)
    sits in the sums at ~180 C; 4096 others at the same token, each 0.49 ulp of that, were rounded
    away in the float32 embedding sum (the release moved by 0.03 C; 1.96 C at B = 2^18). The tied
    weight's sums are float64, rounded once: removing it leaves the release within float32 rounding."""
    change = _load("tied_absorb").run(4096)
    assert change <= 1e-6


def _padded_gpt2_grads(width: int, path: str):
    """Tiny GPT-2 (dropout 0.1 on hidden states and SDPA attention), 8 examples right-padded to ``width``
    with their attention mask, under one key, step and indices: the per-example gradients (rows path:
    FuncGradients; fast path: BookKeeping's sum with a one-hot weight per example) and norms."""
    from clipbias.data.text import sequence_loss
    from clipbias.grads.fast import BookKeeping
    from clipbias.grads.rows import FuncGradients
    from clipbias.randomness import SecretKey, forward

    bench = _load("dropout_padding")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 100, (8, 20), generator=g)
    x, y = bench.batch(tokens, [12, 11, 10, 12, 9, 12, 8, 12], width)
    model, ids = bench.gpt2(0.1), list(range(20, 28))
    with forward.keyed(SecretKey.from_seed(7), 3), forward.examples(ids):
        if path == "rows":
            grads, _ = FuncGradients(model, sequence_loss)(x, y)
            return grads.double(), grads.double().norm(dim=1)
        bk, rows = BookKeeping(model, sequence_loss), []
        for r in range(8):
            s, _, _, norms = bk(x, y, lambda n, r=r: torch.nn.functional.one_hot(torch.tensor(r), len(n)).to(n), False)
            rows.append(s.double())
        return torch.stack(rows), norms.double()


def test_dynamic_padding_does_not_move_an_examples_dropout_masks():
    """Red team (benchmarks/redteam/session/dropout_padding.py): masks laid out over the padded shape, each
    call after the previous call's blocks, moved 8 examples' clipped sum by 1.11 C when they were padded to
    20 tokens instead of 12 (a long example joining the batch). Per-call streams and a layout independent of
    the padded sizes: each example's gradient is the same at either width, on both paths (and equal across
    the paths); dropout is on (the gradients differ from dropout's off)."""
    got = {}
    for path in ("rows", "fast"):
        (a, na), (b, nb) = _padded_gpt2_grads(12, path), _padded_gpt2_grads(20, path)
        scale = float(na.max())
        assert torch.allclose(na, nb, rtol=1e-5) and float((a - b).norm(dim=1).max()) <= 1e-5 * scale, path
        got[path] = a
    assert float((got["rows"] - got["fast"]).norm(dim=1).max()) <= 1e-4 * float(got["rows"].norm(dim=1).max())
    clipped = _load("dropout_padding").main("fast")
    assert clipped[0.1] < 1e-4 and clipped["split"] < 1e-4


def test_left_padding_under_dropout_is_refused_and_right_padding_taken():
    """Keyed dropout masks are laid out by token position: left padding would shift an example's masks with
    the batch's longest example (another example's presence moving its randomness). A left-padded
    attention mask is refused, before anything changes, while the model draws dropout; right padding, and
    left padding without dropout, are taken."""
    from clipbias.data.text import sequence_loss
    from clipbias.engine import DPEngine
    bench = _load("dropout_padding")
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 100, (4, 12), generator=g)
    x, y = bench.batch(tokens, [12, 9, 10, 8], 12)
    left = {k: torch.stack([torch.roll(r, int((x["attention_mask"][i] == 0).sum())) for i, r in enumerate(v)])
            for k, v in x.items()}
    assert int(left["attention_mask"][1, 0]) == 0 and int(left["attention_mask"][1, -1]) == 1
    for p, batch_x, refused in ((0.1, left, True), (0.1, x, False), (0.0, left, False)):
        model = bench.gpt2(p)
        before = [t.detach().clone() for t in model.parameters()]
        eng = DPEngine(model, "dpsgd", n=40, batch_size=4, steps=2, noise_multiplier=1.0, loss_fn=sequence_loss,
                       grad_path="fast")
        if refused:
            with pytest.raises(ConfigError, match="pads an example on the left"):
                eng.step(batch_x, y, torch.arange(4))
            assert eng.steps_taken == 0 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        else:
            eng.step(batch_x, y, torch.arange(4))
            assert eng.steps_taken == 1
