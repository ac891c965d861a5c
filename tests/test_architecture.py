"""The layout as checked properties: no import cycle, imports only downward through the pipeline's
floors, nothing below the catalog imports it, short functions and classes, and a new method, accountant
or data set is one registration (a method's settings become CLI flags by themselves): the registrations
that docs/architecture.md's recipes show are the ones these tests run. benchmarks/ has an index with a line
per script, its results in one folder, and every path into it that the docs and code name exists."""

from __future__ import annotations

import ast
import functools
import glob
import pathlib
import re
import textwrap

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "clipbias"


@functools.cache
def _tree(path: pathlib.Path) -> ast.Module:
    """The parsed source of a package file, once per process (the tests below walk every file)."""
    return ast.parse(path.read_text())


def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Every clipbias module the file imports: at module level, inside functions and under
    ``if TYPE_CHECKING:`` alike. A deferred import still makes the two modules depend on each other (it
    only hides the cycle from the interpreter), and a type-only import is a dependency of every reader
    and type checker: a cycle through either is a cycle of the design."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("clipbias")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if not base.startswith("clipbias"):
                continue
            for a in node.names:  # "from . import core" imports the submodule clipbias.algorithms.core
                sub = f"{base}.{a.name}"
                out.add(sub if (PKG.parent / sub.replace(".", "/")).with_suffix(".py").exists()
                        or (PKG.parent / sub.replace(".", "/") / "__init__.py").exists() else base)
    return out


@functools.cache
def _graph() -> dict[str, set[str]]:
    """Each module of the package: the clipbias modules it imports (built when a test needs it, not at collection)."""
    return {_module(p): _imports(p) for p in PKG.rglob("*.py")}


def _parents(mod: str) -> list[str]:
    """Importing a.b.c runs a/__init__ and a/b/__init__ first."""
    parts = mod.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def test_the_package_has_no_import_cycle():
    GRAPH = _graph()
    graph = {m: {d for d in deps if d in GRAPH and d != m} for m, deps in GRAPH.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d):] + [d]) if d in path
                                     else f"import cycle through {d}")
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_nothing_below_the_catalog_imports_it():
    """The bottom (errors, config, privacy, sampling, grads, step) and the algorithm modules
    themselves never import the catalog ``clipbias.algorithms``."""
    GRAPH = _graph()
    bottom = [m for m in GRAPH if m.split(".")[1:2] and m.split(".")[1] in
              ("errors", "config", "privacy", "sampling", "grads", "step", "files")]
    methods = [m for m in GRAPH if m.startswith("clipbias.algorithms.")]
    assert len(bottom) >= 8 and len(methods) >= 8
    for m in bottom + methods:
        assert "clipbias.algorithms" not in GRAPH[m], f"{m} imports the catalog"
    for m in bottom:
        assert not any(d.startswith("clipbias.algorithms") for d in GRAPH[m]), f"{m} imports an algorithm"


# The pipeline's floors, bottom to top: a unit may import only its own floor and the floors below.
FLOORS = [("errors", "config", "files", "distributed", "randomness", "registry"),  # bottom: no pipeline stage
          ("data",),                                                  # data sets, text, batch structures
          ("models", "layers", "sampling", "grads", "step", "privacy"),   # stages and accounting
          ("algorithms",), ("engine",), ("run", "integrations"), ("analysis", "audit"), ("cli",), ("__main__",)]
FLOOR = {unit: i for i, units in enumerate(FLOORS) for unit in units}


def _all_imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """Every clipbias import of the file, function-level ones included: (module, line)."""
    mod = _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("clipbias")):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")
                base = ".".join(anchor[:len(anchor) - (node.level - 1)] + ([base] if base else []))
            out += [(f"{base}.{a.name}" if base == "clipbias" else base, node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("clipbias")]
    return out


def test_the_root_holds_at_most_eight_plain_modules_and_every_unit_has_a_floor():
    plain = sorted(p.name for p in PKG.glob("*.py"))
    assert len(plain) <= 8, plain
    units = {p.stem for p in PKG.glob("*.py") if p.stem != "__init__"} | {p.name for p in PKG.iterdir()
                                                                           if (p / "__init__.py").exists()}
    assert units == set(FLOOR), units ^ set(FLOOR)


def test_every_unit_imports_only_downward():
    """Data flows one way, and so do the imports: a unit never imports a higher floor, even inside a
    function (``FLOORS``: data -> sampling, gradients, step stages, accounting -> algorithms -> engine ->
    run -> analysis and audits -> cli)."""
    up = []
    for p in PKG.rglob("*.py"):
        mod = _module(p)
        unit = mod.split(".")[1] if "." in mod else "__init__"
        for target, line in _all_imports(p):
            t = target.split(".")[1] if "." in target else "__init__"
            if unit != "__init__" and t != unit and FLOOR[t] > FLOOR[unit]:
                up.append(f"{mod}:{line} imports {target} (floor {FLOOR[t]} > {FLOOR[unit]})")
    assert not up, up


def _code_lines(node: ast.AST) -> int:
    """A function's or class's lines without its docstrings (its own and its methods'): the size of what it
    does; documentation (``Args:`` sections) never forces a split."""
    lines = node.end_lineno - node.lineno + 1
    for n in ast.walk(node):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body \
                and isinstance(n.body[0], ast.Expr) and isinstance(getattr(n.body[0], "value", None), ast.Constant) \
                and isinstance(n.body[0].value.value, str):
            lines -= n.body[0].end_lineno - n.body[0].lineno + 1
    return lines


def test_no_function_is_longer_than_80_lines():
    long = []
    for p in PKG.rglob("*.py"):
        for n in ast.walk(_tree(p)):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(n) > 80:
                long.append(f"{p.relative_to(PKG)}:{n.name} ({_code_lines(n)} lines without docstrings)")
    assert not long, long


# Classes longer than 250 lines, each with why, until it is split (none today).
LONG_CLASSES: set[str] = set()


def test_no_class_is_longer_than_250_lines():
    long = []
    for p in PKG.rglob("*.py"):
        for n in ast.walk(_tree(p)):
            name = f"{p.relative_to(PKG).as_posix()}:{getattr(n, 'name', '')}"
            if isinstance(n, ast.ClassDef) and _code_lines(n) > 250 and name not in LONG_CLASSES:
                long.append(f"{name} ({_code_lines(n)} lines without docstrings)")
    assert not long, long


RECIPES = (PKG.parent / "docs" / "architecture.md").read_text()


def run_recipe(section: str, package: str) -> dict:
    """Run the code block of docs/architecture.md's ``## section`` as a module of ``package`` (its relative
    imports resolve there): the recipe's example is what the test registers."""
    body = RECIPES.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    code = textwrap.dedent(re.search(r"```python\n(.*?)```", body, re.S).group(1))
    ns = {"__name__": f"{package}._recipe", "__package__": package}
    exec(compile(code, f"docs/architecture.md ({section})", "exec"), ns)
    return ns


@pytest.fixture
def half_clip():
    """A new method declared in one place: the recipe's Algorithm with one Setting, registered."""
    from clipbias import algorithms
    run_recipe("Adding a method", "clipbias.algorithms")
    yield algorithms.ALGORITHMS["half-clip"]
    del algorithms.ALGORITHMS["half-clip"]


def test_a_new_method_is_one_declaration_and_the_cli_takes_its_setting(half_clip, tmp_path):
    """Registering the algorithm is all it takes: ``--algo half-clip --shrink 0.25`` parses, reaches the
    method's settings, and the accounting reads the sensitivity off its bounding stage."""
    from clipbias.cli import build_parser
    from clipbias.cli.train import config_from_args
    from clipbias.run.training import train

    args = build_parser().parse_args(
        ["train", "--data", "digits", "--model", "logreg", "--algo", "half-clip", "--shrink", "0.25",
         "--epochs", "1", "--batch-size", "64", "--lr", "0.5", "--noise-multiplier", "1.0",
         "--clip", "2.0", "--out", str(tmp_path / "run")])
    cfg = config_from_args(args, out=str(tmp_path / "run"))
    assert cfg.extra == {"shrink": 0.25}
    res = train(cfg, plot=False)
    assert res["algorithm"]["name"] == "half-clip" and res["steps"] == 21
    assert "sensitivity 0.5 (Clip)" in res["basis"] and res["certified"] is True
    from clipbias.engine.core import DPEngine
    from clipbias.config import AlgoConfig
    from torch import nn
    eng = DPEngine(nn.Linear(3, 2), "half-clip", n=100, batch_size=10, steps=1, noise_multiplier=1.0,
                   config=AlgoConfig(clip=2.0, extra={"shrink": 0.25}))
    assert eng.spec.sensitivity == 0.5 and eng.pipeline.noise.std == pytest.approx(1.0 * 0.5 / 10)


def test_a_new_method_appears_in_the_clis_choices_and_help(half_clip, capsys, monkeypatch):
    """The parsers' choices are the registry's: the method, its setting's flag (with its help and the
    methods that read it) and its ``bandable`` declaration reach ``--algo``, the method flags and ``--bands``'s
    help, with no file regenerated."""
    from clipbias.cli import _choices, main
    c = _choices.current()
    assert "half-clip" in c["algorithms"] and "half-clip" in c["bandable"]
    [shrink] = [s for s in c["settings"] if s["key"] == "shrink"]
    assert shrink["flag"] == "--shrink" and shrink["users"] == ["half-clip"] and shrink["default"] == 0.5
    monkeypatch.setenv("COLUMNS", "100000")  # one line per flag: no name broken at a hyphen
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    assert re.search(r"--shrink SHRINK +clip at shrink \* C \(--algo half-clip; default 0\.5\)\n", text)
    assert re.search(f"--algo NAME +algorithm: {re.escape(', '.join(c['algorithms']))}\n", text)
    assert "; dpsgd, normalized, disk, perturb, self-aug, half-clip (and each with --kalman)." in text


def test_a_composable_method_is_a_base_of_compose():
    """``compose`` builds on every algorithm registered with ``composable=True`` (its list of bases is read
    from the registry): a new base needs no edit of ``compose``."""
    from clipbias.algorithms import ALGORITHMS, bases, compose, get
    from clipbias.algorithms.base import Algorithm, Parts, register
    from clipbias.config import AlgoConfig
    from clipbias.errors import ConfigError
    from clipbias.step import Clip

    assert bases() == tuple(n for n, a in ALGORITHMS.items() if a.composable) == \
        ("dpsgd", "normalized", "dice", "dice-adam", "dice-auto")
    with pytest.raises(ConfigError, match="base must be one of"):
        compose("third-clip", "perturb", register=False)
    register(Algorithm("third-clip", "DPSGD clipping at C / 3", True, "gaussian",
                       lambda cfg, s, B, key: Parts([Clip(cfg.clip / 3)]), composable=True))
    try:
        assert bases()[-1] == "third-clip"
        algo = compose("third-clip", "perturb", register=False)
        spec = algo.spec(AlgoConfig(clip=3.0, extra={"k": 0.1}), 0.1, 1.0, 8)
        assert spec.sensitivity == 1.0 and "sensitivity 1 (clip C)" in spec.note
        assert get("perturb").spec(AlgoConfig(clip=3.0, extra={"k": 0.1}), 0.1, 1.0, 8).sensitivity == 3.0
    finally:
        del ALGORITHMS["third-clip"]


@pytest.fixture
def gdp_accountant():
    """A new accountant declared in one place: the recipe's, the full-batch exact formula at any rate (an
    upper bound: Poisson subsampling only amplifies), registered."""
    from clipbias.privacy import accountants
    run_recipe("Adding an accountant", "clipbias.privacy")
    yield accountants.ACCOUNTANTS["full-batch-gdp"]
    del accountants.ACCOUNTANTS["full-batch-gdp"]


def test_a_new_accountant_is_one_registration_and_the_cli_offers_it(gdp_accountant):
    """Registering the accountant is all it takes: the accounting, the calibration and the CLI's
    ``--accountant`` read the registry."""
    from clipbias import privacy
    from clipbias.cli import build_parser
    from clipbias.privacy import gaussian, pld

    exact = pld.gaussian_exact_epsilon(2.0, 50, 1e-5)
    spec = privacy.AccountingSpec("gaussian", 1.0, noise_multiplier=2.0)
    rep = privacy.account(spec, 50, 1e-5, "full-batch-gdp")
    assert rep.epsilon == exact and rep.accountant == "full-batch-gdp" and rep.basis.startswith("T-fold Gaussian, exact mu-GDP")
    z = gaussian.calibrate(exact, 1e-5, 1.0, 50, "full-batch-gdp")
    assert gaussian.epsilon(z, 1.0, 50, 1e-5, "full-batch-gdp") <= exact and z == pytest.approx(2.0, rel=2e-3)
    args = build_parser().parse_args(["account", "--noise-multiplier", "1", "--sample-rate", "1", "--steps", "3",
                                      "--accountant", "full-batch-gdp", "--delta", "1e-5"])
    assert args.accountant == "full-batch-gdp"
    from clipbias.cli import _choices
    assert _choices.current()["accountants"] == ["pld", "rdp", "full-batch-gdp"]


def test_an_accountant_registered_at_run_time_reaches_every_integration(gdp_accountant):
    """The integrations look the registry up at each use: the accountant registered after they were imported
    is taken by name by ``PrivacyEngine(accountant=)`` (Opacus's interface) and by ``DPOptions`` (what
    ``DPArguments`` and ``DPCallback`` hold), and it is the one their reports account with."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from clipbias import privacy
    from clipbias.grads.rows import cross_entropy
    from clipbias.integrations.opacus import PrivacyEngine
    from clipbias.integrations.options import ACCOUNTANTS, DPOptions
    from clipbias.errors import ConfigError

    assert list(ACCOUNTANTS) == ["prv", "pld", "rdp", "full-batch-gdp"] and ACCOUNTANTS["full-batch-gdp"] == "full-batch-gdp"
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 5, generator=g), torch.randint(0, 3, (64,), generator=g)
    model = nn.Linear(5, 3)
    pe = PrivacyEngine(accountant="full-batch-gdp")
    model, opt, loader = pe.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                         data_loader=DataLoader(TensorDataset(x, y), batch_size=16),
                                         noise_multiplier=2.0, max_grad_norm=1.0, noise_seed=0)
    for xb, yb in loader:
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    report = pe.privacy_report(1e-5)
    assert pe.steps >= 1 and report.accountant == "full-batch-gdp"
    assert report.basis.startswith("T-fold Gaussian, exact mu-GDP")
    assert pe.engine.accountant == "full-batch-gdp"
    assert report.epsilon == privacy.account(pe.engine.spec, pe.steps, 1e-5, "full-batch-gdp").epsilon

    options = DPOptions(noise_multiplier=2.0, accountant="full-batch-gdp", noise_seed=0)
    options.check()
    m = nn.Linear(5, 3)
    engine = options.engine(m, torch.optim.SGD(m.parameters(), lr=0.1), n=64, batch_size=16, steps=None,
                            loss_fn=cross_entropy, max_physical_batch=64)
    assert engine.accountant == "full-batch-gdp"
    report = engine.privacy(4)
    assert report.accountant == "full-batch-gdp" and report.basis.startswith("T-fold Gaussian, exact mu-GDP")
    assert report.epsilon == privacy.account(engine.spec, 4, options.delta(64), "full-batch-gdp").epsilon
    with pytest.raises(ConfigError, match="full-batch-gdp"):  # the refusal lists it among the names taken
        DPOptions(noise_multiplier=2.0, accountant="gdp").check()


@pytest.fixture
def tiny_data():
    """A new data set declared in one place: the recipe's DataSource, registered."""
    from clipbias.data import DATASETS
    run_recipe("Adding a data set", "clipbias.data")
    yield DATASETS["tiny"]
    del DATASETS["tiny"]


def test_a_new_data_set_is_one_registration_and_the_cli_trains_on_it(tiny_data, tmp_path):
    """Registering the data set is all it takes: ``load_dataset`` and ``--data tiny`` reach it."""
    from clipbias.cli import build_parser
    from clipbias.cli.train import config_from_args
    from clipbias.data import load_dataset
    from clipbias.randomness import SecretKey
    from clipbias.run.training import train

    assert load_dataset("tiny", validation=10, key=SecretKey.from_seed(0)).x_val is not None
    args = build_parser().parse_args(
        ["train", "--data", "tiny", "--model", "logreg", "--algo", "dpsgd", "--epochs", "1", "--batch-size", "20",
         "--lr", "0.5", "--noise-multiplier", "1.0", "--out", str(tmp_path / "run")])
    res = train(config_from_args(args, out=str(tmp_path / "run")), plot=False)
    assert res["steps"] == 5 and res["certified"] is True


# Each package whose modules register: its catalog (the module that imports them), the call that registers, the
# modules that define the registry, and today's registry in its order (a catalog that discovers its modules
# imports the ones it listed before in the same order: no registry's order moves).
CATALOGS = {
    "algorithms": ("clipbias.algorithms", "register", ("base",), "ALGORITHMS",
                   ["sgd", "clip-sgd", "ef-sgd", "dpsgd", "normalized", "dice", "dice-adam", "dice-auto",
                    "dpgd-momentum", "inner-outer", "p-avg", "batch-clip", "adaptive", "disk", "perturb", "self-aug",
                    "dice-perturb", "dice-self-aug"]),
    "privacy": ("clipbias.privacy", "register", ("accountants",), "ACCOUNTANTS", ["pld", "rdp"]),
    "data": ("clipbias.data.catalog", "register_dataset", ("dataset",), "DATASETS",
             ["fashion-mnist", "digits", "digits-image", "breast-cancer", "wine", "cifar10", "npz"]),
    "grads/layers": ("clipbias.grads.layers", "register", ("base",), "RULES",
                     ["linear", "conv1d-transformers", "conv", "instance-norm", "group-norm", "layer-norm", "rms-norm",
                      "rms-norm-transformers", "embedding", "prelu", "vit-embeddings"]),
}
# The recipes' new entries, each a module dropped into its package (the recipe's block), and where it lands.
DROPPED = {"algorithms": ("half_clip", "Adding a method", "half-clip"),
           "privacy": ("full_batch_gdp", "Adding an accountant", "full-batch-gdp"),
           "data": ("tiny", "Adding a data set", "tiny"),
           "grads/layers": ("batch_norm_eval", "Adding a layer rule", "batch-norm-eval")}

_REGISTRIES = """
import importlib, json, sys
out = {}
for package, (catalog, registry) in json.loads(sys.argv[1]).items():
    module = importlib.import_module(catalog)
    out[package] = {"names": list(getattr(module, registry)),
                    "modules": sorted(m.rpartition(".")[2] for m in sys.modules
                                      if m.startswith("clipbias." + package.replace("/", ".") + "."))}
print(json.dumps(out))
"""


def _registries(root: pathlib.Path) -> dict:
    """Each catalog's registry (its names, in order) and the modules of its package loaded, after importing the
    catalogs alone in a fresh interpreter from the package at ``root`` (nothing else imported first)."""
    import json
    import subprocess
    import sys
    arg = json.dumps({p: (c[0], c[3]) for p, c in CATALOGS.items()})
    done = subprocess.run([sys.executable, "-c", _REGISTRIES, arg], cwd=root, capture_output=True, text=True,
                          env={"PYTHONPATH": str(root), "PATH": ""}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _registering(package: str) -> set[str]:
    """The modules of ``package`` (a folder of clipbias/) that call its registering function, the registry's
    own modules aside."""
    _, call, own, _, _ = CATALOGS[package]
    return {p.stem for p in (PKG / package).glob("*.py") if p.stem not in (*own, "__init__")
            and any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == call
                    for n in ast.walk(_tree(p)))}


def test_every_module_that_registers_is_imported_by_its_catalog():
    """A module of ``algorithms/``, ``privacy/``, ``data/`` or ``grads/layers/`` that registers something (an
    algorithm, an accountant, a data set, a layer rule) is imported by its package's catalog with no line of its
    own: the catalogs discover their modules (those they listed before first, in that order, then the others by
    name; the algorithms' compositions last). The helpers a catalog leaves to their users register nothing, and
    the registries hold today's names in today's order."""
    import importlib
    got = _registries(PKG.parent)
    for package, (catalog, _, _, _, names) in CATALOGS.items():
        registering = _registering(package)
        loaded = set(got[package]["modules"])
        assert registering and registering <= loaded, (package, registering - loaded)
        assert got[package]["names"] == names, (package, got[package]["names"])
        module = importlib.import_module(catalog)
        left = set(getattr(module, "_LAZY", ()) + getattr(module, "_NOT_SETS", ()))
        assert not left & registering, (package, left & registering)
    from clipbias import algorithms, privacy
    from clipbias.data import catalog
    assert algorithms._modules(["zz", "blt", "core", "compose", "bands", "aa", "_x"])[-4:] == ["aa", "zz", "compose",
                                                                                             "bands"]
    assert catalog._modules(["new", "text", "own", "catalog"])[-1] == "new"
    assert privacy._modules(["a", "tuning"])[-1] == "a"


def test_a_module_dropped_into_its_package_registers_with_no_other_edit(tmp_path):
    """The recipes' blocks, each written as a module into its package in a copy of clipbias (nothing is
    written into the package itself), register when the catalog is imported: no catalog line, no other
    file; a new method lands after the methods listed before and before the compositions, the others last."""
    import shutil
    shutil.copytree(PKG, tmp_path / "clipbias", ignore=shutil.ignore_patterns("__pycache__"))
    for package, (module, section, _) in DROPPED.items():
        body = RECIPES.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
        code = textwrap.dedent(re.search(r"```python\n(.*?)```", body, re.S).group(1))
        (tmp_path / "clipbias" / package / f"{module}.py").write_text(code)
    got = _registries(tmp_path)
    for package, (catalog, _, _, _, names) in CATALOGS.items():
        module, _, name = DROPPED[package]
        want = [*names[:-4], name, *names[-4:]] if package == "algorithms" else [*names, name]
        assert got[package]["names"] == want, (package, got[package]["names"])
        assert module in got[package]["modules"]


def _table(text: str, heading: str) -> list[list[str]]:
    """The rows (cells, stripped) of the first Markdown table after ``heading`` in ``text``."""
    lines = text.split(heading, 1)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_the_docs_tables_are_the_registries():
    """docs/methods.md's table of every algorithm (name, accounting kind, bandable, composable), its table of
    method settings (key, flag, the methods that read it) and docs/data.md's table of data sets list exactly
    what is registered: a new entry without its row fails here, naming it."""
    from clipbias import algorithms
    from clipbias.data import DATASETS
    docs = PKG.parent / "docs"
    methods = (docs / "methods.md").read_text()
    rows = _table(methods, "\n## Every algorithm\n")
    yes = {"yes": True, "no": False}
    got = [(r[0].strip("`"), r[2].strip("`"), yes[r[3]], yes[r[4]]) for r in rows]
    want = [(n, a.accounting, a.bandable, a.composable) for n, a in algorithms.ALGORITHMS.items()]
    assert got == want, sorted(set(got) ^ set(want))
    settings = {r[0].split("`")[1]: r for r in _table(methods, "\nMethod settings live in `AlgoConfig.extra`")}
    assert set(settings) == set(algorithms.all_settings()), set(settings) ^ set(algorithms.all_settings())
    for key, s in algorithms.all_settings().items():
        flag, users = settings[key][1], settings[key][2]
        assert s.flag.split("/")[0] in flag or not s.cli, (key, flag)
        readers = [n for n, a in algorithms.ALGORITHMS.items() if any(x.key == key for x in a.schema)]
        assert all(re.search(rf"(^|[ ,]){re.escape(n)}([ ,(]|$)", users) for n in readers), (key, users, readers)
    data = [r[0].strip("`") for r in _table((docs / "data.md").read_text(), "\n")]
    assert data == list(DATASETS), (data, list(DATASETS))



def test_the_extension_points_are_one_registry_type():
    """Algorithms, accountants and data sets are ``clipbias.registry.Registry``s: one name once, a lookup
    that names the API parameter."""
    from clipbias import algorithms
    from clipbias.data.dataset import DATASETS
    from clipbias.errors import ConfigError
    from clipbias.privacy.accountants import ACCOUNTANTS
    from clipbias.registry import Registry
    for reg in (algorithms.ALGORITHMS, ACCOUNTANTS, DATASETS):
        assert isinstance(reg, Registry) and len(reg) >= 2
        first = next(iter(reg.values()))
        with pytest.raises(ConfigError, match="needs a name not yet registered"):
            reg.register(first)
        with pytest.raises(ConfigError, match=f"`{reg.parameter}` must be one of"):
            reg.lookup("no-such-name")
        assert reg.lookup(first.name) is first


BENCH = PKG.parent / "benchmarks"


def _bench_scripts() -> list[pathlib.Path]:
    """Every script of benchmarks/: the ``*.py`` and ``*.sh`` files in it and in the folders of scripts
    under it (the red team's); results/ holds data only."""
    found = []
    for folder in [BENCH, *sorted(p for p in (BENCH / "redteam").iterdir() if p.is_dir())]:
        found += sorted(f for f in folder.iterdir() if f.suffix in (".py", ".sh"))
    return found


def test_every_benchmark_has_a_line_in_the_index_and_every_result_is_under_results():
    """benchmarks/README.md is the index: each script has a table row naming it by its path (what it
    measures, how long it takes, where its results go). benchmarks/ holds scripts, the index, the red
    team's folder and results/, the one folder of results."""
    rows = [line for line in (BENCH / "README.md").read_text().splitlines() if line.startswith("|")]
    missing = [str(f.relative_to(PKG.parent)) for f in _bench_scripts()
               if not any(f"benchmarks/{f.relative_to(BENCH).as_posix()}" in row for row in rows)]
    assert not missing, f"scripts without a line in benchmarks/README.md: {missing}"
    stray = sorted(p.name for p in BENCH.iterdir() if p.name != "__pycache__"
                   and p.suffix not in (".py", ".sh") and p.name not in ("README.md", "results", "redteam"))
    assert not stray, f"benchmarks/ holds scripts, README.md, redteam/ and results/ only: {stray}"
    assert (BENCH / "results").is_dir()


_BENCH_PATH = re.compile(r"(--out[ =]|--json[ =]|OUT=|> ?)?(benchmarks/[A-Za-z0-9_.*/{},<>-]*[A-Za-z0-9_*/}>])")


def _expand(path: str) -> list[str]:
    """``a_{1,2}.json`` as ``a_1.json`` and ``a_2.json``; a placeholder ``<name>`` as ``*``."""
    path = path.rstrip(".")
    if path.endswith("}") and "{" not in path:
        path = path[:-1]  # the end of a shell default, ${OUT:-benchmarks/...}
    m = re.search(r"\{([^{}]*)\}", path)
    if not m:
        return [re.sub(r"<[^<>]*>", "*", path)]
    return [q for alt in m.group(1).split(",") for q in _expand(path[:m.start()] + alt + path[m.end():])]


def test_every_benchmarks_path_the_docs_and_code_name_exists():
    """Every ``benchmarks/...`` path written in the README, docs/, the changelog, the tests, the package,
    examples/, scripts/ and the benchmarks' own scripts and READMEs names something that exists (a glob
    matches something); an output path (after --out, --json, OUT= or >) names an existing folder."""
    root = PKG.parent
    sources = {f for pattern in ("README.md", "CHANGELOG.md", "docs/*.md", "tests/**/*.py", "clipbias/**/*.py",
                                 "examples/**/*.py", "examples/**/*.md", "scripts/**/*", "benchmarks/*.py",
                                 "benchmarks/*.sh", "benchmarks/README.md", "benchmarks/redteam/**/*")
               for f in root.glob(pattern) if f.is_file() and f.suffix in (".md", ".py", ".sh", "")} - {pathlib.Path(__file__)}
    broken = []
    for f in sorted(sources):
        for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for m in _BENCH_PATH.finditer(line):
                for path in _expand(m.group(2)):
                    ok = bool(glob.glob(str(root / path)))
                    if not ok and m.group(1):
                        ok = (root / path.rstrip("/")).parent.is_dir()
                    if not ok:
                        broken.append(f"{f.relative_to(root)}:{n}: {path}")
    assert not broken, "\n".join(broken)


def test_the_recipes_name_files_and_tests_that_exist():
    """docs/architecture.md's recipes (method, accountant, data set, layer rule) name real files, tests and
    commands: every path in backquotes exists (``<name>`` is the new module's), every ``test_...`` it names
    is defined in tests/, and the commands name modules that run."""
    root = PKG.parent
    recipes = "".join(RECIPES.split(f"\n## {s}\n", 1)[1].split("\n## ", 1)[0]
                      for s in ("Adding a method", "Adding an accountant", "Adding a data set", "Adding a layer rule"))
    paths = {p for p in re.findall(r"`((?:clipbias|tests|docs)/[\w/.<>]+?)(?:::\w+)?`", recipes) if "<" not in p}
    paths |= set(re.findall(r"\b((?:clipbias|tests|docs)/[\w/]+\.(?:py|md|json))\b", recipes))
    assert len(paths) >= 15 and [p for p in sorted(paths) if not (root / p).exists()] == []
    defined = set(re.findall(r"^def (test_\w+)", "".join(p.read_text() for p in (root / "tests").glob("test_*.py")), re.M))
    named = set(re.findall(r"`(?:[\w/.]+::)?(test_\w+)`", recipes))
    assert named and named - defined == set(), named - defined
    for stem in re.findall(r"`(test_\w+)_\.\.\.`|`\.\.\.(_\w+)`", recipes):  # abbreviated names: a prefix or a suffix
        assert any(d.startswith(stem[0]) if stem[0] else d.endswith(stem[1]) for d in defined), stem
    for module in re.findall(r"python -m ([\w.]+)", recipes):
        assert (root / (module.replace(".", "/") + ".py")).exists(), module
