"""Red team round 6 (the integrations' session and the layers under it): each attack that kept a run certified
while one example moved the released weights far beyond the clip bound, in miniature, now refused or reported
uncertified; and the honest version of each loop still certified (no false alarms)."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import clipbias
from clipbias import PrivacyEngine
from clipbias.errors import ConfigError
from clipbias.integrations import rowtrace

N, D, K, B = 48, 5, 3, 16


def _data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, D, generator=g)
    return x, (x @ torch.randn(D, K, generator=g)).argmax(1)


def _make(opt="sgd", criterion=None, seed=None, model=None, batch_size=B, data=None):
    x, y = data if data is not None else _data()
    torch.manual_seed(0)
    m = model if model is not None else nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K))
    o = {"sgd": lambda: torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9),
         "adam": lambda: torch.optim.Adam(m.parameters(), lr=0.01),
         "rprop": lambda: torch.optim.Rprop(m.parameters(), lr=0.01, step_sizes=[1e-6, 50.0])}[opt]()
    pe = PrivacyEngine()
    kw = {"criterion": criterion} if criterion is not None else {}
    kw.update({"noise_seed": seed} if seed is not None else {})
    model, o, loader = pe.make_private(module=m, optimizer=o, data_loader=DataLoader(TensorDataset(x, y),
                                       batch_size=batch_size), noise_multiplier=1.0, max_grad_norm=1.0, **kw)
    return pe, m, model, o, loader


def _run(step, steps=3, **kw):
    """``step(model, m, opt, xb, yb, i)`` for ``steps`` batches; the report and the warnings given."""
    pe, m, model, opt, loader = _make(**kw)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for i, (xb, yb) in enumerate(loader):
            if i == steps:
                break
            step(model, m, opt, xb, yb, i)
    return pe.privacy_report(), [str(a.message) for a in w]


def _plain_step(model, m, opt, xb, yb, i):
    opt.zero_grad()
    F.cross_entropy(model(xb), yb).backward()
    opt.step()


# ---------------------------------------------------------------------------------------------- A1
@pytest.mark.parametrize("opt,entry", [("sgd", "momentum_buffer"), ("adam", "exp_avg")])
@pytest.mark.parametrize("criterion", [None, nn.CrossEntropyLoss()])
def test_a1_optimizer_state_written_from_the_batch_before_its_step_is_refused(opt, entry, criterion):
    """A momentum buffer or an Adam moment set from the batch between the draw and ``optimizer.step()`` (a
    tensor, no read): 2.3e4 to 2.4e6 times the bound, certified, before."""
    def step(model, m, o, xb, yb, i):
        o.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        if i == 1:  # (Adam's state exists from the first step on)
            for p in m.parameters():
                o.state[p][entry] = loss.detach() * 100 * torch.ones_like(p)
        o.step()
    with pytest.raises(ConfigError, match=f"optimizer's state \\({entry}\\) changed after"):  # (criterion: its step
        # was taken in the forward, so the write comes after it)
        _run(step, opt=opt, criterion=criterion)


@pytest.mark.parametrize("criterion", [None, nn.CrossEntropyLoss()])
def test_a1_optimizer_state_written_between_steps_is_refused(criterion):
    """Written in place after ``optimizer.step()`` (``exp_avg.add_``: a value of the stepped batch carried into
    the next update): refused at the next step, and at every later one (the state now holds it)."""
    def step(model, m, o, xb, yb, i):
        _plain_step(model, m, o, xb, yb, i)
        if i == 0:
            with torch.no_grad():
                for p in m.parameters():
                    o.state[p]["exp_avg"].add_(xb.detach().abs().amax().as_subclass(torch.Tensor))
    with pytest.raises(ConfigError, match="optimizer's state \\(exp_avg\\) changed after the last private step"):
        _run(step, opt="adam", criterion=criterion)


@pytest.mark.parametrize("opt", ["sgd", "adam"])
@pytest.mark.parametrize("criterion", [None, nn.CrossEntropyLoss()])
def test_a1_state_the_step_itself_writes_stays_certified(opt, criterion):
    """Momentum and Adam's moments updated by the optimizer's own step, a scheduler stepped after it and the
    optimizer's state read (``state_dict``, a checkpoint) between steps: certified."""
    pe, m, model, o, loader = _make(opt=opt, criterion=criterion)
    sched = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9)
    for i, (xb, yb) in enumerate(loader):
        _plain_step(model, m, o, xb, yb, i)
        sched.step()
        o.state_dict()
    assert pe.steps == 3
    assert pe.privacy_report().certified


def test_a1_a_loaded_optimizer_state_is_not_a_write():
    """``optimizer.load_state_dict`` between steps (a resumed run) is the state the next draw starts from."""
    pe, m, model, o, loader = _make(opt="adam")
    saved = None
    for i, (xb, yb) in enumerate(loader):
        _plain_step(model, m, o, xb, yb, i)
        if i == 0:
            saved = copy.deepcopy(o.state_dict())
        if i == 1:
            o.load_state_dict(saved)
    assert pe.privacy_report().certified


# ---------------------------------------------------------------------------------------------- A6
def test_a6_a_parameter_written_from_the_batch_after_the_step_is_refused():
    """``m[0].bias.sub_(xb.abs().amax())`` after ``optimizer.step()``: 22,572 times the bound, certified, before."""
    def step(model, m, o, xb, yb, i):
        _plain_step(model, m, o, xb, yb, i)
        with torch.no_grad():
            m[0].bias.sub_(xb.abs().amax())
    with pytest.raises(ConfigError, match="would write a value computed from the private batch into the model.s "
                                          "parameters"):
        _run(step)


@pytest.mark.parametrize("how", ["data copy_", "setitem"])
def test_a6_other_writes_of_the_batch_into_parameters_are_refused(how):
    def step(model, m, o, xb, yb, i):
        _plain_step(model, m, o, xb, yb, i)
        with torch.no_grad():
            if how == "data copy_":
                m[0].bias.data.copy_(xb[0, :1].expand(8))
            else:
                m[0].bias[:1] = xb[0, :1]
    with pytest.raises(ConfigError, match="write a value computed from the private batch"):
        _run(step)


def test_a6_a_parameter_written_after_a_read_of_the_stepped_batch_is_uncertified():
    """A value of the stepped batch read out of torch (``.item()``), then written into a parameter: the next
    step is unproven, the run uncertified, the warning names the write."""
    def step(model, m, o, xb, yb, i):
        _plain_step(model, m, o, xb, yb, i)
        v = xb.abs().amax().item()
        with torch.no_grad():
            m[0].bias.sub_(v)
    report, said = _run(step)
    assert not report.certified
    assert any("could not be proved" in c for c in report.caveats)
    assert any("parameters changed between steps" in s for s in said)


def test_a6_weight_clipping_and_renormalising_between_steps_stay_certified():
    """WGAN's ``p.clamp_(-c, c)`` and an embedding's renormalisation after each step (constants and the
    parameters alone), with the loss logged after them: certified."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(D, 8)
            self.out = nn.Linear(8, K)

        def forward(self, x):
            return self.out(torch.tanh(self.emb(x)))
    losses = []

    def step(model, m, o, xb, yb, i):
        o.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        o.step()
        with torch.no_grad():
            for p in m.parameters():
                p.clamp_(-0.5, 0.5)
            m.emb.weight.data.renorm_(2, 0, 1.0)
        losses.append(loss.item())
    report, said = _run(step, model=Net())
    assert report.certified, (report.caveats, said)
    assert len(losses) == 3


# ---------------------------------------------------------------------------------------------- A3
def test_a3_a_batch_looked_at_and_left_with_the_iterator_alive_counts_as_passed_over():
    """``it = iter(loader); xb = next(it); break`` with ``it`` kept: the looked-at batch counts at the report."""
    pe, m, model, o, loader = _make(criterion=nn.CrossEntropyLoss())
    it = iter(loader)
    xb, yb = next(it)
    _plain_step(model, m, o, xb, yb, 0)
    xb, yb = next(it)  # looked at (an outlier?), and left without a step
    report = pe.privacy_report()
    assert not report.certified
    assert any("passed over" in c for c in report.caveats)
    assert it is not None


def test_a3_stopping_right_after_a_step_with_the_iterator_alive_stays_certified():
    pe, m, model, o, loader = _make(criterion=nn.CrossEntropyLoss())
    it = iter(loader)
    for i in range(2):
        xb, yb = next(it)
        _plain_step(model, m, o, xb, yb, i)
    report = pe.privacy_report()
    assert report.certified and pe.steps == 2
    assert it is not None


def test_a3_a_report_before_the_step_on_a_batch_is_settled_by_the_step():
    """A report (``get_epsilon``, a print) between the draw and the step says passed over; the step on the batch
    settles it."""
    pe, m, model, o, loader = _make()
    for i, (xb, yb) in enumerate(loader):
        o.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        assert not pe.privacy_report().certified
        o.step()
        assert pe.privacy_report().certified


# ---------------------------------------------------------------------------------------------- A5
def test_a5_a_list_setting_edited_in_place_before_the_step_is_refused():
    """Rprop's ``step_sizes[1] = 0`` in place after the draw (a learning rate of 0 chosen on the batch)."""
    def step(model, m, o, xb, yb, i):
        o.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        o.param_groups[0]["step_sizes"][1] = 0.0
        o.step()
    with pytest.raises(ConfigError, match="step_sizes changed after the private data loader drew this batch"):
        _run(step, opt="rprop", criterion=nn.CrossEntropyLoss())


def test_a5_rprop_untouched_stays_certified():
    report, _ = _run(_plain_step, opt="rprop", criterion=nn.CrossEntropyLoss())
    assert report.certified


# ---------------------------------------------------------------------------------------------- A4
def test_a4_copy_copy_of_the_batch_stays_traced():
    pe, m, model, o, loader = _make()
    for xb, yb in loader:
        c = copy.copy(xb)
        assert rowtrace.label_of(c) is not None and rowtrace.label_of(c).kind == rowtrace.ROWS
        with pytest.raises(ConfigError, match="not one row per example"):
            model(clipbias.public(torch.zeros_like(xb)) + c)
        break


@pytest.mark.parametrize("how", ["asarray", "nested", "apply_"])
def test_a4_public_data_combined_with_an_untraced_copy_is_uncertified(how):
    """``model(clipbias.public(z) + torch.asarray(xb, copy=True))`` (nested, values copied in an ``apply_``
    callback): 1,628 times the bound, certified, before; now the step is unproven."""
    def untraced(xb):
        if how == "asarray":
            return torch.asarray(xb, copy=True)
        if how == "nested":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return torch.nested.nested_tensor([xb]).unbind()[0]
        vals = []
        xb.clone().apply_(lambda v: vals.append(v) or v)
        return torch.tensor(vals).view(xb.shape)

    def step(model, m, o, xb, yb, i):
        o.zero_grad()
        z = clipbias.public(torch.randn(len(xb), D, generator=torch.Generator().manual_seed(5)))
        fake = z + untraced(xb)
        (F.cross_entropy(model(xb), yb) + F.cross_entropy(model(fake), torch.zeros(len(xb), dtype=torch.long))
         ).backward()
        o.step()
    report, said = _run(step, steps=1)
    assert not report.certified
    assert any("could not be proved" in c for c in report.caveats)


def test_a4_pickling_the_batch_is_a_read():
    pe, m, model, o, loader = _make()
    for xb, yb in loader:
        pickle.dumps(xb)
        assert rowtrace.label_of(xb).rows.escaped is not None
        break


def test_a4_declared_public_data_and_its_public_noise_stay_certified():
    def step(model, m, o, xb, yb, i):
        o.zero_grad()
        z = clipbias.public(torch.randn(len(xb), D, generator=torch.Generator().manual_seed(5)))
        fake = z + 0.1 * torch.randn_like(z) + clipbias.public(torch.ones(D))
        (F.cross_entropy(model(xb), yb) + F.cross_entropy(model(fake), torch.zeros(len(xb), dtype=torch.long))
         ).backward()
        o.step()
    report, said = _run(step)
    assert report.certified, (report.caveats, said)


# ---------------------------------------------------------------------------------------------- A7
def test_a7_outputs_of_a_call_on_the_stepped_batch_stay_that_batchs():
    """``h = model(xb)`` after ``optimizer.step()``, then ``model(public(z) + h)`` in the next step: 101 times
    the bound, certified, before (the outputs came back untraced)."""
    h = None

    def step(model, m, o, xb, yb, i):
        nonlocal h
        o.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        if h is not None:
            z = clipbias.public(torch.randn(len(h), K, generator=torch.Generator().manual_seed(5)))
            loss = loss + F.cross_entropy(model(F.pad(z + h, (0, D - K))), torch.zeros(len(h), dtype=torch.long))
        loss.backward()
        o.step()
        with torch.no_grad():
            h = model(xb)
        assert rowtrace.label_of(h) is not None and rowtrace.label_of(h).kind == rowtrace.ROWS
    with pytest.raises(ConfigError, match="a value of a batch already stepped on"):
        _run(step)


def test_a7_accuracy_after_the_step_stays_certified():
    accuracy = []

    def step(model, m, o, xb, yb, i):
        _plain_step(model, m, o, xb, yb, i)
        model.eval()
        with torch.no_grad():
            accuracy.append(float((model(xb).argmax(1) == yb).float().mean()))
        model.train()
    report, said = _run(step)
    assert report.certified, (report.caveats, said)
    assert len(accuracy) == 3


# ---------------------------------------------------------------------------------------------- A8
def test_a8_the_loops_forward_draws_the_steps_keyed_dropout_masks():
    """Dropout in the loop's own forward (no ``criterion``): keyed per example by the run's key, never from torch's
    global generator (whose draws go by batch position: 10 times the add/remove bound at B = 256, certified,
    before): the global generator does not move, and the trained weights do not depend on its seed."""
    def train(public_seed, seed=11):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, K))
        pe, m, model, o, loader = _make(model=m, seed=seed)
        torch.manual_seed(public_seed)
        for i, (xb, yb) in enumerate(loader):
            before = torch.get_rng_state()
            out = model(xb)
            assert torch.equal(before, torch.get_rng_state())
            o.zero_grad()
            F.cross_entropy(out, yb).backward()
            o.step()
            if i == 1:
                break
        assert pe.privacy_report().certified is (seed is None)
        return torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    torch.testing.assert_close(train(1), train(2))  # (the same noise seed: the same masks and noise)
    train(3, seed=None)


# ---------------------------------------------------------------------------------------------- A9
class _Seqs(Dataset):
    def __init__(self, n=16, long=False):
        g = torch.Generator().manual_seed(1)
        self.seqs = [torch.randint(1, 12, (int(torch.randint(3, 6, (1,), generator=g)),), generator=g)
                     for _ in range(n)]
        if long:
            self.seqs[0] = torch.randint(1, 12, (20,), generator=g)

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.seqs[i], int(self.seqs[i].sum()) % 2


def _collate(items):
    longest = max(len(s) for s, _ in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for r, (s, _) in enumerate(items):
        ids[r, :len(s)], mask[r, :len(s)] = s, 1
    return {"input_ids": ids, "attention_mask": mask}, torch.tensor([label for _, label in items])


class _LastStep(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.rnn, self.out = nn.Embedding(12, 8), nn.GRU(8, 8, batch_first=True), nn.Linear(8, 2)

    def forward(self, input_ids, attention_mask=None):
        return self.out(self.rnn(self.emb(input_ids))[0][:, -1])  # the last time step: the padding's


class _Pooled(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(12, 8), nn.Linear(8, 2)

    def forward(self, input_ids):
        return self.out((self.emb(input_ids) * (input_ids != 0).unsqueeze(-1)).sum(1))  # (the padding masked)


@pytest.mark.parametrize("model,certified", [(_LastStep, False), (_Pooled, True)])
def test_a9_a_positional_call_on_a_padded_dict_batch_is_probed(model, certified):
    """``model(inputs["input_ids"])`` on a right-padded dict batch: the padding probe matches the call's tensor to
    the dict's entry; a GRU reading the last (padded) step is reported, a model that ignores padding is not."""
    m = model()
    pe = PrivacyEngine()
    net, o, loader = pe.make_private(module=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1),
                                     data_loader=DataLoader(_Seqs(long=True), batch_size=16, collate_fn=_collate),
                                     noise_multiplier=1.0, max_grad_norm=1.0, grad_path="rows")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):  # (the probe's example is drawn in secret: the long one, unpadded, 1 time in 16)
            for inputs, y in loader:
                o.zero_grad()
                F.cross_entropy(net(inputs["input_ids"]), y).backward()
                o.step()
    report = pe.privacy_report()
    assert report.certified is certified, report.caveats
    if not certified:
        assert any("differed with and without the batch's padding" in c for c in report.caveats)


# ---------------------------------------------------------------------------------------------- A1, Lightning
L = pytest.importorskip("lightning")
from clipbias.integrations.lightning import DPCallback  # noqa: E402


class _Lit(L.LightningModule):
    def __init__(self, inject: bool, opt: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.inject, self.opt = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K)), inject, opt

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.inject and batch_idx == 1:  # (a statistic of the batch, a tensor: no read)
            opt = self.trainer.optimizers[0]
            opt = getattr(opt, "original_optimizer", opt)
            for p in self.parameters():
                opt.state[p]["momentum_buffer"] = x.abs().amax().float().as_subclass(torch.Tensor) * torch.ones_like(p)
        return loss

    def configure_optimizers(self):
        if self.opt == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _lit_fit(module) -> DPCallback:
    dp = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0)
    x, y = _data()
    L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[dp]).fit(module, DataLoader(TensorDataset(x, y), batch_size=B))
    return dp


def test_a1_lightning_training_step_writing_the_optimizers_state_is_refused():
    """``training_step`` writing ``self.trainer.optimizers[0]``'s momentum buffer: 1.46e4 times the honest
    shift, certified, before."""
    with pytest.raises(ConfigError, match="optimizer's state \\(momentum_buffer\\) changed"):
        _lit_fit(_Lit(inject=True, opt="sgd"))


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_a1_lightning_momentum_and_adam_stay_certified(opt):
    """Several batches an epoch (Lightning fetches the next batch before the step), two epochs: certified."""
    dp = _lit_fit(_Lit(inject=False, opt=opt))
    report = dp.privacy_report()
    assert report.certified, report.caveats
    assert dp.engine.steps_taken == 2 * (N // B)
