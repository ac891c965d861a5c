"""The step's guard at every door (issue "one guard at every door"): model state written by a forward on the
private batch is refused on both gradient paths and through every integration, and the left-padding guard
sees dropout drawn by any operator (``F.dropout`` in the model's own code as OPT's), not a list of module
types. Each case printed ``certified: true`` before the guard."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from clipbias.config import AlgoConfig
from clipbias.engine import DPEngine
from clipbias.errors import ConfigError


class Writer(nn.Module):
    """A linear model whose forward writes a statistic of the batch into its own state, in one of many ways."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.count = how, 0
        self.lin = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.ones(()), requires_grad=False)  # frozen: in state_dict, released
        self.unused = nn.Parameter(torch.zeros(()), requires_grad=False)  # written, never read: no mixing
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        how = self.how
        with torch.no_grad():
            top = x.detach().abs().amax() if x.numel() else x.new_zeros(())  # a Poisson batch may be empty
            if how == "frozen copy_":
                self.scale.copy_(torch.maximum(self.scale, top))
            elif how == "frozen .data.copy_":
                self.scale.data.copy_(torch.maximum(self.scale.data, top))
            elif how == "frozen .data =":
                self.scale.data = torch.maximum(self.scale.data, top)
            elif how == "frozen numpy":
                self.scale.numpy()[...] = float(top)
            elif how == "trainable .data":
                self.lin.bias.data[0] = top
            elif how == "buffer .data":
                self.seen.data.add_(top)
            elif how == "tensor attribute":
                self.last = top.clone()
            elif how == "number attribute":
                self.count += x.shape[0]
            elif how == "unused .data":
                self.unused.data.fill_(float(x.shape[0]))  # the batch size, which is secret
            elif how == "unused numpy":
                self.unused.numpy()[...] = float(x.shape[0])
        return self.lin(x / self.scale)


WRITES = ["frozen copy_", "frozen .data.copy_", "frozen .data =", "frozen numpy", "trainable .data", "buffer .data",
          "tensor attribute", "number attribute", "unused .data", "unused numpy"]


def _engine(model, n=32, path="rows", steps=4, **kw):
    return DPEngine(model, "dpsgd", n=n, batch_size=8, steps=steps, noise_multiplier=1.0,
                    config=AlgoConfig(lr=0.1, clip=1.0), grad_path=path, **kw)


@pytest.mark.parametrize("path", ["rows", "fast"])
@pytest.mark.parametrize("how", WRITES)
def test_a_forward_that_writes_model_state_is_refused_on_both_paths(how, path):
    torch.manual_seed(0)
    model = Writer(how)
    eng = _engine(model, path=path)
    x, y = torch.randn(32, 4) * 3, torch.randint(0, 3, (32,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    idx = eng.sampler.sample()
    # (where the step fails for another reason first, that error stands: a scaler that divides by the batch's
    # maximum also lets the examples see each other, which the fast path's probe refuses)
    with pytest.raises(ConfigError, match="state changed on the private batch|per-example gradients failed|see each other"):
        eng.step(x[idx], y[idx], idx)
    assert eng.steps_taken == 0  # nothing released, nothing accounted
    assert torch.equal(model.seen, before["seen"])  # buffers are put back
    assert torch.equal(model.lin.weight, before["lin.weight"])  # no update applied


def test_a_model_that_writes_nothing_still_trains_and_stays_certified():
    model = Writer("none")
    eng = _engine(model)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    for _ in range(2):
        idx = eng.sampler.sample()
        eng.step(x[idx], y[idx], idx)
    assert eng.steps_taken == 2 and eng.privacy().certified


def test_the_hash_sees_a_one_bit_write_through_numpy():
    """A write through ``.numpy()`` bumps no version counter and keeps the storage: only the keyed hash sees it,
    down to the last mantissa bit of one weight."""
    class OneBit(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.frozen = nn.Parameter(torch.randn(1000), requires_grad=False)

        def forward(self, x):
            if bool((x[:, 0] > 100).any()):  # the canary's presence, in the lowest bit of one frozen weight
                view = self.frozen.detach().numpy().view("int32")
                view[417] ^= 1
            return self.lin(x)

    model = OneBit()
    eng = _engine(model, path="fast", steps=200)
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    x[5, 0] = 1000.0
    with pytest.raises(ConfigError, match=r"state changed on the private batch.*\(parameter frozen\)"):
        for _ in range(200):  # until the canary is sampled (probability 1 - 0.75^200)
            idx = eng.sampler.sample()
            eng.step(x[idx], y[idx], idx)
    assert 5 in eng.sampler.sample().tolist()  # (the refused step's batch, given back for the retry)
    assert eng.sampler.skipped == 1 and not eng.privacy().certified  # (and the failure counted)


@pytest.mark.parametrize("path", ["rows", "auto"])
def test_embedding_max_norm_is_refused_and_listed(path):
    """``nn.Embedding(max_norm=1)`` renormalises the rows of the batch's tokens in place: released which tokens
    the batch held (epsilon lower bound 2.56 against a claim of 0.42 before)."""
    from clipbias import ModuleValidator

    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.lin = nn.Embedding(10, 4, max_norm=1.0), nn.Linear(4, 3)
            with torch.no_grad():
                self.emb.weight.mul_(10)

        def forward(self, x):
            return self.lin(self.emb(x).mean(1))

    model = Bag()
    problems = ModuleValidator.validate(model)
    assert len(problems) == 1 and "max_norm" in str(problems[0])
    eng = _engine(model, path=path)
    x, y = torch.randint(0, 10, (32, 5)), torch.randint(0, 3, (32,))
    idx = eng.sampler.sample()
    with pytest.raises(ConfigError, match=r"parameter emb\.weight"):
        eng.step(x[idx], y[idx], idx)


def _opacus_loop(model, x, y, steps=2):
    from clipbias import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    pe = PrivacyEngine()
    m, o, dl = pe.make_private(module=model, optimizer=opt, data_loader=DataLoader(TensorDataset(x, y), batch_size=8),
                               noise_multiplier=1.0, max_grad_norm=1.0)
    for i, (xb, yb) in enumerate(dl):
        o.zero_grad()
        F.cross_entropy(m(xb), yb).backward()
        o.step()
        if i + 1 >= steps:
            break
    return pe


@pytest.mark.parametrize("how", ["frozen copy_", "frozen .data =", "tensor attribute"])
def test_the_opacus_interface_refuses_state_writes(how):
    torch.manual_seed(0)
    with pytest.raises(ConfigError, match="state changed on the private batch"):
        _opacus_loop(Writer(how), torch.randn(64, 4) * 3, torch.randint(0, 3, (64,)))


def test_the_opacus_interface_still_trains_a_clean_model():
    pe = _opacus_loop(Writer("none"), torch.randn(64, 4), torch.randint(0, 3, (64,)))
    assert pe.steps == 2 and pe.privacy_report().certified


def _lightning_fit(module, steps: int = 2, scale: float = 1.0):
    """``Trainer.fit(module)`` under a ``DPCallback`` on 64 random examples (inputs times ``scale``) in batches of
    8, on the CPU, for ``steps`` steps; the callback."""
    L = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from clipbias.integrations.lightning import DPCallback
    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 4, generator=g) * scale, torch.randint(0, 3, (64,), generator=g)),
                      batch_size=8)
    cb = DPCallback(noise_multiplier=1.0, max_grad_norm=1.0)
    trainer = L.Trainer(max_steps=steps, callbacks=[cb], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data)
    return cb


def test_lightning_refuses_state_written_in_training_step():
    L = pytest.importorskip("lightning.pytorch")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Writer("frozen copy_")

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, _):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)

    with pytest.raises(ConfigError, match="state changed on the private batch"):
        _lightning_fit(Module(), scale=3.0)


class FunctionalDropout(nn.Module):
    """An encoder that applies dropout as BART, OPT and Marian do: ``F.dropout(p=config.dropout)``, no module."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p, self.emb, self.head = p, nn.Embedding(20, 8), nn.Linear(8, 3)

    def forward(self, input_ids, attention_mask):
        h = F.dropout(self.emb(input_ids), p=self.p, training=self.training)
        m = attention_mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp(min=1))


def _padded(left: bool, b: int = 32, L: int = 6):
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, L + 1, (b,), generator=g)
    ids = torch.randint(1, 20, (b, L), generator=g)
    pos = torch.arange(L).expand(b, L)
    mask = (pos >= L - lengths[:, None]) if left else (pos < lengths[:, None])
    return {"input_ids": ids * mask, "attention_mask": mask.long()}, torch.randint(0, 3, (b,), generator=g)


@pytest.mark.parametrize("path", ["rows", "fast"])
def test_left_padding_is_refused_when_the_model_calls_functional_dropout(path):
    x, y = _padded(left=True)
    eng = _engine(FunctionalDropout(0.1), path=path)
    idx = eng.sampler.sample()
    with pytest.raises(ConfigError, match="pads an example on the left"):
        eng.step({k: v[idx] for k, v in x.items()}, y[idx], idx)
    assert eng.steps_taken == 0


@pytest.mark.parametrize("left,p", [(False, 0.1), (True, 0.0)])
def test_right_padding_or_no_dropout_trains(left, p):
    x, y = _padded(left=left)
    eng = _engine(FunctionalDropout(p))
    idx = eng.sampler.sample()
    eng.step({k: v[idx] for k, v in x.items()}, y[idx], idx)
    assert eng.steps_taken == 1 and eng.privacy().certified


def test_a_tiny_opt_with_left_padding_is_refused():
    transformers = pytest.importorskip("transformers")
    from clipbias.integrations.transformers import causal_lm_loss
    cfg = transformers.OPTConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1, ffn_dim=16, num_attention_heads=2,
                                 max_position_embeddings=16, word_embed_proj_dim=8, dropout=0.1, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.OPTForCausalLM(cfg).train()
    x, _ = _padded(left=True, b=16)
    labels = x["input_ids"].masked_fill(x["attention_mask"] == 0, -100)
    eng = DPEngine(model, "dpsgd", n=16, batch_size=8, steps=4, noise_multiplier=1.0,
                   config=AlgoConfig(lr=0.1, clip=1.0), loss_fn=causal_lm_loss, grad_path="rows")
    idx = eng.sampler.sample()
    with pytest.raises(ConfigError, match="pads an example on the left"):
        eng.step({k: v[idx] for k, v in x.items()}, labels[idx], idx)



def _loop(loss_of, criterion=None, steps=3):
    from clipbias import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(96, 4), torch.randint(0, 3, (96,))
    pe = PrivacyEngine()
    m, o, dl = pe.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                               data_loader=DataLoader(TensorDataset(x, y), batch_size=16), noise_multiplier=1.0,
                               max_grad_norm=1.0, criterion=criterion)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i, (xb, yb) in enumerate(dl):
            o.zero_grad()
            loss_of(m(xb), yb).backward()
            o.step()
            if i + 1 >= steps:
                break
    return [str(w.message) for w in seen if "not `criterion`'s" in str(w.message)]


def test_the_loops_own_loss_is_held_against_criterion_and_a_difference_is_said():
    """With ``criterion`` given, the step differentiates it; a loop whose loss is another (label smoothing 0.3
    left the weights bit-identical to plain cross-entropy, in silence) gets a warning that says what is trained
    and how to train its loss; a loop whose loss is criterion's gets none, on the recorded and the eager path
    alike. Without ``criterion`` the loop's own loss is trained (tests/test_loop_loss.py): no warning."""
    ce = nn.CrossEntropyLoss()
    assert _loop(F.cross_entropy, criterion=ce) == []
    assert len(_loop(lambda out, y: F.cross_entropy(out, y, label_smoothing=0.3), criterion=ce)) == 1
    assert len(_loop(lambda out, y: F.cross_entropy(out, y) + 0.1 * out.pow(2).mean(), criterion=ce)) == 1
    summed = _loop(lambda out, y: F.cross_entropy(out, y, reduction="sum"), criterion=ce)
    assert len(summed) == 1 and "sum over the batch" in summed[0]
    assert _loop(lambda out, y: F.cross_entropy(out, y, label_smoothing=0.3)) == []
    smooth = nn.CrossEntropyLoss(label_smoothing=0.3)
    assert _loop(lambda out, y: smooth(out, y), criterion=smooth) == []


class RunningNorm(nn.Module):
    """An online input normaliser (RL and tabular code): buffers in ``state_dict``, updated from each batch."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(d))
        self.register_buffer("n", torch.zeros(()))

    @torch.no_grad()
    def update(self, x):
        self.n += len(x)
        self.mean += (x.sum(0) - len(x) * self.mean) / self.n

    def forward(self, x):
        return x - self.mean


def test_state_written_by_the_loop_before_the_step_is_refused():
    """The model is snapshotted when the private loader yields the batch and compared at the step: a buffer the
    loop updates from the batch outside the forward (``net.norm.update(xb)``) was released, certified."""
    from torch.utils.data import DataLoader, TensorDataset

    from clipbias import PrivacyEngine
    torch.manual_seed(0)
    net = nn.Sequential(RunningNorm(4), nn.Linear(4, 3))
    pe = PrivacyEngine()
    m, o, dl = pe.make_private(module=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                               data_loader=DataLoader(TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,))),
                                                      batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ConfigError, match=r"training loop \(buffer 0\.mean, buffer 0\.n\)"):
        for xb, yb in dl:
            net[0].update(xb)
            o.zero_grad()
            F.cross_entropy(m(xb), yb).backward()
            o.step()
    assert pe.steps == 0 and float(net[0].n) == 0  # restored


def test_lightning_a_batch_hook_that_writes_the_model_is_refused():
    L = pytest.importorskip("lightning.pytorch")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.norm, self.net = RunningNorm(4), nn.Linear(4, 3)

        def forward(self, x):
            return self.net(self.norm(x))

        def on_train_batch_start(self, batch, batch_idx):
            self.norm.update(batch[0])

        def training_step(self, batch, _):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(ConfigError, match=r"buffer norm\.mean"):
        _lightning_fit(Module())


@pytest.mark.parametrize("kind", ["dict number", "numpy in place", "deque", "backward hook .data"])
def test_state_in_containers_numpy_and_backward_hooks_is_refused(kind):
    """Numbers in a dict attribute, a numpy array written in place, a deque, and a buffer written through
    ``.data`` in a backward hook (no version counter, outside the watched forward) were certified."""
    import collections

    import numpy as np

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.d, self.hist, self.dq = {"max": 0.0}, np.zeros(3), collections.deque()
            self.register_buffer("gsq", torch.zeros(3))
            if kind == "backward hook .data":
                def hook(mod, gin, gout):
                    self.gsq.data.add_(gout[0].detach().pow(2).sum(0))
                self.lin.register_full_backward_hook(hook)

        def forward(self, x):
            top = float(x.detach().abs().amax()) if x.numel() else 0.0  # a Poisson batch may be empty
            if kind == "dict number":
                self.d["max"] = max(self.d["max"], top)
            elif kind == "numpy in place":
                self.hist += top
            elif kind == "deque":
                self.dq.append(top)
            return self.lin(x)

    eng = _engine(Net(), path="fast")
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    idx = eng.sampler.sample()
    with pytest.raises(ConfigError, match="state changed on the private batch"):
        eng.step(x[idx], y[idx], idx)


@pytest.mark.parametrize("case", ["user underscore attribute", "training_step_outputs"])
def test_lightning_own_attributes_are_skipped_and_a_users_are_not(case):
    """Only Lightning's own attributes of a LightningModule are skipped (a user's ``self._y_mean``, a running
    target mean the forward adds, was certified when every ``_`` name was skipped); the list its documentation
    has ``training_step`` append to for ``on_train_epoch_end`` is Lightning's pattern and trains."""
    L = pytest.importorskip("lightning.pytorch")

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net, self._y_mean, self.training_step_outputs = nn.Linear(4, 3), torch.zeros(3), []

        def forward(self, x):
            return self.net(x) + self._y_mean

        def training_step(self, batch, _):
            x, y = batch
            loss = F.cross_entropy(self(x), y)
            if case == "user underscore attribute":
                self._y_mean = 0.9 * self._y_mean + 0.1 * x[:, :3].mean(0).detach()
            else:
                self.training_step_outputs.append(loss.detach())
            return loss

        def on_train_epoch_end(self):
            self.training_step_outputs.clear()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    if case == "user underscore attribute":
        with pytest.raises(ConfigError, match=r"attribute _y_mean"):
            _lightning_fit(Module(), steps=3)
    else:
        cb = _lightning_fit(Module(), steps=3)
        assert cb.engine.steps_taken == 3 and cb.privacy_report().certified
