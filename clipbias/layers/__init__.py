"""Opacus's recurrent layers under their Opacus names, so that a script importing them runs with its imports
changed (``from clipbias.layers import DPLSTM``, was ``from opacus.layers import DPLSTM``).

Opacus re-implements these cells out of linear layers so that its hooks see each example's gradient. clipbias
computes per-example gradients of torch's own ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` (the rows path,
``torch.func``; each example alone where ``vmap``'s batched rule for the layer fails: tests/test_recurrent.py),
so these are torch's layers: the same constructor arguments and the same ``forward(input, hx=None)``. Their
``state_dict`` keys are torch's (``weight_ih_l0``, ...), not Opacus's renamed ones, so an Opacus checkpoint of a
``DPLSTM`` does not load into them. Build them with ``batch_first=True`` (``ModuleValidator`` says why).
"""

from __future__ import annotations

from torch import nn

__all__ = ["DPGRU", "DPLSTM", "DPRNN"]


class DPLSTM(nn.LSTM):
    """``torch.nn.LSTM`` under Opacus's name (see the module's docstring).

    Its arguments are ``torch.nn.LSTM``'s (its constructor is torch's, unchanged): ``input_size``,
    ``hidden_size``, ``num_layers``, ``bias``, ``batch_first`` (give True: each row of the input is then one
    example), ``dropout``, ``bidirectional``, ``proj_size``, ``device``, ``dtype``.
    """


class DPGRU(nn.GRU):
    """``torch.nn.GRU`` under Opacus's name (see the module's docstring).

    Its arguments are ``torch.nn.GRU``'s (its constructor is torch's, unchanged): ``input_size``,
    ``hidden_size``, ``num_layers``, ``bias``, ``batch_first`` (give True: each row of the input is then one
    example), ``dropout``, ``bidirectional``, ``device``, ``dtype``.
    """


class DPRNN(nn.RNN):
    """``torch.nn.RNN`` under Opacus's name (see the module's docstring).

    Its arguments are ``torch.nn.RNN``'s (its constructor is torch's, unchanged): ``input_size``,
    ``hidden_size``, ``num_layers``, ``nonlinearity`` (``"tanh"`` or ``"relu"``), ``bias``, ``batch_first``
    (give True: each row of the input is then one example), ``dropout``, ``bidirectional``, ``device``,
    ``dtype``.
    """
