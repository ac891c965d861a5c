"""The installable package: the optional dependencies are optional (the library, the engine and a
training run work without them, and what needs one says which extra installs it), the extras in
pyproject.toml are the ones the errors name, the version has one source, and the API reference
builds without warnings."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from clipbias.errors import EXTRAS, MissingDependencyError, require

ROOT = Path(__file__).resolve().parent.parent
OPTIONAL = ("kymatio", "sklearn", "matplotlib")

# Runs with the optional packages unimportable, as if not installed (a None entry in sys.modules makes
# `import x` raise ModuleNotFoundError and importlib.util.find_spec(x) return None).
_WITHOUT = """
import json, sys
BLOCKED = {blocked!r}
for name in BLOCKED:
    sys.modules[name] = None
import torch
import clipbias, clipbias.engine, clipbias.privacy
from clipbias.config import AlgoConfig
from clipbias.engine import DPEngine

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
before = [p.detach().clone() for p in model.parameters()]
engine = DPEngine(model, "dpsgd", n=32, batch_size=8, steps=1, noise_multiplier=1.0,
                  config=AlgoConfig(lr=0.1, clip=1.0))
idx = engine.sampler.sample()
engine.step(x[idx], y[idx], idx)
moved = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED and sys.modules[m] is not None)
print(json.dumps({{"steps": engine.steps_taken, "moved": moved, "epsilon": engine.privacy().epsilon,
                  "loaded": loaded}}))
"""


def _without(code: str, blocked=OPTIONAL) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code.format(blocked=blocked)], cwd=ROOT, capture_output=True,
                          text=True, env={"PYTHONPATH": str(ROOT), "PATH": ""}, timeout=120)


def test_the_engine_trains_without_the_optional_dependencies():
    r = _without(_WITHOUT)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["steps"] == 1 and got["moved"] and 0 < got["epsilon"] < float("inf")
    assert got["loaded"] == [], got["loaded"]


def test_clipbias_train_without_matplotlib_skips_the_figure_with_a_notice(tmp_path):
    """``clipbias train`` on the user's own arrays (npz) needs no optional package: results.json is
    written, curves.png is not, and one line says why and what to install."""
    import numpy as np
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x_train=rng.normal(size=(64, 5)).astype(np.float32),
             y_train=rng.integers(0, 2, 64), x_test=rng.normal(size=(16, 5)).astype(np.float32),
             y_test=rng.integers(0, 2, 16))
    out = tmp_path / "run"
    code = ("import sys\nfor n in {blocked!r}: sys.modules[n] = None\nfrom clipbias.cli import main\n"
            f"rc = main(['train', '--data', 'npz', '--data-path', {str(tmp_path / 'd.npz')!r}, '--model', 'mlp', "
            f"'--algo', 'dpsgd', '--epochs', '1', '--batch-size', '16', '--lr', '0.1', '--clip', '1', "
            f"'--noise-multiplier', '1', '--out', {str(out)!r}, '--quiet'])\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in {blocked!r} and sys.modules[m]]\n"
            "sys.exit(rc)")
    r = _without(code)
    assert r.returncode == 0, r.stderr
    assert (out / "results.json").exists() and not (out / "curves.png").exists()
    notice = [line for line in r.stderr.splitlines() if "curves.png not written" in line]
    assert len(notice) == 1 and 'pip install "clipbias[plots]"' in notice[0], r.stderr
    assert f"results           {out}/results.json\n" in r.stdout  # the summary lists only what was written


@pytest.fixture
def absent(monkeypatch):
    """Make a package and its submodules unimportable in this process, as if not installed."""
    def block(*names: str) -> None:
        for name in names:
            for m in [m for m in sys.modules if m.startswith(name + ".")]:
                monkeypatch.setitem(sys.modules, m, None)
            monkeypatch.setitem(sys.modules, name, None)
    return block


def test_what_needs_an_optional_package_names_its_extra(absent):
    from clipbias.data import load_dataset
    from clipbias.models.scatter import ScatterFeatures
    absent("sklearn", "kymatio")
    with pytest.raises(MissingDependencyError, match=r'the digits data set needs scikit-learn, which is not '
                                                     r'installed: pip install "clipbias\[datasets\]"'):
        load_dataset("digits")
    import torch
    with pytest.raises(MissingDependencyError, match=r'needs kymatio.*pip install "clipbias\[scatter\]"'):
        ScatterFeatures((8, 8)).compute(torch.zeros(2, 1, 8, 8))
    with pytest.raises(ImportError):  # still an ImportError for code that catches those
        require("sklearn.model_selection", "a split")


def test_a_broken_install_is_not_reported_as_missing(monkeypatch):
    """Only the package itself missing becomes the install hint; an import error inside an installed
    package (one of its own dependencies missing) propagates unchanged."""
    def broken(name, *a, **k):
        raise ModuleNotFoundError("No module named 'scipy.special._gone'", name="scipy.special._gone")
    monkeypatch.setattr("importlib.import_module", broken)
    with pytest.raises(ModuleNotFoundError) as e:
        require("matplotlib", "a figure")
    assert not isinstance(e.value, MissingDependencyError)


@pytest.mark.parametrize("argv", [["toy", "--problem", "dice-b1", "--algo", "dpsgd"],
                                  ["diagnose", "--data", "digits", "--model", "logreg", "--algo", "dpsgd"]])
def test_the_figure_commands_refuse_at_once_without_matplotlib(argv, absent, tmp_path, capsys):
    from clipbias.cli import main
    absent("matplotlib")
    assert main(argv + ["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert 'needs matplotlib, which is not installed: pip install "clipbias[plots]"' in err
    assert "--no-figure" in err and not (tmp_path / "out").exists()


def test_the_extras_are_the_ones_the_errors_name():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]

    def names(reqs: list[str]) -> set[str]:
        return {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in reqs}

    for module, (dist, extra) in EXTRAS.items():
        assert dist in names(extras[extra]), (module, extra)
        assert dist not in names(meta["dependencies"]), f"{dist} is optional"
    assert set(extras["all"][0].partition("[")[2].rstrip("]").split(",")) == {e for _, e in EXTRAS.values()}
    setup = (ROOT / "scripts/setup.sh").read_text()
    assert "-e '.[all,docs,test]'" in setup  # the suite runs everything: the docs build included


def test_the_version_is_the_changelogs_latest_release():
    """One source: ``clipbias.__version__``, which the package metadata reads (pyproject.toml)."""
    import clipbias
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "clipbias.__version__"}
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert releases and releases[0] == clipbias.__version__
    assert "## [Unreleased]" in (ROOT / "CHANGELOG.md").read_text()


def test_the_api_reference_builds_without_warnings(tmp_path):
    """``mkdocs build --strict`` (mkdocs.yml: the docs pages and the reference generated from the
    docstrings by mkdocstrings): a warning (a broken link, bad docstring markup, a missing object) fails."""
    try:
        import mkdocstrings_handlers.python  # noqa: F401
    except ImportError:
        pytest.fail('the docs build needs the docs extra: pip install -e ".[docs]" (scripts/setup.sh installs it)')
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    page = (site / "reference" / "index.html").read_text()
    for name in ("integrations.opacus.PrivacyEngine", "integrations.validators.ModuleValidator", "engine.DPEngine", "config.AlgoConfig", "privacy.account", "privacy.calibrate",
                 "privacy.PrivacyReport", "randomness.SecretKey", "sampling.PoissonSampler",
                 "sampling.PoissonLoader", "data.load_dataset", "models.build_model", "errors.ConfigError",
                 "errors.MissingDependencyError"):
        assert f'id="clipbias.{name}"' in page, name


def test_the_wheel_ships_py_typed_and_the_license_and_its_page_has_no_broken_link(tmp_path):
    """The wheel built from the package's files (``pip wheel``, no network: the environment's setuptools):
    ``clipbias/py.typed`` (PEP 561: type checkers read the annotations), the MIT ``LICENSE`` with its SPDX
    expression in the metadata, the ``hf`` extra's transformers pin, and a long description (README) with no
    relative link, which would be broken on the package page."""
    import importlib.metadata
    import shutil
    import zipfile
    try:
        setuptools_major = int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        setuptools_major = 0
    if setuptools_major < 77:
        pytest.skip("building the wheel offline needs setuptools >= 77 in this environment (pyproject.toml)")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "clipbias", src / "clipbias", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "--disable-pip-version-check", "-w", str(tmp_path / "dist"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    [wheel] = (tmp_path / "dist").glob("clipbias-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
        license_files = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
        assert "clipbias/py.typed" in names
        assert len(license_files) == 1
        license_text = z.read(license_files[0]).decode()
    assert license_text.startswith("MIT License") and "the clipbias authors" in license_text
    assert "License-Expression: MIT" in meta and "License-File: LICENSE" in meta
    assert 'Requires-Dist: transformers>=5; extra == "hf"' in meta
    description = meta.partition("\n\n")[2]
    relative = re.findall(r"\]\((?!https?://|#)([^)]*)\)", description)
    assert description.startswith("# clipbias") and relative == [], relative


def test_the_hf_extra_pins_the_transformers_dptrainer_requires():
    """``pip install "clipbias[hf]"`` must not be satisfied by a transformers DPTrainer refuses."""
    source = (ROOT / "clipbias/integrations/transformers.py").read_text()
    required = re.search(r'int\(transformers\.__version__\.split\("\."\)\[0\]\) < (\d+)', source).group(1)
    hf = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["hf"]
    assert f"transformers>={required}" in hf, hf
