"""``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` trained privately on the rows path (Opacus needs its ``DPLSTM``
layers for this): where ``torch.func.vmap`` fails on a recurrent layer's batched rule (GRU and RNN, a shape
error), each example is computed alone, and the per-example gradients equal autograd's, example by example."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from clipbias.config import AlgoConfig
from clipbias.engine import DPEngine
from clipbias.grads.rows import FuncGradients


class Net(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.rnn, self.head = cell(3, 5, batch_first=True), nn.Linear(5, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


@pytest.mark.parametrize("cell", [nn.RNN, nn.GRU, nn.LSTM])
def test_per_example_gradients_of_recurrent_layers_equal_autograd(cell):
    torch.manual_seed(0)
    model = Net(cell)
    x, y = torch.randn(6, 4, 3), torch.randint(0, 2, (6,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows, _ = FuncGradients(model)(x, y)
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1], reduction="sum").backward()
        want = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        assert torch.allclose(rows[i], want, atol=1e-6), i


@pytest.mark.parametrize("cell", [nn.RNN, nn.GRU, nn.LSTM])
def test_recurrent_models_train_privately_and_stay_certified(cell):
    torch.manual_seed(0)
    eng = DPEngine(Net(cell), "dpsgd", n=32, batch_size=8, steps=3, noise_multiplier=1.0,
                   config=AlgoConfig(lr=0.1, clip=1.0), grad_path="auto")
    x, y = torch.randn(32, 4, 3), torch.randint(0, 2, (32,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3):
            idx = eng.sampler.sample()
            eng.step(x[idx], y[idx], idx)
    assert eng.steps_taken == 3 and eng.privacy().certified


def test_opacus_layer_names_are_torchs_layers_and_train_through_the_opacus_interface():
    """``from clipbias.layers import DPLSTM`` (was ``from opacus.layers import DPLSTM``): torch's LSTM under Opacus's
    name, trained privately through ``PrivacyEngine`` with the loop unchanged."""
    from torch.utils.data import DataLoader, TensorDataset

    from clipbias import PrivacyEngine
    from clipbias.layers import DPGRU, DPLSTM, DPRNN
    assert issubclass(DPLSTM, nn.LSTM) and issubclass(DPGRU, nn.GRU) and issubclass(DPRNN, nn.RNN)

    class CharNet(nn.Module):  # the shape of Opacus's char-LSTM classifier
        def __init__(self):
            super().__init__()
            self.emb, self.lstm, self.out = nn.Embedding(20, 8), DPLSTM(8, 6, num_layers=2, batch_first=True), \
                nn.Linear(6, 3)

        def forward(self, x):
            h, _ = self.lstm(self.emb(x))
            return self.out(h[:, -1])

    torch.manual_seed(0)
    model = CharNet()
    x, y = torch.randint(0, 20, (64, 7)), torch.randint(0, 3, (64,))
    pe = PrivacyEngine()
    m, opt, loader = pe.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                     data_loader=DataLoader(TensorDataset(x, y), batch_size=16),
                                     noise_multiplier=1.0, max_grad_norm=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(m(xb), yb).backward()
            opt.step()
    assert pe.steps == len(loader) and pe.privacy_report().certified
