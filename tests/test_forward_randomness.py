"""Keyed forward randomness (clipbias.randomness.forward): dropout masks of the private step are a
function of the run's key, the step and the example's index; other random draws are refused."""

import random
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from clipbias.config import AlgoConfig
from clipbias.engine.core import DPEngine
from clipbias.errors import ConfigError
from clipbias.grads.rows import FuncGradients
from clipbias.randomness import Purpose, SecretKey, forward, stream
from clipbias.sampling.loader import PoissonLoader

KEY = SecretKey.from_seed(11)


def reference_masks(key: SecretKey, step: int, ids: list[int], shape, p: float = 0.5, call: int = 0) -> torch.Tensor:
    """Independent reading of the spec: example i keeps the element at coordinates c of dropout call
    ``call`` (per-example ``shape``; an int: one dimension) when word w(c) of its keystream at
    (FORWARD_CALL, step + 2^32 call, i) is below floor((1 - p) 2^32); w(c) is the row-major position
    for up to 2 dimensions, else Szudzik(c[-2], c[-1]) * prod(shape[:-2]) + row-major position of c[:-2]."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    t = int((1 - p) * 2 ** 32)
    lead = 1
    for d in shape[:-2]:
        lead *= d

    def word(c):
        if len(c) <= 2:
            return int(np.ravel_multi_index(c, shape)) if c else 0
        a, b = c[-2], c[-1]
        s = b * b + a if a < b else a * a + a + b
        return s * lead + (int(np.ravel_multi_index(c[:-2], shape[:-2])) if shape[:-2] else 0)

    where = [word(c) for c in np.ndindex(*shape)]
    n = max(where) + 1
    rows = []
    for i in ids:
        w = stream(key, Purpose.FORWARD_CALL, step + (call << 32), i, 4 * n).view("<u4")
        rows.append(torch.from_numpy((w[where] < t).copy()).view(shape))
    return torch.stack(rows)


def batched_masks(ids: list[int], m: int, step: int = 0, key: SecretKey = KEY) -> torch.Tensor:
    """The masks of a batched forward (the fast path's layout: row r is example ids[r])."""
    with forward.keyed(key, step), forward.examples(ids), forward.one_pass():
        return F.dropout(torch.ones(len(ids), m), 0.5) != 0


def rows_masks(ids: list[int], m: int, step: int = 0) -> torch.Tensor:
    """The masks of the rows path (one example per vmap call): the per-example gradient of
    sum(W dropout(1)) is mask / (1 - p)."""
    model = nn.Sequential(nn.Dropout(0.5), nn.Linear(m, 1, bias=False))
    fg = FuncGradients(model, lambda out, y: out.sum())
    with forward.keyed(KEY, step), forward.examples(ids):
        g, _ = fg(torch.ones(len(ids), m), torch.zeros(len(ids)))
    return g != 0


def test_masks_are_a_function_of_key_step_and_index_only():
    """Example 5's masks are the same at any position, beside any other examples, on the rows path
    and the batched path, and equal the keystream read independently; fresh at every step and
    different for every example."""
    m = 256
    want = reference_masks(KEY, 0, [5, 2, 9, 7], m)
    assert torch.equal(batched_masks([5, 2, 9], m), want[:3])
    assert torch.equal(batched_masks([7, 5], m), want[[3, 0]])
    assert torch.equal(rows_masks([9, 5], m), want[[2, 0]])
    assert torch.equal(rows_masks([5, 5], m)[1], want[0])  # a counterfactual batch of copies: the example's masks
    other_step, other_key = batched_masks([5], m, step=1)[0], batched_masks([5], m, key=SecretKey.from_seed(12))[0]
    for other in (other_step, other_key, want[1]):
        assert 0.3 < (other != want[0]).float().mean() < 0.7  # independent bits differ in about half the places
    assert 0.4 < want.float().mean() < 0.6


@pytest.mark.parametrize("fn,shape,alpha", [
    (F.dropout, (3, 4, 5), False), (nn.Dropout(0.5), (3, 4, 5), False), (F.dropout1d, (3, 4, 5), False),
    (F.dropout2d, (3, 4, 5, 2), False), (F.dropout3d, (3, 4, 2, 2, 2), False), (F.alpha_dropout, (3, 4, 5), True),
    (F.feature_alpha_dropout, (3, 4, 5, 2), True), (torch.dropout, (3, 4, 5), False)])
def test_the_dropout_family_is_keyed_with_torchs_values(fn, shape, alpha):
    """Every member of the family gives torch's output values (scale, alpha dropout's affine form) with
    keyed masks: row r of a batched input is example ids[r]'s whatever the other rows; feature
    dropouts keep or drop whole channels."""
    def run(x, ids=None):
        if isinstance(fn, nn.Module):
            return fn.train()(x)
        kw = {"train": True} if fn is torch.dropout else {"training": True}
        return fn(x, p=0.5, **kw)
    x = torch.ones(shape)
    with forward.keyed(KEY, 3), forward.examples([4, 8, 1]), forward.one_pass():
        out = run(x)
    with forward.keyed(KEY, 3), forward.examples([1, 4]), forward.one_pass():
        swapped = run(x[:2])
    assert torch.equal(out[[2, 0]], swapped)
    torch.manual_seed(0)
    assert set(out.unique().tolist()) == set(run(torch.ones(64, *shape[1:])).unique().tolist())
    if fn in (F.dropout1d, F.dropout2d, F.dropout3d, F.feature_alpha_dropout):
        assert torch.equal(out, out.flatten(2)[..., :1].expand(out.flatten(2).shape).reshape(shape))
    assert len(out.unique()) == 2 and alpha == bool(out.min() < 0)  # kept and dropped both present


def _canary_engine(path: str) -> DPEngine:
    model = nn.Sequential(nn.Dropout(0.5), nn.Linear(16, 1, bias=False))
    nn.init.zeros_(model[1].weight)
    return DPEngine(model, "dpsgd", n=16, batch_size=4, steps=1, noise_multiplier=1.0, grad_path=path,
                    config=AlgoConfig(lr=1.0, clip=1.0), loss_fn=lambda out, y: out.sum(), noise_seed=5)


@pytest.mark.parametrize("path", ["rows", "fast", "auto"])
def test_dropout_canary_moves_the_release_by_its_own_contribution_only(path):
    """The attack: 12 examples whose clipped gradient is C e_j or 0 by one mask bit each. Position-
    assigned masks would move the release by sqrt(#bits that change) C > C when an example joins in
    front; keyed masks move it by the joining example's own clipped gradient: the update shift
    equals -lr/B clip(g*) computed in float64 from the keystream, and is at most lr C / B."""
    x = torch.zeros(13, 16, dtype=torch.float64)
    x[torch.arange(13), torch.arange(13)] = 100.0  # example i (index i) lives on coordinate i; x* is index 0
    ids_a, ids_b = torch.arange(1, 13), torch.arange(13)
    updates = []
    for ids in (ids_a, ids_b):
        eng = _canary_engine(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # indices of the test's choosing: uncertified, on purpose
            eng.step(x[ids].float(), torch.zeros(len(ids)), ids)
        updates.append(eng.model[1].weight.detach().double().flatten())
    keep = reference_masks(eng.key, 0, list(range(13)), 16).double()
    own = keep[0, 0] * 1.0 * torch.eye(16, dtype=torch.float64)[0]  # g* = keep 100 / (1 - p) e_0, clipped to C
    shift = updates[1] - updates[0]
    assert torch.allclose(shift, -own / 4, atol=1e-6) and shift.norm() <= 1.0 / 4 * (1 + 1e-6)
    by_position = reference_masks(eng.key, 0, list(range(13)), 16).double()  # row r: the mask of position r
    moved = sum((by_position[r + 1, r + 1] - by_position[r, r + 1]) * torch.eye(16, dtype=torch.float64)[r + 1]
                for r in range(12)) + by_position[0, 0] * torch.eye(16, dtype=torch.float64)[0]
    assert moved.norm() > 1.5  # the same data under position-assigned masks: beyond one clip norm


def test_rows_and_fast_paths_draw_the_same_masks():
    """A model with dropout between layers: one step on the rows path and on the fast path (same key)
    gives the same update: every forward of an example, the fast path's counterfactual recheck
    included, used the example's masks."""
    x, y = torch.randn(40, 8, generator=torch.Generator().manual_seed(0)), torch.arange(40) % 3
    out = []
    for path in ("rows", "fast"):
        torch.manual_seed(1)
        m = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.4), nn.Linear(32, 3))
        eng = DPEngine(m, "dpsgd", n=40, batch_size=10, steps=1, noise_multiplier=0.5, grad_path=path, noise_seed=3,
                       config=AlgoConfig(lr=1.0, clip=100.0))  # no clipping: the paths' norms round apart
        idx = eng.sampler.sample()
        eng.step(x[idx], y[idx], idx)
        out.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert len(idx) > 2 and torch.allclose(out[0], out[1], rtol=0, atol=1e-5)


class _Draws(nn.Module):
    def __init__(self, draw) -> None:
        super().__init__()
        self.lin, self.draw = nn.Linear(8, 3), draw

    def forward(self, x):
        return self.lin(x + 0.01 * self.draw(x))


@pytest.mark.parametrize("draw,name,path", [
    (torch.rand_like, "torch.rand_like", "rows"), (torch.rand_like, "torch.rand_like", "fast"),
    (lambda x: x.clone().uniform_(), "Tensor.uniform_", "rows"),
    (lambda x: x * random.random(), "Python's random", "fast")])
def test_a_forward_drawing_from_a_public_generator_is_refused(draw, name, path):
    """torch.rand and its kind are refused by name; a draw that bypasses the mode (Python's random) by
    the moved generator. Nothing changes."""
    m = _Draws(draw)
    # q = 1: every example in the batch (a Poisson batch at q = 1/4 is empty with probability 0.3 %, and an
    # empty step runs no forward to refuse)
    eng = DPEngine(m, "dpsgd", n=20, batch_size=20, steps=1, noise_multiplier=1.0, grad_path=path)
    before = [p.detach().clone() for p in m.parameters()]
    idx = eng.sampler.sample()
    with pytest.raises(ConfigError, match=name):
        eng.step(torch.randn(len(idx), 8), torch.zeros(len(idx), dtype=torch.long), idx)
    assert eng.steps_taken == 0 and all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_dropout_without_indices_is_refused():
    m = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    eng = DPEngine(m, "dpsgd", n=20, batch_size=5, steps=1, noise_multiplier=1.0, grad_path="rows")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match="indices"):
            eng.step(torch.randn(4, 8), torch.zeros(4, dtype=torch.long))
    assert eng.steps_taken == 0


def _dropout_run(steps_first: int, p: float = 0.3, state=None):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(p), nn.Linear(16, 3))
    eng = DPEngine(m, "dpsgd", n=32, batch_size=8, steps=4, noise_multiplier=1.0, noise_seed=9,
                   config=AlgoConfig(lr=0.5, clip=0.5), max_physical_batch=3)
    if state is not None:
        m.load_state_dict(state["model"])
        eng.load_state_dict(state["engine"])
        torch.rand(5)  # torch's generator elsewhere than in the first run: the masks do not read it
    x, y = torch.randn(32, 8, generator=torch.Generator().manual_seed(1)), torch.arange(32) % 3
    for _ in range(steps_first):
        idx = eng.sampler.sample()
        eng.step(x[idx], y[idx], idx)
    return m, eng


def test_resume_with_dropout_is_bit_exact():
    """Masks are a pure function of (key, step, index): a resumed run draws what the uninterrupted one
    did, whatever torch's generator holds meanwhile."""
    whole, _ = _dropout_run(4)
    half, eng = _dropout_run(2)
    state = {"model": {k: v.clone() for k, v in half.state_dict().items()}, "engine": eng.state_dict()}
    resumed, _ = _dropout_run(2, state=state)
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), resumed.parameters()))
    no_dropout, _ = _dropout_run(4, p=0.0)
    assert not all(torch.equal(a, b) for a, b in zip(whole.parameters(), no_dropout.parameters()))


class _NoisyData(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.randn(4), 0  # torch's global generator: public, in fetch order


def test_a_dataset_drawing_from_torchs_generator_is_reported():
    """(The fetch is checked by the loader, clipbias.sampling.refetch: uncertified with the caveat, not refused.)"""
    eng = DPEngine(nn.Linear(4, 2), "dpsgd", n=8, batch_size=4, steps=1, noise_multiplier=1.0)
    with pytest.warns(UserWarning, match="torch's global generator"):
        for x, y, idx in PoissonLoader(eng, _NoisyData()).epoch():
            if len(idx):
                break
    assert not eng.privacy().certified and "generator" in eng.fetch_caveats


def _math_attention(q, k, v, mask, p, keep, causal=False, gqa=False):
    """torch's math kernel (the one its math backend runs) with a given dropout mask; a bool mask as the
    additive -inf bias F.scaled_dot_product_attention makes of it."""
    L, S = q.shape[-2], k.shape[-2]
    if causal:
        mask = torch.ones(L, S, dtype=torch.bool).tril()
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Dropout mask should only be used for testing purposes"
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, mask, p, False, keep, enable_gqa=gqa)[0]


@pytest.mark.parametrize("case", ["bool", "float", "causal", "gqa"])
def test_sdpa_dropout_is_keyed_and_equals_torchs_math_kernel(case):
    """F.scaled_dot_product_attention with dropout_p > 0 in the private forward: torch's math kernel
    given the attention-weight mask read independently from each example's keystream (bool and float
    masks, a query row with every key masked, is_causal, grouped-query heads); row r is example ids[r]'s
    whatever the other rows (a batch of other composition gives the same rows); dropout_p = 0 is
    torch's own kernel, bit for bit."""
    g = torch.Generator().manual_seed(1)
    b, H, L, S, E = 3, 2, 4, 5, 6
    q = torch.randn(b, H, L, E, generator=g, dtype=torch.float64)
    kv_heads = 1 if case == "gqa" else H
    k, v = (torch.randn(b, kv_heads, S if case != "causal" else L, E, generator=g, dtype=torch.float64)
            for _ in range(2))
    S = k.shape[-2]
    mask = None
    if case == "bool":
        mask = torch.rand(b, 1, L, S, generator=g) > 0.4
        mask[1, 0, 2] = False  # a query that sees no key: zero weights, as torch's math backend gives
    elif case == "float":
        mask = torch.randn(b, 1, L, S, generator=g, dtype=torch.float64)
    kw = {"is_causal": case == "causal", "enable_gqa": case == "gqa"}
    ids, p = [4, 8, 1], 0.3

    def run(rows, ids, p):
        m = None if mask is None else mask[rows]
        with forward.keyed(KEY, 2), forward.examples(ids), forward.one_pass() as seen:
            out = F.scaled_dot_product_attention(q[rows], k[rows], v[rows], m, dropout_p=p, **kw)
        return out, seen.calls

    out, calls = run([0, 1, 2], ids, p)
    keep = reference_masks(KEY, 2, ids, (H, L, S), p)
    want = _math_attention(q, k, v, mask, p, keep, kw["is_causal"], kw["enable_gqa"])
    assert calls == 1 and torch.allclose(out, want, rtol=0, atol=1e-12)
    assert 0.05 < (~keep).float().mean() < 0.6
    swapped, _ = run([2, 0], [1, 4], p)
    assert torch.equal(swapped, out[[2, 0]])  # example 1's and 4's weights and masks, beside other examples
    plain, calls = run([0, 1, 2], ids, 0.0)
    assert calls == 0 and torch.equal(plain, F.scaled_dot_product_attention(q, k, v, mask, **kw))


class _Attention(nn.Module):
    """One self-attention layer through F.scaled_dot_product_attention with attention dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out, self.p = nn.Linear(6, 3 * 8), nn.Linear(8, 3), 0.3

    def forward(self, x):  # x [b, T, 6]
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 4).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p, is_causal=True)
        return self.out(a.transpose(1, 2).flatten(2)).mean(1)


def test_sdpa_dropout_rows_and_fast_paths_agree():
    """A model whose attention (SDPA) drops weights: one step on the rows path (vmap) and on the fast path
    (batched, probed by its counterfactual batch of copies) under the same key gives the same update;
    the masks are drawn (the update differs from the same step without dropout)."""
    x, y = torch.randn(24, 5, 6, generator=torch.Generator().manual_seed(0)), torch.arange(24) % 3
    out = []
    for path, p in (("rows", 0.3), ("fast", 0.3), ("fast", 0.0)):
        torch.manual_seed(1)
        m = _Attention().double()
        m.p = p
        eng = DPEngine(m, "dpsgd", n=24, batch_size=8, steps=1, noise_multiplier=0.5, grad_path=path, noise_seed=3,
                       config=AlgoConfig(lr=1.0, clip=100.0))
        idx = eng.sampler.sample()
        eng.step(x[idx].double(), y[idx], idx)
        out.append(torch.cat([p.detach().flatten() for p in m.parameters()]))
    assert len(idx) > 2 and torch.allclose(out[0], out[1], rtol=0, atol=1e-10)
    assert (out[1] - out[2]).norm() > 1e-3


@pytest.mark.parametrize("kind", ["hidden", "sdpa"])
def test_an_examples_masks_on_its_real_positions_do_not_depend_on_the_padded_length(kind):
    """Dynamic padding: the same examples padded to 7 and to 12 positions (a longer example in the batch).
    Each call has its own stream, and the layout depends on an element's coordinates only: on the real
    positions the masks of a [L, d] dropout and of SDPA's attention weights [H, L, L] (its second call,
    after a dropout whose size also changed) are the same; a padded batch's masks match the reference."""
    def masks(width):
        x = torch.ones(3, width, 5)
        q = torch.randn(3, 2, width, 4, generator=torch.Generator().manual_seed(0))
        with forward.keyed(KEY, 4), forward.examples([6, 1, 3]), forward.one_pass() as seen:
            h = F.dropout(x, 0.5)
            if kind == "hidden":
                return h != 0, seen
            with torch.no_grad():
                out = F.scaled_dot_product_attention(q, q, torch.eye(width).expand(3, 2, width, width), dropout_p=0.5)
            return out != 0, seen  # V = I: the output is the dropped weights, zero where dropped (or masked)
    short, s1 = masks(7)
    long, s2 = masks(12)
    assert s1.calls == s2.calls == (1 if kind == "hidden" else 2)
    if kind == "hidden":
        assert torch.equal(short, long[:, :7])
        assert torch.equal(long, reference_masks(KEY, 4, [6, 1, 3], (12, 5)))
    else:
        assert torch.equal(short, long[:, :, :7, :7])
        assert torch.equal(long, reference_masks(KEY, 4, [6, 1, 3], (2, 12, 12), call=1))
    assert 0.3 < long.float().mean() < 0.7


def test_dropout_whose_layout_changes_between_batches_is_refused():
    """Dropout on a channel-first [d, L] input whose L is padded per batch: the row-major layout would move
    an example's masks with L. The run's first forward records each call's fixed dimensions; a later
    forward with other ones is refused, naming the call and the shapes. The same [L, d] input in the
    batch-first layout, L varying, is taken; so is a change in the number of calls refused."""
    layouts = {}
    for L in (6, 9):
        with forward.keyed(KEY, L, layouts=layouts), forward.examples([0, 1]), forward.one_pass():
            F.dropout(torch.ones(2, L, 4), 0.5)
    layouts = {}
    with forward.keyed(KEY, 0, layouts=layouts), forward.examples([0, 1]), forward.one_pass():
        F.dropout(torch.ones(2, 4, 6), 0.5)
    with pytest.raises(ConfigError, match=r"dropout call 0 .*\[4, 9\].*\[4, 6\].*layout changes between batches"):
        with forward.keyed(KEY, 1, layouts=layouts), forward.examples([0, 1]), forward.one_pass():
            F.dropout(torch.ones(2, 4, 9), 0.5)
    with pytest.raises(ConfigError, match="made 2 keyed dropout calls, where the run's first made 1"):
        with forward.keyed(KEY, 2, layouts=layouts), forward.examples([0, 1]), forward.one_pass():
            F.dropout(F.dropout(torch.ones(2, 4, 6), 0.5), 0.5)


def test_a_dropout_layout_change_is_refused_in_a_training_run():
    """Through the engine: a model dropping a channel-first [d, L] view, L padded per batch, is refused at
    the step whose L differs from the first step's (both paths)."""
    class ChannelFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 1)

        def forward(self, x):  # x [b, L, 3]
            return self.lin(F.dropout(x.transpose(1, 2), 0.2, self.training).transpose(1, 2)).sum((1, 2))

    def engine(path):
        return DPEngine(ChannelFirst(), "dpsgd", n=16, batch_size=4, steps=3, noise_multiplier=1.0, grad_path=path,
                        config=AlgoConfig(lr=0.1, clip=1.0), loss_fn=lambda out, y: out, noise_seed=2)

    for path in ("rows", "fast"):
        eng = engine(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            eng.step(torch.ones(4, 5, 3), torch.zeros(4), torch.arange(4))
            with pytest.raises(ConfigError, match="layout changes between batches"):
                eng.step(torch.ones(4, 8, 3), torch.zeros(4), torch.arange(4, 8))
            resumed = engine(path)  # the record travels in the engine's state: a resumed run is held to it
            resumed.load_state_dict(eng.state_dict())
            with pytest.raises(ConfigError, match="layout changes between batches"):
                resumed.step(torch.ones(4, 8, 3), torch.zeros(4), torch.arange(4, 8))


@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attentions_inner_dropout_is_keyed_per_example(need_weights):
    """``nn.MultiheadAttention`` and ``nn.TransformerEncoderLayer`` call ``F.multi_head_attention_forward``, a
    composite the mode used to run with itself switched off: its inner dropout drew from torch's generator and the
    step was refused. Its body now runs under the mode: an example's gradient is the same whichever examples share
    its batch (the masks are keyed by its index), and it changes with the step (the masks are drawn)."""
    torch.manual_seed(0)

    class Attend(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha, self.head = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True), nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.mha(x, x, x, need_weights=need_weights)[0].mean(1))

    fg = FuncGradients(Attend())
    x, y = torch.randn(6, 5, 8), torch.randint(0, 2, (6,))

    def rows(ids, pick, step=0):
        with forward.keyed(KEY, step), forward.examples(ids):
            return fg(x[pick], y[pick])[0]

    a = rows([10, 11, 12], [0, 1, 2])
    b = rows([12, 14, 15, 10], [2, 4, 5, 0])
    assert torch.equal(a[0], b[3]) and torch.equal(a[2], b[0])  # examples 10 and 12 alike in both batches
    assert not torch.equal(a[0], rows([10, 11, 12], [0, 1, 2], step=1)[0])


def test_a_transformer_encoder_layer_at_its_default_dropout_trains_certified():
    from clipbias.config import AlgoConfig
    from clipbias.engine import DPEngine

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc, self.head = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.enc(x).mean(1))

    torch.manual_seed(0)
    eng = DPEngine(Net().train(), "dpsgd", n=32, batch_size=8, steps=2, noise_multiplier=1.0,
                   config=AlgoConfig(lr=0.1, clip=1.0), grad_path="auto")
    x, y = torch.randn(32, 5, 8), torch.randint(0, 2, (32,))
    for _ in range(2):
        idx = eng.sampler.sample()
        eng.step(x[idx], y[idx], idx)
    assert eng.steps_taken == 2 and eng.privacy().certified
