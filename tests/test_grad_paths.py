"""The gradient-path protocol (``clipbias.grads.path``): every path the engine runs is a ``GradPath`` whose
``sums`` the engine calls and whose queries it asks, never its class; ``grad_path="auto"``'s fall-back is a
``FallBack`` composite of two paths; the fast path holds its run-time checks and per-example losses as
objects, not as base classes."""

from __future__ import annotations

import ast
import pathlib
import warnings

import pytest
import torch
from torch import nn

from clipbias.config import AlgoConfig
from clipbias.engine import aggregate
from clipbias.engine.core import DPEngine
from clipbias.grads.fast import BookKeeping
from clipbias.grads.fast_checks import RuntimeChecks
from clipbias.grads.fast_losses import PerExampleLosses
from clipbias.grads.path import FallBack, GradPath, refusal_name
from clipbias.grads.rows import FuncGradients, ParamSums, PerExampleRows, RowsPath
from clipbias.grads.two_point import TwoPoint, TwoPointRows

ENGINE = pathlib.Path(__file__).resolve().parent.parent / "clipbias" / "engine"
PATH_CLASSES = {"GradPath", "RowsPath", "ParamSums", "BookKeeping", "TwoPoint", "FallBack"}


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _data(n: int = 40):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def _engine(model: nn.Module, grad_path: str, **kw) -> DPEngine:
    return DPEngine(model, "dpsgd", n=40, batch_size=10, steps=3, noise_multiplier=1.0, noise_seed=7,
                    grad_path=grad_path, max_physical_batch=4, config=AlgoConfig(lr=0.3, clip=0.5), **kw)


def _every_path() -> dict[str, GradPath]:
    m = _mlp()
    rows = TwoPointRows(PerExampleRows(FuncGradients(m)), list(m.parameters()), 0.5, 0.3)
    fast, sums = BookKeeping(m), ParamSums(FuncGradients(m))
    return {"rows": RowsPath(), "sums": sums, "fast": fast, "two-point sums": TwoPoint(sums, rows),
            "two-point fast": TwoPoint(fast, rows), "fall-back": FallBack(fast, (sums, None), lambda p: None)}


def test_every_path_satisfies_the_protocol():
    """Each implementation is a ``GradPath`` with its own ``sums`` and answers every query: its kind, two points or
    not, the book-keeping it runs (the fast path's own, through DiSK's wrapper and the composite too), the name a
    refusal of it carries, and what keeps the step's outputs."""
    paths = _every_path()
    want = {"rows": ("rows", False, False, "rows"), "sums": ("sums", False, False, "rows"),
            "fast": ("fast", False, True, "fast"), "two-point sums": ("sums", True, False, "rows"),
            "two-point fast": ("fast", True, True, "fast"), "fall-back": ("fast", False, True, "fast")}
    for name, path in paths.items():
        assert isinstance(path, GradPath), name
        assert type(path).sums is not GradPath.sums and not getattr(type(path), "__abstractmethods__", None), name
        bk = path.book_keeping()
        assert (path.kind, path.two_point, bk is not None, refusal_name(path)) == want[name], name
        assert bk is None or isinstance(bk, BookKeeping)
        assert path in path.paths() or name == "fall-back"
    fast, sums = paths["fast"], paths["sums"]
    assert fast.output_source() is fast and sums.output_source() is sums.grads
    assert paths["rows"].output_source() is None and paths["two-point fast"].output_source() is None
    assert sums.func_grads(None) is sums.grads and paths["two-point sums"].func_grads(None) is sums.grads
    assert paths["fall-back"].paths() == (fast, sums) and paths["fall-back"].may_fall_back
    assert not any(p.may_fall_back for n, p in paths.items() if n != "fall-back")


def test_the_engine_holds_a_path_of_the_planned_kind():
    """What the plan names (``PathChoice.path``) is the kind of the path the engine runs; ``engine.fast`` is that
    path's book-keeping; a given backend takes the rows through the pipeline; DiSK wraps the chosen path."""
    x, y = _data()
    for grad_path, kind in (("rows", "sums"), ("fast", "fast")):
        e = _engine(_mlp(), grad_path)
        assert isinstance(e.path, GradPath) and e.path.kind == kind == e.plan.path.path
        assert e.fast is e.path.book_keeping() and (e.fast is not None) == (kind == "fast")
    m = _mlp()
    e = _engine(m, "rows", grads=FuncGradients(m))
    assert e.path.kind == "rows" and e._aggregate is None and not e.outputs_kept
    e.step(x[:6], y[:6], torch.arange(6))  # (uncertified: indices of our choosing)
    d = DPEngine(_mlp(), "disk", n=40, batch_size=10, steps=2, noise_multiplier=1.0, grad_path="fast")
    assert d.path.two_point and d.path.kind == "fast" and isinstance(d.fast, BookKeeping)


def test_the_composite_takes_its_other_path_once():
    """``FallBack``: a refusal naming another path leaves it; one naming its current path switches to the other
    (its ``PathChoice`` returned), whose own other ``other_of`` gives; ``settled`` is the current path."""
    m = _mlp()
    fast, sums = BookKeeping(m), ParamSums(FuncGradients(m))
    built = []
    path = FallBack(fast, (sums, "the rows' choice"), lambda p: built.append(p))
    assert path.fall_back("rows") is None and path.current is fast
    assert path.fall_back("fast") == "the rows' choice" and built == [sums]
    assert path.current is sums and path.kind == "sums" and path.book_keeping() is None
    assert not path.may_fall_back and path.fall_back("rows") is None and path.settled() is sums


class _Hooked(nn.Sequential):
    """A model the fast path takes when the engine is built and refuses at the first step: a forward hook on one of
    its layers (``grads.fast._check_hooks``). The hook only watches: the rows path computes the same gradients."""

    def __init__(self):
        super().__init__(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        self[0].register_forward_hook(lambda m, i, o: None)


def test_auto_falls_back_to_the_rows_path_with_the_rows_paths_result(monkeypatch):
    """Under ``grad_path="auto"`` on a model the fast path refuses at its first step, the composite takes the rows
    path and releases bit for bit what ``grad_path="rows"`` releases on the same key; the run keeps that path."""
    monkeypatch.setattr(aggregate, "AUTO_ROWS_BYTES", 0)  # auto takes the fast path wherever it applies
    x, y = _data()
    released = {}
    for grad_path in ("auto", "rows"):
        torch.manual_seed(0)
        m = _Hooked()
        e = _engine(m, grad_path)
        if grad_path == "auto":
            assert isinstance(e.path, FallBack) and e.path.kind == "fast" and e.path.may_fall_back
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                idx = e.sampler.sample()
                e.step(x[idx], y[idx], idx)
        if grad_path == "auto":
            assert any("fast path refused the model" in str(w.message) for w in caught)
            assert e.grad_path_fallback.startswith("fast -> rows") and e.fast is None
            assert type(e.path) is ParamSums and e.plan.path.path == "sums"  # settled: the composite unwrapped
        released[grad_path] = torch.cat([p.detach().flatten() for p in m.parameters()])
    assert torch.equal(released["auto"], released["rows"])


def test_the_fast_path_holds_its_checks_and_losses():
    """Composition, not inheritance: ``BookKeeping``'s bases are the protocol alone; its run-time checks and
    per-example losses are objects it holds (the checks reaching back to it), their state theirs."""
    assert BookKeeping.__bases__ == (GradPath,)
    bk = BookKeeping(_mlp())
    assert isinstance(bk.checks, RuntimeChecks) and bk.checks.host is bk
    assert isinstance(bk.losses, PerExampleLosses) and bk.loss_fn is bk.losses.loss_fn
    assert bk._proofs is bk.checks.proofs
    x, y = _data(5)
    got = bk.losses(bk.model(x), y, 5)
    assert got.shape == (5,) and torch.allclose(got, nn.functional.cross_entropy(bk.model(x), y, reduction="none"))


def _dispatch_on_path_classes(tree: ast.AST) -> list[str]:
    """``isinstance``/``issubclass`` against a path class, ``getattr(..., "inner", ...)`` and ``type(x) is C``."""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) in ("isinstance", "issubclass") and len(n.args) == 2:
            names = {getattr(e, "id", getattr(e, "attr", None)) for e in ast.walk(n.args[1])}
            if names & PATH_CLASSES:
                found.append(f"{n.lineno}: {ast.unparse(n)}")
        if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "getattr" and len(n.args) >= 2 \
                and isinstance(n.args[1], ast.Constant) and n.args[1].value == "inner":
            found.append(f"{n.lineno}: {ast.unparse(n)}")
        if isinstance(n, ast.Compare) and isinstance(n.left, ast.Call) and getattr(n.left.func, "id", None) == "type" \
                and any(getattr(c, "id", None) in PATH_CLASSES for c in n.comparators):
            found.append(f"{n.lineno}: {ast.unparse(n)}")
    return found


# engine/sharded.py receives the fast path's BookKeeping itself (``engine_aggregate`` passes ``path.book_keeping()``)
# and checks ``type(agg) is not BookKeeping`` on it: a check of its argument's type, not a dispatch between paths
KNOWN = {"sharded.py": ["type(agg) is not BookKeeping"]}


def test_the_engine_dispatches_on_no_path_class():
    """No module of ``clipbias/engine`` asks a path for its class (``isinstance``, ``type(...) is``) or unwraps
    DiSK's wrapper (``getattr(..., "inner")``): it calls the protocol."""
    files = sorted(ENGINE.glob("*.py"))
    assert {"aggregate.py", "core.py", "sum_precision.py"} <= {f.name for f in files}
    for f in files:
        found = _dispatch_on_path_classes(ast.parse(f.read_text()))
        known = KNOWN.get(f.name, [])
        assert [s for s in found if not any(k in s for k in known)] == [], (f.name, found)
    # the check itself finds what it looks for
    assert len(_dispatch_on_path_classes(ast.parse(
        "isinstance(a, BookKeeping)\nisinstance(getattr(a, 'inner', a), (ParamSums, X))\ntype(a) is TwoPoint"))) == 4


@pytest.mark.parametrize("grad_path", ["rows", "fast"])
def test_sum_precision_reaches_the_fast_path_of_every_path(grad_path, monkeypatch):
    """``sum_precision="float32"`` sets the book-keeping of the chosen path and of auto's other one."""
    monkeypatch.setattr(aggregate, "AUTO_ROWS_BYTES", 0 if grad_path == "fast" else 2**62)
    monkeypatch.setattr(aggregate, "fast_wins", lambda *a, **k: grad_path == "fast")
    e = _engine(_mlp(), "auto", sum_precision="float32")
    assert isinstance(e.path, FallBack) and e.path.kind == ("fast" if grad_path == "fast" else "sums")
    fast = [p.book_keeping() for p in e.path.paths() if p.book_keeping() is not None]
    assert len(fast) == 1 and fast[0].sum_precision == "float32"
