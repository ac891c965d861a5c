"""Poisson sampling over map-style Datasets (``clipbias.sampling.loader``): the same batches and weights as
in-memory tensors, with DataLoader workers, structured (dict/tuple) batches, empty batches,
per-example loss functions, exact resume with batches drawn ahead, and refusals."""

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine, run_steps
from clipbias.errors import ConfigError
from clipbias.sampling.loader import PoissonLoader, TensorData, split

N, D, K = 60, 5, 3


def data(n=N):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, D, generator=g), torch.randint(0, K, (n,), generator=g)


class Pairs(Dataset):
    """A plain map-style dataset: item i is (x_i, y_i), fetched one by one (no __getitems__)."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Dicts(Pairs):
    """Items are dicts: two input tensors and the label under "labels" (the Hugging Face convention)."""

    def __getitem__(self, i):
        return {"a": self.x[i, :2], "b": self.x[i, 2:], "labels": self.y[i]}


class TwoInputs(nn.Module):
    """model(a=..., b=...): the same function as Linear(D, K) on cat(a, b)."""

    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, a, b):
        return self.lin(torch.cat([a, b], dim=1))


def linear():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K))


def engine(model, algo="dpsgd", n=N, batch_size=12.0, epochs=2, **kw):
    return DPEngine(model, algo, n=n, batch_size=batch_size, epochs=epochs, noise_multiplier=1.0,
                    config=AlgoConfig(lr=0.5, clip=1.0), noise_seed=7, **kw)


def weights(m):
    return torch.cat([p.detach().flatten() for p in m.parameters()])


@pytest.mark.parametrize("algo", ["dpsgd", "dice"])
@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_equals_in_memory_bit_for_bit(algo, workers):
    """The engine's sampler picks the batches either way; DataLoader workers prefetch batches drawn
    ahead without changing them: the same weights, bit for bit, and the same epsilon."""
    x, y = data()
    ref = engine(linear(), algo)
    for _ in range(2):
        ref.train_epoch(x, y)
    eng = engine(linear(), algo)
    for _ in range(2):
        eng.train_epoch(Pairs(x, y), num_workers=workers)
    assert eng.steps_taken == ref.steps_taken == 10
    assert torch.equal(weights(eng.model), weights(ref.model))
    assert eng.privacy().epsilon == ref.privacy().epsilon


def test_dict_batches_call_the_model_with_keywords():
    """Dict items {"a", "b", "labels"}: the model is called model(a=..., b=...), the labels split
    off; the result equals the tensor model on the concatenated inputs (same batches, same noise)."""
    x, y = data()
    ref = engine(linear())
    ref.train_epoch(x, y)
    eng = engine(TwoInputs(linear()))
    eng.train_epoch(Dicts(x, y))
    assert torch.allclose(weights(eng.model), weights(ref.model), atol=1e-6)


def test_tuple_inputs_and_in_memory_structures():
    """In-memory structured inputs ((a, b) tuples of tensors) go through the same loop."""
    x, y = data()
    ref = engine(linear())
    ref.train_epoch(x, y)
    eng = engine(TwoInputs(linear()))  # called model(a, b) with the tuple's tensors
    eng.train_epoch((x[:, :2], x[:, 2:]), y)
    assert torch.allclose(weights(eng.model), weights(ref.model), atol=1e-6)


def test_empty_batches_are_noise_only_steps():
    """q = 1/60 with Poisson sampling: many steps have no example. The dataset path builds an empty
    batch of the right structure without fetching anything, and the step adds noise only."""
    x, y = data()
    eng = engine(TwoInputs(linear()), batch_size=1.0, epochs=1)
    loader = PoissonLoader(eng, Dicts(x, y))
    sizes = []
    for xb, yb, idx in loader.epoch():
        before = weights(eng.model).clone()
        eng.step(xb, yb, idx)
        sizes.append(len(idx))
        if len(idx) == 0:
            assert set(xb) == {"a", "b"} and xb["a"].shape == (0, 2) and yb.shape == (0,)
            assert eng.last_loss == (0.0, 0) and not torch.equal(weights(eng.model), before)  # noise moved it
    assert eng.steps_taken == 60 and sizes.count(0) >= 10  # P(empty) = (59/60)^60 ~ 0.37


def per_example_ce(out, y):
    """A loss that returns the per-example losses ([b]) rather than their sum."""
    return nn.functional.cross_entropy(out, y, reduction="none")


@pytest.mark.parametrize("grad_path", ["rows", "fast"])
def test_a_loss_returning_per_example_losses_equals_the_summed_loss(grad_path):
    x, y = data()
    ref = engine(linear(), grad_path=grad_path)
    ref.train_epoch(x, y)
    eng = engine(linear(), grad_path=grad_path, loss_fn=per_example_ce)
    losses = eng.step(x[:9], y[:9], torch.arange(9))
    assert torch.allclose(losses, per_example_ce(linear()(x[:9]), y[:9]), atol=1e-6)
    eng = engine(linear(), grad_path=grad_path, loss_fn=per_example_ce)
    eng.train_epoch(x, y)
    assert torch.allclose(weights(eng.model), weights(ref.model), atol=1e-6)


def test_resume_with_batches_drawn_ahead_is_exact():
    """Workers prefetch: batches are drawn before the steps that use them. Interrupted mid-epoch,
    the checkpoint holds the drawn-but-unused batches and the resumed run ends at the weights of an
    uninterrupted one."""
    x, y = data()
    ref = engine(linear(), "dice")
    for _ in range(2):
        ref.train_epoch(Pairs(x, y), num_workers=2)

    eng = engine(linear(), "dice")
    loader = PoissonLoader(eng, Pairs(x, y), num_workers=2, prefetch_factor=2)
    for t, (xb, yb, idx) in enumerate(loader.epoch()):
        eng.step(xb, yb, idx)
        if t == 1:
            break  # the workers had fetched up to 4 batches ahead
    state, model_state = eng.state_dict(), {k: v.clone() for k, v in eng.model.state_dict().items()}
    assert len(state["sampler"]["ahead"]) > 0

    res = engine(linear(), "dice")
    res.model.load_state_dict(model_state)
    res.load_state_dict(state)
    res.train_epoch(Pairs(x, y), num_workers=2)  # the rest of epoch 1 ...
    res.train_epoch(Pairs(x, y), num_workers=0)  # ... and epoch 2 (3 + 5 steps)
    assert res.steps_taken == 10
    assert torch.equal(weights(res.model), weights(ref.model))


def test_refusals():
    x, y = data()
    eng = engine(linear())
    with pytest.raises(ConfigError, match="n=60"):
        PoissonLoader(eng, Pairs(x[:50], y[:50]))
    with pytest.raises(ConfigError, match="workers"):
        PoissonLoader(eng, Pairs(x, y), num_workers=-1)
    with pytest.raises(ConfigError, match="map-style"):
        PoissonLoader(eng, [1, 2, 3] and object())
    with pytest.raises(ConfigError, match="labels"):
        split({"input_ids": torch.zeros(2, 3)})
    with pytest.raises(ConfigError, match="num_workers.*building the PoissonLoader"):
        eng.train_epoch(PoissonLoader(eng, Pairs(x, y)), num_workers=2)  # not silently ignored


def test_a_loader_serves_only_its_own_engine():
    """Red-team finding: engine B stepping on a loader built for engine A would take A's Poisson
    samples (A's rate, A's secret sampler) while accounting at B's rate. Refused, nothing stepped."""
    x, y = data()
    a, b = engine(linear(), batch_size=float(N)), engine(linear(), batch_size=3.0)
    foreign = PoissonLoader(a, Pairs(x, y))
    before = weights(b.model).clone()
    with pytest.raises(ConfigError, match="another engine"):
        b.train_epoch(foreign)
    with pytest.raises(ConfigError, match="another engine"):
        run_steps(b, foreign, steps=3)
    assert b.steps_taken == a.steps_taken == 0 and torch.equal(weights(b.model), before)


def test_the_empty_batch_template_keeps_no_example_values():
    """The zero-row batch of a noise-only step has the dataset's structure in fresh storage: no
    value of example 0 (read once for its shapes) travels with it to the workers."""
    x, y = data()
    loader = PoissonLoader(engine(TwoInputs(linear())), Dicts(x, y))
    t = loader.fetch.template
    assert set(t) == {"a", "b", "labels"} and t["a"].shape == (0, 2) and t["labels"].dtype == y.dtype
    assert all(v.untyped_storage().nbytes() == 0 for v in t.values())
    with pytest.raises(ConfigError, match="one row per example"):
        TensorData({"a": torch.zeros(3, 2), "b": torch.zeros(4, 2)}, torch.zeros(3))
    # an image-only method refuses structured batches by name
    aug = DPEngine(linear(), "self-aug", n=N, batch_size=12.0, epochs=1, noise_multiplier=1.0,
                   config=AlgoConfig(lr=0.5, clip=1.0))
    with pytest.raises(ConfigError, match="self-aug.*tensor"):
        aug.step({"a": x[:3]}, y[:3], torch.arange(3))


def test_frozen_parameters_get_no_per_example_gradients():
    """Only trainable parameters are in the rows (a frozen base, LoRA-style): the frozen layer keeps
    its weights bit for bit and the rows have the trainable dimension only."""
    x, y = data()
    m = linear()
    m[0].requires_grad_(False)
    frozen = m[0].weight.detach().clone()
    eng = engine(m)
    assert eng.rows.layout.dim == 8 * K + K
    eng.train_epoch(Pairs(x, y))
    assert torch.equal(m[0].weight, frozen) and m[0].weight.grad is None
    assert not torch.equal(m[2].weight, linear()[2].weight)


def test_tensor_data_items_are_single_examples():
    """TensorData is an ordinary map-style dataset too: item i is one example (no batch dimension), so
    torch's default_collate rebuilds the batch its batched fetch returns."""
    from torch.utils.data import default_collate
    x, y = data()
    d = TensorData({"a": x[:, :2], "b": x[:, 2:]}, y)
    xi, yi = d[3]
    assert xi["a"].shape == (2,) and torch.equal(xi["b"], x[3, 2:]) and yi.dim() == 0
    idx = torch.tensor([4, 0, 7])
    bx, by = default_collate([d[int(i)] for i in idx])
    fx, fy = d.fetch(idx)
    assert torch.equal(bx["a"], fx["a"]) and torch.equal(bx["b"], fx["b"]) and torch.equal(by, fy)
