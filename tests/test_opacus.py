"""The Opacus interface (``clipbias.PrivacyEngine``): an Opacus training loop runs with only its import changed,
trains exactly as the engine does, and its privacy statement is the engine's; batches the engine did not draw
make any run uncertified; the model fixer."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import clipbias
from clipbias import BatchMemoryManager, PrivacyEngine
from clipbias.config import AlgoConfig
from clipbias.engine import DPEngine
from clipbias.errors import ClipbiasError, ConfigError
from clipbias import privacy

N, D, K, B = 240, 6, 3, 24


def _data(n: int = N):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, D, generator=g)
    y = (x @ torch.randn(D, K, generator=g)).argmax(1)
    return x, y


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 16), nn.Tanh(), nn.Linear(16, K))


# an Opacus training script, verbatim but for its first line (the import)
OPACUS_SCRIPT = """
from clipbias import PrivacyEngine

model = make_model()
optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
criterion = nn.CrossEntropyLoss()
train_loader = DataLoader(TensorDataset(x, y), batch_size=24, shuffle=True)

privacy_engine = PrivacyEngine()
model, optimizer, train_loader = privacy_engine.make_private(
    module=model, optimizer=optimizer, data_loader=train_loader, noise_multiplier=1.0, max_grad_norm=1.0)

for epoch in range(3):
    model.train()
    losses = []
    for data, target in train_loader:
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    scheduler.step()
    epsilon = privacy_engine.get_epsilon(delta=1e-5)
"""


def test_an_opacus_script_runs_with_only_its_import_changed():
    x, y = _data()
    scope = dict(torch=torch, nn=nn, DataLoader=DataLoader, TensorDataset=TensorDataset, x=x, y=y, make_model=_model)
    exec(OPACUS_SCRIPT, scope)
    pe, model = scope["privacy_engine"], scope["model"]
    steps = 3 * round(N / B)
    assert pe.steps == steps
    # the epsilon is the accountant's for that many Poisson-subsampled Gaussian steps, computed independently
    want = privacy.account(pe.engine.spec, steps, 1e-5, "pld").epsilon
    assert scope["epsilon"] == pytest.approx(want, rel=1e-12) and 0 < want < math.inf
    report = pe.privacy_report()
    assert report.certified and report.caveats == () and report.noise_multiplier == 1.0
    assert scope["scheduler"].get_last_lr() == [pytest.approx(0.02 / 8)]  # the user's scheduler drove the lr
    model.eval()
    with torch.no_grad():
        acc = (model(x).argmax(1) == y).float().mean().item()
    assert acc > 0.6  # three classes: chance is 1/3


def _train_opacus(steps: int, seed: int, physical: int | None = None, state: dict | None = None,
                  start: dict | None = None):
    x, y = _data()
    model = _model()
    if start is not None:
        model.load_state_dict(start)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    pe = PrivacyEngine()
    model, opt, loader = pe.make_private(module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y),
                                         batch_size=B), noise_multiplier=1.0, max_grad_norm=0.5, noise_seed=seed)
    if state is not None:
        pe.load_state_dict(state)
    crit, taken = nn.CrossEntropyLoss(), 0

    def loop(batches):
        nonlocal taken
        for xb, yb in batches:  # (stops right after a step: a batch drawn and left unused would be passed over)
            opt.zero_grad()
            crit(model(xb), yb).backward()
            opt.step()
            if pe.steps >= steps:
                return
    while pe.steps < steps:
        if physical is None:
            loop(loader)
        else:
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical, optimizer=opt) as mem:
                loop(mem)
    return model._module, pe


def test_the_opacus_interface_trains_exactly_as_the_engine_loop():
    """Same key: the same Poisson batches, clipping and noise, so the same weights as DPEngine's own loop."""
    steps = 12
    ours, pe = _train_opacus(steps, seed=7)
    x, y = _data()
    model = _model()
    eng = DPEngine(model, "dpsgd", n=N, batch_size=B, steps=steps, noise_multiplier=1.0, noise_seed=7,
                   config=AlgoConfig(lr=0.5, clip=0.5, momentum=0.9))
    eng.train_epoch(x, y)
    while eng.steps_taken < steps:
        eng.train_epoch(x, y)
    for a, b in zip(ours.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert not pe.privacy_report().certified  # a seeded run says so


def test_virtual_steps_change_nothing_and_resume_is_bit_exact():
    full, _ = _train_opacus(10, seed=11)
    chunked, _ = _train_opacus(10, seed=11, physical=5)
    for a, b in zip(full.parameters(), chunked.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    first, pe = _train_opacus(4, seed=11)
    resumed, _ = _train_opacus(10, seed=11, state=pe.state_dict(), start=first.state_dict())
    for a, b in zip(full.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", ["user-loader", "whole-set", "same-batch"])
def test_a_batch_the_engine_did_not_draw_makes_the_run_uncertified(case):
    """The hand port ``for x, y in user_loader: engine.step(x, y)`` (and its relatives) used to report the
    Poisson epsilon, certified, with no caveat."""
    x, y = _data()
    eng = DPEngine(_model(), "dpsgd", n=N, batch_size=B, steps=8, noise_multiplier=1.0, config=AlgoConfig(lr=0.1))
    batches = {"user-loader": [(xb, yb, None) for xb, yb in DataLoader(TensorDataset(x, y), batch_size=B)][:8],
               "whole-set": [(x, y, torch.arange(N))] * 8,
               "same-batch": [(x[:B], y[:B], torch.arange(B))] * 8}[case]
    with pytest.warns(UserWarning, match="did not draw"):
        for xb, yb, idx in batches:
            eng.step(xb, yb, idx)
    report = eng.privacy()
    assert not report.certified and any("8 of the 8 steps" in c for c in report.caveats)


def test_the_engines_own_batches_stay_certified_and_a_reused_batch_does_not():
    x, y = _data()
    eng = DPEngine(_model(), "dpsgd", n=N, batch_size=B, steps=6, noise_multiplier=1.0, config=AlgoConfig(lr=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            idx = eng.sampler.sample()
            eng.step(x[idx], y[idx], idx)
    assert eng.privacy().certified
    with pytest.warns(UserWarning):
        eng.step(x[idx], y[idx], idx)  # the last batch again: not a fresh Poisson sample
    assert not eng.privacy().certified


def test_make_private_with_epsilon_never_overshoots_and_stops_at_the_plan():
    x, y = _data()
    pe = PrivacyEngine(accountant="rdp")
    m = _model()
    model, opt, loader = pe.make_private_with_epsilon(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                                      data_loader=DataLoader(TensorDataset(x, y), batch_size=B),
                                                      target_epsilon=2.0, target_delta=1e-5, epochs=1,
                                                      max_grad_norm=1.0)
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    eps = pe.get_epsilon(1e-5)
    assert 1.9 < eps <= 2.0 and pe.privacy_report().accountant == "rdp"
    with pytest.raises(ConfigError, match="are all taken"):  # the planned steps are taken: a further pass says so
        list(loader)


def test_refusals_name_the_opacus_argument():
    x, y = _data()
    loader = DataLoader(TensorDataset(x, y), batch_size=B)

    def make(**kw):
        m = _model()
        args = dict(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), data_loader=loader,
                    noise_multiplier=1.0, max_grad_norm=1.0)
        args.update(kw)
        return PrivacyEngine().make_private(**args)
    for kw, words in [(dict(poisson_sampling=False), "poisson_sampling"), (dict(clipping="per_layer"), "clipping"),
                      (dict(noise_generator=torch.Generator()), "noise_generator"),
                      (dict(loss_reduction="sum"), "loss_reduction"), (dict(algorithm="batch-clip"), "public"),
                      (dict(max_grad_norm=0.0), "max_grad_norm"), (dict(noise_multiplier=-1), "noise_multiplier"),
                      (dict(optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)), "optimizer")]:
        with pytest.raises(ConfigError, match=words):
            make(**kw)
    with pytest.raises(ConfigError, match="gdp"):
        PrivacyEngine(accountant="gdp")
    from clipbias.integrations.options import DPOptions
    with pytest.raises(ConfigError, match="`target_delta` must lie in"):  # named as the integrations spell it
        DPOptions(noise_multiplier=1.0, target_delta=1.5).check()
    model, opt, dl = make()
    with pytest.raises(ConfigError, match="without a batch"):
        opt.step()
    xb, yb = next(iter(dl))
    model(xb)
    model(xb)
    opt.step()  # (two calls on the rows: two views of each example, summed before clipping; issue 55 item 2)


def test_inputs_transformed_in_the_loop_make_the_run_uncertified():
    """An augmentation in the training loop draws from torch's public generator by batch position: the engine
    cannot vouch for it. Moving or casting the batch is fine."""
    x, y = _data()
    m = _model()
    pe = PrivacyEngine()
    model, opt, loader = pe.make_private(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                         data_loader=DataLoader(TensorDataset(x.double(), y), batch_size=B),
                                         noise_multiplier=1.0, max_grad_norm=1.0)
    for i, (xb, yb) in enumerate(loader):
        opt.zero_grad()
        xb = xb.float() if i < 3 else xb.float() + 0.1 * torch.randn_like(xb.float())
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        if i == 2:
            assert pe.privacy_report().certified
    report = pe.privacy_report(1e-6)
    assert not report.certified and any("7 of the 10 steps" in c for c in report.caveats)


class _BNNet(nn.Module):
    """A small ResNet-style block with BatchNorm and in-place ReLU (torchvision's resnet18 pattern)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)
        self.relu, self.fc = nn.ReLU(inplace=True), nn.Linear(8, K)

    def forward(self, x):
        h = self.relu(self.bn1(self.conv1(x)))
        h = self.relu(self.bn2(self.conv2(h)) + h)
        return self.fc(h.mean((2, 3)))


def test_fix_turns_a_batchnorm_resnet_into_one_that_trains_privately():
    model = _BNNet()
    problems = clipbias.ModuleValidator.validate(model)
    assert len(problems) == 2 and all("BatchNorm2d" in str(p) for p in problems)
    x, y = torch.randn(64, 3, 8, 8), torch.randint(0, K, (64,))
    m = _BNNet()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ClipbiasError, match="clipbias.fix"):  # unfixed: refused, with the fix named
        PrivacyEngine().make_private(module=m, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y), batch_size=16),
                                     noise_multiplier=1.0, max_grad_norm=1.0)
    fixed = clipbias.fix(_BNNet())
    assert clipbias.ModuleValidator.validate(fixed) == [] and isinstance(fixed.bn1, nn.GroupNorm)
    assert fixed.relu.inplace is False
    before = [p.detach().clone() for p in fixed.parameters()]
    pe = PrivacyEngine()
    mm, oo, dl = pe.make_private(module=fixed, optimizer=torch.optim.SGD(fixed.parameters(), lr=0.1),
                                 data_loader=DataLoader(TensorDataset(x, y), batch_size=16), noise_multiplier=1.0,
                                 max_grad_norm=1.0)
    for xb, yb in dl:
        oo.zero_grad()
        nn.functional.cross_entropy(mm(xb), yb).backward()
        oo.step()
    assert pe.steps == 4 and pe.privacy_report().certified
    assert all(not torch.equal(a, b) for a, b in zip(before, fixed.parameters()))


def test_param_groups_per_group_lr_workers_and_a_dict_collate():
    """RMSprop with two parameter groups (the second frozen by lr 0), a scheduler, DataLoader workers and a
    collate_fn that returns a dict: the loop is the user's, untouched."""
    x, y = _data()
    m = _model()
    opt = torch.optim.RMSprop([{"params": m[0].parameters(), "lr": 0.01}, {"params": m[2].parameters(), "lr": 0.0}])
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.01, 0.0], total_steps=40)
    collate = (lambda items: {"inputs": torch.stack([a for a, _ in items]), "labels": torch.stack([b for _, b in items])})
    loader = DataLoader(TensorDataset(x, y), batch_size=B, collate_fn=collate, num_workers=2)
    pe = PrivacyEngine()
    model, opt, loader = pe.make_private(module=m, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
                                         max_grad_norm=1.0)
    first, last = [p.detach().clone() for p in m[0].parameters()], [p.detach().clone() for p in m[2].parameters()]
    for batch in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(batch["inputs"]), batch["labels"]).backward()
        opt.step()
        sched.step()
    assert pe.steps == len(loader) == 10 and pe.privacy_report().certified
    assert all(not torch.equal(a, b) for a, b in zip(first, m[0].parameters()))
    assert all(torch.equal(a, b) for a, b in zip(last, m[2].parameters()))


def test_a_loop_that_breaks_stays_certified_and_one_that_skips_batches_does_not():
    """``break`` right after a step leaves no batch unused; ``continue`` on small batches chooses batches by their
    content, which the accountant's q does not describe (so may a ``break`` before the step: counted as passed
    over, ``tests/test_guard_integrations.py``)."""
    x, y = _data()

    def run(skip: bool):
        m = _model()
        pe = PrivacyEngine()
        model, opt, loader = pe.make_private(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                             data_loader=DataLoader(TensorDataset(x, y), batch_size=B),
                                             noise_multiplier=1.0, max_grad_norm=1.0)
        for epoch in range(2):
            for i, (xb, yb) in enumerate(loader):
                if skip and len(yb) < B:
                    continue
                opt.zero_grad()
                nn.functional.cross_entropy(model(xb), yb).backward()
                opt.step()
                if not skip and i == 2:
                    break
        return pe
    pe = run(skip=False)
    assert pe.steps == 6 and pe.privacy_report().certified
    pe = run(skip=True)
    report = pe.privacy_report()
    assert not report.certified and any("passed over" in c for c in report.caveats)


def test_a_model_output_object_reaches_the_criterion_on_the_fast_path():
    """A Hugging Face ``ModelOutput`` keeps its type through the fast path's checks, so a criterion reading
    ``out.logits`` works there as on the rows path (it used to get a plain dict)."""
    from transformers.modeling_outputs import SequenceClassifierOutput

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(D, K)

        def forward(self, x):
            return SequenceClassifierOutput(logits=self.lin(x))
    x, y = _data()
    crit = (lambda out, t: nn.functional.cross_entropy(out.logits, t))
    got = []
    for path in ("fast", "rows"):
        torch.manual_seed(0)
        m = Net()
        pe = PrivacyEngine()
        model, opt, loader = pe.make_private(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.5),
                                             data_loader=DataLoader(TensorDataset(x, y), batch_size=B),
                                             noise_multiplier=1.0, max_grad_norm=0.1, criterion=crit,
                                             grad_path=path, noise_seed=5)
        for xb, yb in loader:
            opt.zero_grad()
            crit(model(xb), yb).backward()
            opt.step()
        got.append(m.lin.weight.detach().clone())
    torch.testing.assert_close(got[0], got[1], rtol=1e-4, atol=1e-5)  # the two paths sum in other orders


def test_from_the_second_batch_the_forward_takes_the_step_and_returns_its_outputs():
    """With ``criterion`` given, no second forward: once the first batch showed per-example tensor outputs, the
    wrapped model's forward runs the private step and returns the step's own outputs (the weights are those of
    the engine loop: test_the_opacus_interface_trains_exactly_as_the_engine_loop); optimizer.step() then closes
    the batch."""
    x, y = _data()
    m = _model()
    pe = PrivacyEngine()
    model, opt, loader = pe.make_private(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                         data_loader=DataLoader(TensorDataset(x, y), batch_size=B),
                                         noise_multiplier=1.0, max_grad_norm=1.0, criterion=nn.CrossEntropyLoss())
    seen = []
    for i, (xb, yb) in enumerate(loader):
        opt.zero_grad()
        before = [p.detach().clone() for p in m.parameters()]
        out = model(xb)
        seen.append(pe.steps)
        if i:  # the step's outputs are the model's at the weights before the step
            with torch.no_grad():
                torch.testing.assert_close(out, torch.func.functional_call(
                    m, {n: b for (n, _), b in zip(m.named_parameters(), before)}, (xb,)), rtol=1e-5, atol=1e-6)
        nn.functional.cross_entropy(out, yb).backward()
        opt.step()
    assert seen[0] == 0 and seen[1:] == list(range(2, len(seen) + 1)) and pe.privacy_report().certified


def _trained_with_epsilon(x, y, **kw):
    """``make_private_with_epsilon`` (epsilon 3, 2 epochs of batches of 32, SGD momentum 0.9) with ``kw``, then
    one pass of training: the PrivacyEngine."""
    m = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    pe = clipbias.PrivacyEngine()
    model, opt, dl = pe.make_private_with_epsilon(module=m, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y),
                                                  batch_size=32), target_epsilon=3, target_delta=1e-5, epochs=2,
                                                  max_grad_norm=1.0, **kw)
    for xb, yb in dl:
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    return pe


def test_make_private_takes_banded_noise_with_optimised_coefficients():
    """``bands_strategy`` reaches the engine: the noise stage holds the coefficients the optimiser gives for
    the run's steps and the base SGD's momentum; an open-ended run (no length) cannot have them."""
    from clipbias.algorithms import band_strategy
    x, y = torch.randn(256, 5), torch.randint(0, 3, (256,))
    pe = _trained_with_epsilon(x, y, bands=2, bands_strategy="optimized")
    noise = pe.engine.pipeline.noise
    assert noise.strategy == "optimized"
    assert noise.coefs == pytest.approx(band_strategy.optimized(2, pe.engine.total_steps, 0.9), abs=1e-12)
    assert noise.coefs != pytest.approx(band_strategy.optimized(2, pe.engine.total_steps, 0.0), abs=1e-6)
    assert pe.engine.steps_taken > 0 and pe.engine.privacy().certified
    m2 = nn.Linear(5, 3)
    with pytest.raises(ConfigError):
        clipbias.PrivacyEngine().make_private(module=m2, optimizer=torch.optim.SGD(m2.parameters(), lr=0.1),
                                              data_loader=DataLoader(TensorDataset(x, y), batch_size=32),
                                              noise_multiplier=1.0, max_grad_norm=1.0, bands=2,
                                              bands_strategy="optimized")


def test_make_private_with_epsilon_takes_blt_noise():
    """``bands_strategy="blt"`` through the Opacus interface: the engine's noise stage is BLT noise for the
    run's steps in ``bands`` classes, the accounting is its Gaussian mechanism, and training proceeds."""
    from clipbias.step import BLTNoise
    pe = _trained_with_epsilon(torch.randn(256, 5), torch.randint(0, 3, (256,)), bands=8, bands_strategy="blt")
    noise = pe.engine.pipeline.noise
    assert isinstance(noise, BLTNoise) and noise.blt.classes == 8 and noise.blt.steps == pe.engine.total_steps
    rep = pe.engine.privacy()
    assert pe.engine.steps_taken > 0 and rep.certified and "BLT noise" in rep.basis and rep.epsilon <= 3
