"""Opacus's surface as its examples use it (issue 55, item 3): ``privacy_engine.accountant`` (``get_epsilon``,
``get_privacy_spent``, ``history``, ``state_dict``), ``len(train_loader)`` and the steps of an epoch as Opacus
counts them, ``privacy_report()`` at the run's delta, ``make_private`` on what it returned before, and errors
that name ``criterion``; the training loop of Opacus's mnist example runs with only its import changed."""

from __future__ import annotations

import io
import math
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from clipbias import PrivacyEngine, privacy
from clipbias.errors import ConfigError
from clipbias.integrations.opacus import speak_opacus

N, D, K, B = 200, 6, 3, 32   # len(DataLoader) = ceil(200 / 32) = 7, where round(200 / 32) would be 6


def _data(n: int = N):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, D, generator=g)
    y = (x @ torch.randn(D, K, generator=g)).argmax(1)
    return x, y


def _private(pe: PrivacyEngine | None = None, y: torch.Tensor | None = None, **kw):
    x, y0 = _data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    pe = pe or PrivacyEngine()
    args = dict(module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y0 if y is None else y),
                batch_size=B), max_grad_norm=1.0)
    if "target_epsilon" in kw:
        return pe, *pe.make_private_with_epsilon(**args, **kw)
    return pe, *pe.make_private(**{"noise_multiplier": 1.0, **args, **kw})


def _steps(model, opt, loader, k: int | None = None) -> None:
    crit = nn.CrossEntropyLoss()
    for i, (xb, yb) in enumerate(loader):
        if k is not None and i == k:
            break
        opt.zero_grad()
        crit(model(xb), yb).backward()
        opt.step()


def test_the_accountant_is_the_engines_epsilon_from_before_make_private_on():
    pe = PrivacyEngine()
    acc = pe.accountant
    assert pe.accountant_name == "prv" and acc.mechanism() == "prv"
    assert acc.get_epsilon(delta=1e-5) == 0.0 and acc.history == [] and len(acc) == 0  # Opacus makes it in __init__
    assert acc.get_privacy_spent(delta=1e-5)[0] == 0.0
    with pytest.raises(ConfigError, match="delta"):
        acc.get_epsilon(delta=2.0)
    _, model, opt, loader = _private(pe)
    assert pe.accountant is acc and acc.get_epsilon(delta=1e-5) == 0.0 and len(acc) == 0  # no step yet
    _steps(model, opt, loader, 2)
    first = acc.get_epsilon(delta=1e-5, eps_error=0.01)  # Opacus's accuracy knobs are accepted
    assert 0 < first == pe.get_epsilon(1e-5)
    assert acc.history == [(1.0, B / N, 2)] and len(acc) == 1
    _steps(model, opt, loader, 3)
    assert pe.accountant.get_epsilon(delta=1e-5) > first == pytest.approx(
        privacy.account(pe.engine.spec, 2, 1e-5, "pld").epsilon, rel=1e-12)
    assert acc.history == [(1.0, B / N, 5)]
    with pytest.raises(ConfigError, match="cannot be set"):
        acc.history = [(1.0, B / N, 1)]
    with pytest.raises(ConfigError, match="accounts each private step itself"):
        acc.step(noise_multiplier=1.0, sample_rate=0.1)


def test_get_privacy_spent_gives_the_rdp_order_of_its_epsilon():
    """``(epsilon, best_alpha)``: with ``accountant="rdp"`` the Renyi order whose conversion is the epsilon
    (recomputed independently with dp-accounting here); with the PLD-served ``prv``, ``nan``."""
    from dp_accounting import dp_event, rdp
    pe, model, opt, loader = _private(PrivacyEngine(accountant="rdp"))
    assert pe.accountant.mechanism() == "rdp"
    _steps(model, opt, loader, 4)
    eps, alpha = pe.accountant.get_privacy_spent(delta=1e-5)
    acc = rdp.RdpAccountant()
    acc.compose(dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(B / N, dp_event.GaussianDpEvent(1.0)), 4))
    assert (eps, alpha) == pytest.approx(acc.get_epsilon_and_optimal_order(1e-5))
    assert eps == pe.get_epsilon(1e-5) == pe.accountant.get_epsilon(delta=1e-5) and alpha > 1
    pe, model, opt, loader = _private()
    _steps(model, opt, loader, 1)
    eps, alpha = pe.accountant.get_privacy_spent(delta=1e-5)
    assert eps == pe.get_epsilon(1e-5) > 0 and math.isnan(alpha)


def test_the_accountant_state_round_trips_and_never_accounts_fewer_steps():
    pe, model, opt, loader = _private(noise_seed=3)
    _steps(model, opt, loader, 2)
    early = pe.accountant.state_dict()
    _steps(model, opt, loader, 2)
    buf = io.BytesIO()
    torch.save(pe.accountant.state_dict(), buf)
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
    assert state["history"] == [(1.0, B / N, 4)] and state["mechanism"] == "prv"

    resumed, model2, opt2, loader2 = _private(noise_seed=3)  # a new process: make_private, then load
    resumed.accountant.load_state_dict(state)
    assert resumed.accountant.history == pe.accountant.history and resumed.steps == 4
    assert resumed.accountant.get_epsilon(delta=1e-5) == pe.accountant.get_epsilon(delta=1e-5)
    _steps(model2, opt2, loader2, 1)
    assert resumed.accountant.history == [(1.0, B / N, 5)]

    with pytest.raises(ConfigError, match="accounts 2 step.*taken 4"):  # back to fewer steps: refused
        pe.accountant.load_state_dict(early)
    assert pe.steps == 4
    tampered = dict(state, history=[(1.0, B / N, 1)])
    with pytest.raises(ConfigError, match="altered"):
        _private()[0].accountant.load_state_dict(tampered)
    with pytest.raises(ConfigError, match="no engine state"):  # an Opacus accountant's state
        _private()[0].accountant.load_state_dict({"history": [(1.0, 0.1, 3)], "mechanism": "prv"})
    with pytest.raises(ConfigError, match="accountant='prv'"):
        _private(PrivacyEngine(accountant="rdp"))[0].accountant.load_state_dict(state)
    with pytest.raises(ConfigError, match="make_private"):
        PrivacyEngine().accountant.load_state_dict(state)
    assert PrivacyEngine().accountant.state_dict() == {"history": [], "mechanism": "prv"}


def test_len_and_the_plan_count_epochs_as_opacus():
    """``len(train_loader)`` is ``len()`` of the user's DataLoader (ceil(n / B); n // B with drop_last); an epoch
    yields that many batches, and ``make_private_with_epsilon``'s plan is ``epochs * len(train_loader)``."""
    x, y = _data()
    assert len(DataLoader(TensorDataset(x, y), batch_size=B)) == 7
    pe, model, opt, loader = _private(PrivacyEngine(accountant="rdp"), target_epsilon=2.0, target_delta=1e-5,
                                      epochs=2)
    assert len(loader) == 7 and pe.engine.total_steps == 2 * len(loader)
    seen = []
    for _ in range(2):
        before = pe.steps
        _steps(model, opt, loader)
        seen.append(pe.steps - before)
    assert seen == [7, 7] and pe.steps == pe.engine.total_steps  # two epochs of len(loader) steps: the plan
    assert pe.accountant.get_epsilon(delta=1e-5) <= 2.0
    m = nn.Linear(D, K)
    _, _, dl = PrivacyEngine().make_private(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                            data_loader=DataLoader(TensorDataset(x, y), batch_size=B, drop_last=True),
                                            noise_multiplier=1.0, max_grad_norm=1.0)
    assert len(dl) == 6 == sum(1 for _ in dl)


def test_privacy_report_is_at_the_delta_the_run_was_given():
    pe, model, opt, loader = _private(PrivacyEngine(accountant="rdp"), target_epsilon=3.0, target_delta=1e-6,
                                      epochs=1)
    _steps(model, opt, loader, 2)
    assert pe.privacy_report().delta == 1e-6 and pe.privacy_report().epsilon == pe.get_epsilon(1e-6)
    for kw, delta in ((dict(delta=2e-5), 2e-5), ({}, 1e-5)):
        pe, model, opt, loader = _private(**kw)
        _steps(model, opt, loader, 1)
        assert pe.privacy_report().delta == delta and pe.privacy_report().epsilon == pe.get_epsilon(delta)


def test_make_private_takes_what_it_returned_before():
    """A resumed script passes the private module, optimizer and loader again: they are unwrapped (as Opacus
    does), with a warning when their training took steps this PrivacyEngine does not account."""
    _, model, opt, loader = _private()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = PrivacyEngine().make_private(module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
                                             max_grad_norm=1.0)  # no step taken: nothing to say
    assert again[2].original is loader.original and again[0]._module is model._module
    _steps(model, opt, loader, 2)
    pe = PrivacyEngine()
    with pytest.warns(UserWarning, match="taken 2 private step"):
        model2, opt2, loader2 = pe.make_private(module=model, optimizer=opt, data_loader=loader,
                                                noise_multiplier=1.0, max_grad_norm=1.0)
    assert loader2.original is loader.original and model2._module is model._module
    assert opt2.original_optimizer is opt.original_optimizer and len(loader2) == len(loader) == 7
    _steps(model2, opt2, loader2, 2)
    assert pe.steps == 2 and pe.accountant.get_epsilon(delta=1e-5) > 0


def test_an_engine_error_reaching_an_opacus_user_names_criterion():
    """Labels of -100 (a padding label ``nn.CrossEntropyLoss`` ignores): with ``criterion`` given they reach the
    engine's check of the default cross-entropy, whose message says ``criterion`` (the Opacus argument), not
    ``loss_fn``; without it, the loop's own mean over the labels kept is refused at its backward (its denominator
    counts every example's label), with the fix in the same words."""
    _, y = _data()
    y = y.clone()
    y[::2] = -100
    _, model, opt, loader = _private(y=y, criterion=nn.CrossEntropyLoss())
    with pytest.raises(ConfigError) as err:
        _steps(model, opt, loader, 1)
    assert "your own criterion" in str(err.value) and "loss_fn" not in str(err.value)
    _, model, opt, loader = _private(y=y)
    with pytest.raises(ConfigError) as err:
        _steps(model, opt, loader, 1)
    assert "ignore_index=-100" in str(err.value) and "reduction='sum'" in str(err.value) \
        and "criterion=" in str(err.value) and "loss_fn" not in str(err.value)
    assert speak_opacus("pass your own loss_fn; `loss_fn`; engine.loss_fn; `epsilon`") == \
        "pass your own criterion; `criterion`; engine.loss_fn; `target_epsilon`"


class SampleConvNet(nn.Module):  # Opacus's examples/mnist.py model, as it is there
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 2, padding=3)
        self.conv2 = nn.Conv2d(16, 32, 4, 2)
        self.fc1 = nn.Linear(32 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(x, 2, 1)
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2, 1)
        x = x.view(-1, 32 * 4 * 4)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return x


# Opacus's examples/mnist.py (train, test and main's training part), as there but for its import; tqdm is the
# identity and MNIST a small synthetic stand-in
MNIST_SCRIPT = """
from clipbias import PrivacyEngine


def train(args, model, device, train_loader, optimizer, privacy_engine, epoch):
    model.train()
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _batch_idx, (data, target) in enumerate(tqdm(train_loader)):
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        output = model(data)
        loss = criterion(output, target)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())

    if not args.disable_dp:
        epsilon = privacy_engine.accountant.get_epsilon(delta=args.delta)
        print(
            f"Train Epoch: {epoch} \\t"
            f"Loss: {np.mean(losses):.6f} "
            f"(ε = {epsilon:.2f}, δ = {args.delta})"
        )
    else:
        print(f"Train Epoch: {epoch} \\t Loss: {np.mean(losses):.6f}")


def test(model, device, test_loader):
    model.eval()
    criterion = nn.CrossEntropyLoss()
    test_loss = 0
    correct = 0
    with torch.no_grad():
        for data, target in tqdm(test_loader):
            data, target = data.to(device), target.to(device)
            output = model(data)
            test_loss += criterion(output, target).item()  # sum up batch loss
            pred = output.argmax(
                dim=1, keepdim=True
            )  # get the index of the max log-probability
            correct += pred.eq(target.view_as(pred)).sum().item()

    test_loss /= len(test_loader.dataset)
    return correct / len(test_loader.dataset)


device = torch.device(args.device)
train_loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, num_workers=0, pin_memory=True)
test_loader = torch.utils.data.DataLoader(test_set, batch_size=args.test_batch_size, shuffle=True, num_workers=0)
run_results = []
for _ in range(args.n_runs):
    model = SampleConvNet().to(device)

    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0)
    privacy_engine = None

    if not args.disable_dp:
        privacy_engine = PrivacyEngine(secure_mode=args.secure_rng)
        model, optimizer, train_loader = privacy_engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=train_loader,
            noise_multiplier=args.sigma,
            max_grad_norm=args.max_per_sample_grad_norm,
        )

    for epoch in range(1, args.epochs + 1):
        train(args, model, device, train_loader, optimizer, privacy_engine, epoch)
    run_results.append(test(model, device, test_loader))
"""


@pytest.mark.filterwarnings("ignore:.*pin_memory")
def test_the_opacus_mnist_loop_runs_with_only_its_import_changed(capsys):
    import numpy as np
    g = torch.Generator().manual_seed(0)
    protos = torch.randn(10, 1, 28, 28, generator=g)
    labels = torch.arange(150) % 10
    images = protos[labels] + 0.5 * torch.randn(150, 1, 28, 28, generator=g)
    args = types.SimpleNamespace(batch_size=32, test_batch_size=64, epochs=2, n_runs=1, lr=0.1, sigma=1.0,
                                 max_per_sample_grad_norm=1.0, delta=1e-5, device="cpu", disable_dp=False,
                                 secure_rng=False)
    scope = dict(torch=torch, nn=nn, optim=torch.optim, np=np, tqdm=lambda it: it, args=args,
                 SampleConvNet=SampleConvNet, train_set=TensorDataset(images[:120], labels[:120]),
                 test_set=TensorDataset(images[120:], labels[120:]))
    torch.manual_seed(0)
    exec(MNIST_SCRIPT, scope)
    pe, loader = scope["privacy_engine"], scope["train_loader"]
    assert len(loader) == 4 and pe.steps == args.epochs * len(loader)  # ceil(120 / 32) steps an epoch, as Opacus
    out = capsys.readouterr().out
    assert out.count("Train Epoch:") == 2 and "(ε = 0.00" not in out
    assert f"ε = {pe.accountant.get_epsilon(delta=1e-5):.2f}" in out.splitlines()[-1]
    assert 0 <= scope["run_results"][0] <= 1 and pe.privacy_report().certified


def test_an_elementwise_criterion_takes_the_loaders_labels_in_the_outputs_shape():
    """``criterion=nn.BCEWithLogitsLoss()`` on a ``[b, 1]`` logit, the loop passing ``y.float().unsqueeze(1)``, as
    Opacus users write binary classification: the step's criterion gets the loader's ``[b]`` integer labels in
    the output's shape and dtype (torch refused them with a raw ValueError), and the loop's loss is criterion's
    (no warning)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    crit = nn.BCEWithLogitsLoss()
    pe = PrivacyEngine()
    m, opt, loader = pe.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                     data_loader=DataLoader(TensorDataset(x, y), batch_size=16),
                                     noise_multiplier=1.0, max_grad_norm=1.0, criterion=crit)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for xb, yb in loader:
            opt.zero_grad()
            crit(m(xb), yb.float().unsqueeze(1)).backward()
            opt.step()
    assert pe.steps == len(loader) and pe.privacy_report().certified
    assert not [w for w in seen if "not `criterion`'s" in str(w.message)]


@pytest.mark.parametrize("criterion", [None, nn.CrossEntropyLoss()])
def test_a_cifar10_shaped_script_runs_with_the_import_changed(criterion):
    """The structure of Opacus's cifar10 example (its convnet, SGD with momentum, a per-epoch cosine learning
    rate set in ``param_groups``, ``print(train_loader.batch_sampler)``, ``accountant.get_privacy_spent(delta,
    alphas=...)`` by position, ``loss.item()`` and accuracy in the loop, ``optimizer.step()`` then
    ``zero_grad()``, evaluation under ``no_grad``, ``model.state_dict()`` saved), on stand-in data. The example
    reads ``loss.item()`` before ``loss.backward()``: following the loop's loss, that step is not proved per
    example (the loss or the backward could depend on the value read), so the run says so and is uncertified;
    with ``criterion`` the step does not depend on the loop's code and the run is certified."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(start_dim=1, end_dim=-1),
                          nn.Linear(8, 10))
    images, labels = torch.randn(96, 3, 8, 8), torch.randint(0, 10, (96,))
    train_loader = DataLoader(TensorDataset(images, labels), batch_size=int(0.25 * 96))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    privacy_engine = PrivacyEngine(accountant="rdp")
    model, optimizer, train_loader = privacy_engine.make_private(module=model, optimizer=optimizer,
                                                                 data_loader=train_loader, noise_multiplier=1.5,
                                                                 max_grad_norm=10.0, criterion=criterion)
    from clipbias.sampling import PoissonSampler
    assert isinstance(train_loader.batch_sampler, PoissonSampler)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(1, 3):
        for group in optimizer.param_groups:
            group["lr"] = 0.1 * 0.5 * (1 + math.cos(math.pi * epoch / 3))
        model.train()
        losses = []
        for images_b, target in train_loader:
            output = model(images_b)
            loss = loss_fn(output, target)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the unproven step's warning: asserted below)
                losses.append(loss.item())
                loss.backward()
                optimizer.step()
            optimizer.zero_grad()
        epsilon, best_alpha = privacy_engine.accountant.get_privacy_spent(
            1e-5, alphas=[1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
        assert epsilon > 0 and best_alpha > 1
        model.eval()
        with torch.no_grad():
            assert model(images[:8]).shape == (8, 10)
    state = model.state_dict()
    assert set(state) == {f"_module.{k}" for k in model._module.state_dict()}
    report = privacy_engine.privacy_report()
    assert privacy_engine.steps == 2 * len(train_loader)
    if criterion is None:
        assert not report.certified and any("could not be proved a sum of per-example terms" in c
                                            for c in report.caveats)
    else:
        assert report.certified


def test_make_private_on_a_lightning_module_without_a_trainer_says_where_to_call_it():
    """Opacus's mnist_lightning pattern calls make_private in configure_optimizers, where the Trainer is attached
    (tests/test_opacus_lightning.py); on a LightningModule without a Trainer it is refused, naming that place and
    the one line (DPCallback) that does the same."""
    LightningModule = type("LightningModule", (nn.Module,), {})  # (the check reads the class's name: no import)
    Lit = type("Lit", (LightningModule,), {})
    module = Lit()
    module.fc = nn.Linear(D, K)
    x, y = _data()
    with pytest.raises(ConfigError, match=r"callbacks=\[DPCallback\(noise_multiplier=\.\.\., max_grad_norm=\.\.\.\)\]"):
        PrivacyEngine().make_private(module=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                                     data_loader=DataLoader(TensorDataset(x, y), batch_size=B),
                                     noise_multiplier=1.0, max_grad_norm=1.0)


def test_an_optimizer_that_is_not_one_is_refused_in_the_interfaces_words():
    x, y = _data()
    model = nn.Linear(D, K)
    with pytest.raises(ConfigError, match="optimizer must be a torch.optim.Optimizer, got list"):
        PrivacyEngine().make_private(module=model, optimizer=list(model.parameters()),
                                     data_loader=DataLoader(TensorDataset(x, y), batch_size=B), noise_multiplier=1.0,
                                     max_grad_norm=1.0)


@pytest.mark.parametrize("algorithm", ["sgd", "clip-sgd", "ef-sgd"])
def test_a_non_private_algorithm_is_refused_as_the_other_adapters_refuse_it(algorithm):
    """Red team round 11: ``make_private(noise_multiplier=1.0, algorithm="sgd")`` trained without noise, the
    noise_multiplier ignored (reported honestly as uncertified, but silent); DPCallback and DPTrainer refuse it."""
    x, y = _data()
    model = nn.Linear(D, K)
    with pytest.raises(ConfigError, match="is not private"):
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=DataLoader(TensorDataset(x, y), batch_size=B), noise_multiplier=1.0,
                                     max_grad_norm=1.0, algorithm=algorithm)
