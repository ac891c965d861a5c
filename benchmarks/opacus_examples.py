"""Opacus's own example scripts, run unchanged with Opacus and with only their import lines changed to clipbias.

The scripts are not in this repository (they are Opacus's, under Opacus's licence): they are read from the
user's Opacus checkout, ``--opacus-repo PATH`` (its ``examples/`` folder, e.g. a clone of
https://github.com/pytorch/opacus, or ``git archive`` of one). For each example and library a fresh process

* installs offline stand-in data (the examples download their data sets): ``torchvision.datasets.MNIST`` reads
  Fashion-MNIST from the Debian package (``clipbias.data.read_idx``; scikit-learn's digits upsampled to 28x28
  where it is missing), ``torchvision.datasets.CIFAR10`` is a synthetic learnable set of 32x32x3 images (ten
  class templates, shifted, under noise), char-lstm's ``--data-root`` is a generated names folder (one
  ``<Language>.txt`` per class, names built from each language's syllables) and ``pl_bolts``'s
  ``MNISTDataModule``, where pl_bolts is missing, is the MNIST stand-in's; sizes: ``--n-train``/``--n-test``
  or each example's default below;
* for ``opacus``: runs the script's source as it is, as ``__main__`` (argv, ``sys.path[0]`` as
  ``python examples/X.py`` would have them, the working directory a scratch folder);
* for ``clipbias``: rewrites the lines of the script's ``opacus`` imports by ``IMPORT_MAP`` (same line numbers:
  nothing else changes) and blocks ``import opacus`` in that process, so that no Opacus code runs. An Opacus
  name clipbias lacks is a GAP: its import binds a placeholder that raises ``GapError`` when used, so a script
  runs as far as it gets without it.

It prints a markdown table: example, library, the example's own metric (test accuracy, parsed from what the
script prints; dcgan: the last D(x) and D(G(z)) of its progress bar, D(G(z)) before / after that batch's
discriminator step), epsilon (``get_epsilon(delta)`` of the last ``PrivacyEngine`` the script
built, at the example's delta; recorded by wrapping ``PrivacyEngine.__init__``), wall seconds (the script's run in
its process, imports of torch and torchvision excluded) and the status: ``ok`` or the first error line. Then
the import swaps, the GAPs and each failure with where it was raised. ``--out F.md`` writes the same text;
``--keep`` keeps the scratch folders (each run's stdout.txt and stderr.txt).

Needs torchvision (the examples import it; clipbias does not depend on it): install it beside the environment,
not into it (``pip install --no-deps --target /tmp/tv_site torchvision==0.28.0``; PyPI's Linux wheels are CUDA
builds whose C++ operators do not load with a CPU torch, which ``import_torchvision`` works around for the
examples, but in ``.venv`` it breaks transformers' and Lightning's imports), and Opacus on the path for the
Opacus arm::

    git --git-dir=OPACUS_GIT archive HEAD examples | (mkdir -p /tmp/opacus_src && tar x -C /tmp/opacus_src)
    pip install --no-deps --target /tmp/opacus_site opacus==1.6.0
    PYTHONPATH=.:/tmp/opacus_site:/tmp/tv_site python benchmarks/opacus_examples.py --opacus-repo /tmp/opacus_src \\
        --examples mnist,cifar10,dcgan,char-lstm,mnist_lightning

Time on 2 CPU cores: 8 min 12 s for the five examples and two libraries (timed, other jobs running; each run is capped by
``--timeout``, default 300 s).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path


# ------------------------------------------------------------------------------------------ the examples
@dataclass(frozen=True)
class Example:
    script: str            # path inside the Opacus checkout
    args: tuple            # the script's own flags; {data} is the data folder, {out} the scratch folder
    delta: float           # the example's delta (its --delta default or the value passed)
    metric: str            # how to read its metric from what it prints: a key of METRICS
    n_train: int           # stand-in sizes (MNIST/CIFAR10 train, test; names per language)
    n_test: int
    env: dict = field(default_factory=dict)


EXAMPLES = {
    "mnist": Example("examples/mnist.py",
                     ("--data-root", "{data}", "--device", "cpu", "-n", "2", "-b", "64", "--test-batch-size",
                      "1000"), 1e-5, "mnist", 6000, 2000),
    "cifar10": Example("examples/cifar10.py",
                       ("--data-root", "{data}", "--device", "cpu", "--epochs", "2", "--batch-size", "250",
                        "--batch-size-test", "500", "--workers", "0", "--checkpoint-file", "{out}/checkpoint"),
                       1e-5, "cifar10", 5000, 1000),
    "dcgan": Example("examples/dcgan.py",
                     ("--data-root", "{data}", "--device", "cpu", "--epochs", "1", "--batch-size", "32",
                      "--imageSize", "64", "--ngf", "16", "--ndf", "16", "--workers", "0", "--outf", "{out}/dcgan",
                      "--manualSeed", "1"), 1e-5, "dcgan", 10000, 100),
    "char-lstm": Example("examples/char-lstm-classification.py",
                         ("--data-root", "{data}/names", "--device", "cpu", "--batch-size", "60", "--epochs", "4",
                          "--hidden-size", "64", "--learning-rate", "2.0"), 8e-5, "char-lstm", 250, 0),
    "mnist_lightning": Example("examples/mnist_lightning.py", (), 1e-5, "lightning", 2000, 1000,
                               {"LIGHTNING_VANILLA": "true"}),  # main(): Trainer(max_epochs=10), batch 64
}

IMPORT_MAP = {
    "opacus.PrivacyEngine": "clipbias:PrivacyEngine",
    "opacus.layers.DPLSTM": "clipbias.layers:DPLSTM",
    "opacus.layers.DPGRU": "clipbias.layers:DPGRU",
    "opacus.layers.DPRNN": "clipbias.layers:DPRNN",
    "opacus.layers.dp_rnn.DPLSTM": "clipbias.layers:DPLSTM",
    "opacus.validators.ModuleValidator": "clipbias:ModuleValidator",
    "opacus.validators.module_validator.ModuleValidator": "clipbias:ModuleValidator",
    "opacus.utils.batch_memory_manager.BatchMemoryManager": "clipbias:BatchMemoryManager",
    "opacus.data_loader.DPDataLoader": "clipbias.integrations:DPDataLoader",
    "opacus.optimizers.DPOptimizer": "clipbias.integrations:DPOptimizer",
    "opacus.GradSampleModule": "clipbias.integrations:DPModule",
    "opacus.lightning.DPLightningDataModule": "clipbias.integrations.lightning:DPLightningDataModule",
}
"""Opacus name -> ``module:name`` in clipbias. Anything else imported from ``opacus`` is a GAP. Not mapped on
purpose: ``opacus.distributed``'s DDP wrapper
(clipbias distributes the step itself, ``clipbias.distributed``), ``opacus.grad_sample.functorch``."""

LIBS = ("opacus", "clipbias")
RESULT = "__opacus_examples_result__.json"


def rewrite_imports(src: str) -> tuple[str, list, list]:
    """The script with its ``opacus`` imports rewritten by ``IMPORT_MAP`` (line for line), the swaps made
    (``old -> new``) and the GAPs (Opacus names clipbias lacks, bound to ``_clipbias_gap(...)``)."""
    lines = src.splitlines(keepends=True)
    swaps, gaps = [], []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "opacus":
            names = [(f"{node.module}.{a.name}", a.name, a.asname or a.name) for a in node.names]
        elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "opacus" for a in node.names):
            names = [(a.name, a.name, a.asname or a.name.split(".")[0]) for a in node.names]
        else:
            continue
        stmts, by_module = [], {}
        for qual, name, bind in names:
            if qual.split(".")[0] != "opacus":
                stmts.append(f"import {qual}" + (f" as {bind}" if bind != qual.split('.')[0] else ""))
            elif qual in IMPORT_MAP:
                module, new = IMPORT_MAP[qual].split(":")
                by_module.setdefault(module, []).append(new + (f" as {bind}" if bind != new else ""))
            else:
                stmts.append(f"{bind} = _clipbias_gap({qual!r})")
                gaps.append(qual)
        stmts = [f"from {m} import {', '.join(ns)}" for m, ns in by_module.items()] + stmts
        old = "".join(lines[node.lineno - 1:node.end_lineno]).strip()
        new = "; ".join(stmts)
        swaps.append(f"`{' '.join(old.split())}` -> `{new}`")
        indent = lines[node.lineno - 1][:node.col_offset]
        lines[node.lineno - 1] = indent + new + "\n"
        for i in range(node.lineno, node.end_lineno):
            lines[i] = "\n"
    return "".join(lines), swaps, gaps


# ------------------------------------------------------------------------------------------ stand-in data
def _mnist_arrays(train: bool, n: int):
    """``n`` uint8 28x28 images and labels: Fashion-MNIST's, else scikit-learn's digits upsampled."""
    import numpy as np
    import torch
    try:
        from clipbias.data import fashion_mnist_dir, read_idx
        d = fashion_mnist_dir()
        pre = "train" if train else "t10k"
        x = read_idx(d / f"{pre}-images-idx3-ubyte.gz", 3)[:n]
        y = read_idx(d / f"{pre}-labels-idx1-ubyte.gz", 1)[:n]
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y.astype(np.int64))
    except (ImportError, OSError) as exc:
        print(f"[stand-in] Fashion-MNIST not readable ({exc}); using scikit-learn's digits", file=sys.stderr)
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.nn.functional.interpolate(torch.tensor(d.images, dtype=torch.float32)[:, None], size=28,
                                        mode="bilinear", align_corners=False)[:, 0]
    x, y = (x / 16 * 255).round().clamp(0, 255).to(torch.uint8), torch.tensor(d.target, dtype=torch.int64)
    cut = int(0.8 * len(y))
    x, y = (x[:cut], y[:cut]) if train else (x[cut:], y[cut:])
    return x[:n], y[:n]


def _cifar_arrays(train: bool, n: int):
    """``n`` synthetic 32x32x3 uint8 images in ten classes: a class's smooth colour template (the same for
    train and test), shifted by up to 6 pixels, scaled, under uniform noise."""
    import torch
    t = torch.nn.functional.interpolate(torch.rand(10, 3, 4, 4, generator=torch.Generator().manual_seed(10)),
                                        size=32, mode="bicubic", align_corners=False).clamp(0, 1)
    g = torch.Generator().manual_seed(11 if train else 12)
    y = torch.randint(0, 10, (n,), generator=g)
    shift = torch.randint(-6, 7, (n, 2), generator=g)
    x = torch.stack([t[c].roll((int(a), int(b)), dims=(1, 2)) for c, (a, b) in zip(y.tolist(), shift)])
    x = 0.25 * x * (0.6 + 0.8 * torch.rand(n, 1, 1, 1, generator=g)) + 0.75 * torch.rand(n, 3, 32, 32, generator=g)
    x = (x.clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()
    return x, y.tolist()


SYLLABLES = {
    "English": (["Ash", "Brad", "Crom", "Hamp", "Whit", "Ather", "Brom"], ["ley", "ford", "ton", "wood", "ham",
                                                                            "wick", "field", "son"]),
    "Italian": (["Ros", "Bel", "Mar", "Cap", "Lom", "Ferr", "Gal"], ["etti", "ucci", "ini", "ello", "ardi",
                                                                       "one", "azzo", "ola"]),
    "Japanese": (["Ta", "Ya", "Ki", "Naka", "Mori", "Haya", "Fuji"], ["moto", "mura", "shita", "hara", "kawa",
                                                                        "yama", "saki", "da"]),
    "Polish": (["Ko", "Wiś", "Zieliń", "Dąb", "Kowal", "Szym", "Łuk"], ["ski", "czyk", "owski", "iak", "ewicz",
                                                                           "ańczyk", "ska", "ek"]),
    "Greek": (["Papa", "Geor", "Nik", "Dimi", "Kon", "Ath", "Chri"], ["opoulos", "akis", "idis", "ou", "iadis",
                                                                        "atos", "elis", "as"]),
    "Russian": (["Ivan", "Smir", "Kuzn", "Pop", "Sokol", "Lebed", "Mor"], ["ov", "ova", "enko", "sky", "in",
                                                                             "evich", "yev", "ikov"]),
}


def write_names(folder: Path, per_language: int) -> None:
    """char-lstm's layout: one ``<Language>.txt`` per class, one name a line (``data/names`` of the PyTorch
    tutorial); a name is one of the language's starts, an optional shared middle and one of its endings."""
    import random
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    middles = ["", "", "an", "er", "ol", "im", "ar"]
    for lang, (starts, ends) in SYLLABLES.items():
        names = {rng.choice(starts) + rng.choice(middles) + rng.choice(ends) for _ in range(per_language * 4)}
        names = sorted(names)
        rng.shuffle(names)
        rows = [names[i % len(names)] for i in range(per_language)]
        (folder / f"{lang}.txt").write_text("\n".join(rows) + "\n", encoding="utf-8")


_TORCHVISION_SCHEMAS = []


def import_torchvision() -> None:
    """Import torchvision where its C++ operators do not load: PyPI's Linux wheels are built against CUDA
    torch, and with a CPU torch torchvision 0.28's import fails registering a fake kernel for
    ``torchvision::nms``, an operator its missing library would have defined. Define the schemas of ``nms`` and
    ``qnms``
    (no kernel) and import again; the examples use none of torchvision's operators."""
    import torch
    try:
        import torchvision
        return
    except RuntimeError as exc:
        if "operator torchvision::" not in str(exc):
            raise
    for m in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
        del sys.modules[m]
    lib = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):  # the two registered unguarded (torchvision/_meta_registrations.py)
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION_SCHEMAS.append(lib)
    print("[runner] torchvision's C++ operators did not load (a CUDA build?): defined the nms and qnms "
          "schemas to import it", file=sys.stderr)
    import torchvision  # noqa: F401


def install_standins(n_train: int, n_test: int) -> None:
    """Replace torchvision's downloading MNIST and CIFAR10 by the offline stand-ins; a ``pl_bolts`` with the
    ``MNISTDataModule`` that ``mnist_lightning.py`` imports where the real one is missing."""
    import_torchvision()
    import torchvision.datasets as tvd
    from torchvision.datasets.vision import VisionDataset

    class MNIST(tvd.MNIST):
        def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
            VisionDataset.__init__(self, root, transform=transform, target_transform=target_transform)
            self.train = train
            self.data, self.targets = _mnist_arrays(train, n_train if train else n_test)

    class CIFAR10(tvd.CIFAR10):
        def __init__(self, root, train=True, transform=None, target_transform=None, download=False):
            VisionDataset.__init__(self, root, transform=transform, target_transform=target_transform)
            self.train = train
            self.data, self.targets = _cifar_arrays(train, n_train if train else n_test)
            self.classes = [f"class{i}" for i in range(10)]
            self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

    tvd.MNIST, tvd.CIFAR10 = MNIST, CIFAR10
    tvd.mnist.MNIST, tvd.cifar.CIFAR10 = MNIST, CIFAR10
    try:
        import pl_bolts.datamodules  # noqa: F401
    except ImportError:
        _pl_bolts_standin(MNIST)


def _pl_bolts_standin(mnist) -> None:
    import types

    import pytorch_lightning as pl
    import torch
    from torchvision import transforms

    class MNISTDataModule(pl.LightningDataModule):
        """pl_bolts's MNISTDataModule as far as mnist_lightning.py uses it: 20% of train held out for
        validation, ToTensor, batches of ``batch_size``."""

        def __init__(self, data_dir=".", val_split=0.2, batch_size=32, num_workers=0, **_):
            super().__init__()
            self.batch_size, self.num_workers = batch_size, num_workers
            full = mnist(data_dir, train=True, transform=transforms.ToTensor())
            n_val = int(val_split * len(full))
            self.train, self.val = torch.utils.data.random_split(
                full, [len(full) - n_val, n_val], generator=torch.Generator().manual_seed(42))
            self.test = mnist(data_dir, train=False, transform=transforms.ToTensor())

        def _loader(self, ds, shuffle=False):
            return torch.utils.data.DataLoader(ds, batch_size=self.batch_size, shuffle=shuffle,
                                               num_workers=self.num_workers)

        def train_dataloader(self):
            return self._loader(self.train, shuffle=True)

        def val_dataloader(self):
            return self._loader(self.val)

        def test_dataloader(self):
            return self._loader(self.test)

    pkg, mod = types.ModuleType("pl_bolts"), types.ModuleType("pl_bolts.datamodules")
    mod.MNISTDataModule, pkg.datamodules, pkg.__path__ = MNISTDataModule, mod, []
    sys.modules.update({"pl_bolts": pkg, "pl_bolts.datamodules": mod})


# ------------------------------------------------------------------------------------------ the child
class GapError(NotImplementedError):
    """An Opacus name the script uses that clipbias does not offer."""


class _Gap:
    def __init__(self, qual: str) -> None:
        self._qual = qual

    def _fail(self, *_, **__):
        raise GapError(f"GAP: clipbias has no equivalent of {self._qual}")

    __call__ = _fail

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self._fail()

    def __repr__(self) -> str:
        return f"<GAP {self._qual}>"


class _BlockOpacus:
    """A meta-path finder refusing ``opacus`` in the clipbias arm: no Opacus code runs there."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opacus":
            raise ModuleNotFoundError(f"No module named {name!r} (Opacus is blocked in the clipbias arm)", name=name)


def _outplace_activations() -> None:
    """``nn.ReLU``/``nn.LeakyReLU`` built with ``inplace=False`` whatever the script asks: Opacus 1.6's backward
    hooks fail on torch 2.13 when an in-place activation follows a hooked layer (the dcgan example); out of place
    the activations compute the same values. For the Opacus arm only (``--opacus-outplace``)."""
    import torch.nn as nn
    for cls in (nn.ReLU, nn.LeakyReLU):
        init = cls.__init__

        def outplace(self, *a, _init=init, _slope=cls is nn.LeakyReLU, **k):
            k.pop("inplace", None)
            a = a[:1] if _slope else ()  # (LeakyReLU's negative_slope; the flag is the other positional)
            _init(self, *a, inplace=False, **k)
        cls.__init__ = outplace


def lightning_1x_names() -> None:
    """The Lightning 1.x names mnist_lightning.py uses, mapped to today's Lightning (2.x) and torchmetrics for
    both arms (the script fails on both libraries without them): ``pytorch_lightning.utilities.cli.LightningCLI``
    (now ``pytorch_lightning.cli``), ``trainer._data_connector._train_dataloader_source`` (now
    ``trainer.fit_loop._data_source``) and ``torchmetrics.Accuracy()`` without ``task`` (torchmetrics < 0.11
    inferred multiclass; here ``task="multiclass", num_classes=10``, MNIST's)."""
    import types

    import pytorch_lightning.cli
    import torchmetrics
    from pytorch_lightning.trainer.connectors.data_connector import _DataConnector
    cli = types.ModuleType("pytorch_lightning.utilities.cli")
    cli.LightningCLI = pytorch_lightning.cli.LightningCLI
    sys.modules["pytorch_lightning.utilities.cli"] = cli
    _DataConnector._train_dataloader_source = property(lambda self: self.trainer.fit_loop._data_source)
    accuracy = torchmetrics.Accuracy

    def Accuracy(*a, **k):  # noqa: N802 - torchmetrics's name
        if not a and "task" not in k:
            k.update(task="multiclass", num_classes=10)
        return accuracy(*a, **k)
    torchmetrics.Accuracy = Accuracy


def child(cfg: dict) -> None:
    """Run one example under one library in this process; write RESULT in the working directory."""
    script = Path(cfg["script"])
    install_standins(cfg["n_train"], cfg["n_test"])
    if cfg.get("lightning_1x"):
        lightning_1x_names()
    src, swaps, gaps = script.read_text(encoding="utf-8"), [], []
    engines = []
    if cfg["lib"] == "clipbias":
        sys.meta_path.insert(0, _BlockOpacus())
        src, swaps, gaps = rewrite_imports(src)
        import clipbias
        from clipbias.integrations.opacus import PrivacyEngine
        lib = f"clipbias {clipbias.__version__} from {Path(clipbias.__file__).parent}"
    else:
        import opacus
        from opacus import PrivacyEngine
        if cfg.get("outplace"):
            _outplace_activations()
        lib = f"opacus {opacus.__version__} from {Path(opacus.__file__).parent}"
    init = PrivacyEngine.__init__
    if cfg.get("clipbias_options") and cfg["lib"] == "clipbias":
        make = PrivacyEngine.make_private

        def make_private(self, *a, **k):  # (``--clipbias-options``: keywords added to every make_private)
            return make(self, *a, **{**k, **cfg["clipbias_options"]})
        PrivacyEngine.make_private = make_private

    def recorded_init(self, *a, **k):
        engines.append(self)
        init(self, *a, **k)
    PrivacyEngine.__init__ = recorded_init

    sys.argv = [str(script), *cfg["argv"]]
    sys.path[0] = str(script.parent)
    g = {"__name__": "__main__", "__file__": str(script), "__builtins__": __builtins__,
         "_clipbias_gap": _Gap}
    error, where = None, None
    t0 = time.perf_counter()
    try:
        exec(compile(src, str(script), "exec", dont_inherit=True), g)  # noqa: S102 - running the example is the point
    except SystemExit as exc:
        if exc.code not in (None, 0):
            error = f"SystemExit: {exc.code}"
    except BaseException as exc:  # noqa: BLE001 - the finding is the error itself
        traceback.print_exc()
        msg = str(exc).strip().splitlines()
        error = f"{type(exc).__name__}: {msg[0] if msg else ''}".strip()
        tb = traceback.extract_tb(exc.__traceback__)
        in_script = [f for f in tb if f.filename == str(script)]
        where = "; ".join(x for x in (f"{script.name}:{in_script[-1].lineno}" if in_script else "",
                                      f"raised at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else "") if x)
    wall = time.perf_counter() - t0
    eps, certified = None, None
    for e in engines:
        try:
            eps = float(e.get_epsilon(cfg["delta"]))
        except Exception as exc:  # noqa: BLE001 - an engine that never stepped
            print(f"[runner] get_epsilon failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        report = getattr(e, "privacy_report", None)  # (clipbias's: certified, and the caveats' first words)
        if cfg["lib"] == "clipbias" and report is not None:
            try:
                r = report()
                certified = "yes" if r.certified else "no: " + "; ".join(c[:70] for c in r.caveats)
            except Exception:  # noqa: BLE001
                pass
    Path(RESULT).write_text(json.dumps({"wall_s": wall, "error": error, "where": where, "epsilon": eps,
                                        "certified": certified,
                                        "swaps": swaps, "gaps": gaps, "lib_from": lib}))


# ------------------------------------------------------------------------------------------ the parent
_NUM = r"([-+0-9.eE]+|nan)"
METRICS = {
    "mnist": lambda t: _last(rf"Accuracy: \d+/\d+ \({_NUM}%\)", t, lambda m: f"accuracy {float(m[0]) / 100:.3f}"),
    "cifar10": lambda t: _last(rf"Test set:\s*Loss: \S+ Acc@1: {_NUM}", t, lambda m: f"accuracy {float(m[0]):.3f}"),
    "char-lstm": lambda t: _last(rf"Test Accuracy: {_NUM}", t, lambda m: f"accuracy {float(m[0]):.3f}"),
    "dcgan": lambda t: _last(rf"D\(x\): {_NUM} D\(G\(z\)\): {_NUM}/{_NUM}", t,
                             lambda m: f"D(x) {float(m[0]):.3f}, D(G(z)) {float(m[1]):.3f}/{float(m[2]):.3f}"),
    "lightning": lambda t: _last(rf"test_accuracy\W+{_NUM}", t, lambda m: f"accuracy {float(m[0]):.3f}"),
}


def _last(pattern: str, text: str, fmt):
    found = re.findall(pattern, text)
    if not found:
        return None
    m = found[-1]
    return fmt(m if isinstance(m, tuple) else (m,))


def run_one(name: str, ex: Example, lib: str, repo: Path, args, scratch: Path) -> dict:
    out = scratch / f"{name}-{lib}"
    data = out / "data"
    data.mkdir(parents=True, exist_ok=True)
    n_train = args.n_train or ex.n_train
    n_test = args.n_test or ex.n_test
    if name == "char-lstm":
        write_names(data / "names", n_train)
    argv = [a.format(data=data, out=out) for a in ex.args]
    if args.epochs and "--epochs" in argv:
        argv[argv.index("--epochs") + 1] = str(args.epochs)
    cfg = {"lib": lib, "script": str(repo / ex.script), "argv": argv, "delta": ex.delta, "n_train": n_train,
           "n_test": n_test, "outplace": args.opacus_outplace, "lightning_1x": name == "mnist_lightning",
           "clipbias_options": dict(_option(o) for o in args.clipbias_options.split(",") if o)}
    env = {**os.environ, **ex.env, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    with open(out / "stdout.txt", "w") as so, open(out / "stderr.txt", "w") as se:
        try:
            rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(cfg)],
                                cwd=out, env=env, stdout=so, stderr=se, timeout=args.timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    total = time.perf_counter() - t0
    text = (out / "stdout.txt").read_text(errors="replace") + "\n" + \
        (out / "stderr.txt").read_text(errors="replace").replace("\r", "\n")
    res = json.loads((out / RESULT).read_text()) if (out / RESULT).exists() else \
        {"wall_s": None, "epsilon": None, "certified": None, "swaps": [], "gaps": [], "where": None, "lib_from": None,
         "error": f"timed out after {args.timeout} s" if rc == "timeout" else
         (_last_error(text) or f"process exited with {rc}")}
    if rc == "timeout" and not res["error"]:
        res["error"] = f"timed out after {args.timeout} s"
    if res["epsilon"] is None:  # the last epsilon the script printed, if any
        res["epsilon"] = _last(rf"ε = {_NUM}", text, lambda m: float(m[0]))
    res.update(example=name, lib=lib, metric=METRICS[ex.metric](text), process_s=total, dir=str(out))
    return res


def _option(text: str) -> tuple:
    """``k=v`` as ``(k, v)``, ``v`` a bool, an int, a float or the string."""
    k, _, v = text.partition("=")
    for parse in (lambda s: {"True": True, "False": False}[s], int, float):
        try:
            return k.strip(), parse(v.strip())
        except (KeyError, ValueError):
            pass
    return k.strip(), v.strip()


def _last_error(text: str) -> str | None:
    errs = [ln for ln in text.splitlines() if re.match(r"^[A-Za-z_.]*(Error|Exception|Killed)\b", ln)]
    return errs[-1] if errs else None


def report(results: list, args) -> str:
    rows = ["| example | library | metric | epsilon | certified | wall s | status |", "|---|---|---|---|---|---|---|"]
    for r in results:
        eps = f"{r['epsilon']:.2f}" if r["epsilon"] is not None else "-"
        wall = f"{r['wall_s']:.1f}" if r["wall_s"] is not None else f"({r['process_s']:.0f})"
        status = "ok" if not r["error"] else "FAILED: " + r["error"].replace("|", "\\|")[:160]
        cert = (r.get("certified") or "-").replace("|", "\\|")
        rows.append(f"| {r['example']} | {r['lib']} | {r['metric'] or '-'} | {eps} | {cert} | {wall} | {status} |")
    import torch
    froms = sorted({r["lib_from"] for r in results if r.get("lib_from")})
    lines = rows + ["", f"torch {torch.__version__}; " + "; ".join(froms), "", "Import swaps (clipbias arm):"]
    seen = set()
    for r in results:
        if r["lib"] == "clipbias" and r["example"] not in seen:
            seen.add(r["example"])
            lines += [f"- {r['example']}: {s}" for s in r["swaps"]]
    gaps = [(r["example"], g) for r in results if r["lib"] == "clipbias" for g in r["gaps"]]
    lines += ["", "GAPs (Opacus names the examples import that clipbias lacks):"]
    lines += [f"- {ex}: `{g}`" for ex, g in gaps] or ["- none"]
    lines += ["", "Failures (first error line; where):"]
    lines += [f"- {r['example']} / {r['lib']}: {r['error']} ({r['where'] or 'see ' + r['dir'] + '/stderr.txt'})"
              for r in results if r["error"]] or ["- none"]
    lines += ["", "Stand-in data: MNIST = Fashion-MNIST (or sklearn digits), CIFAR10 = synthetic, names = "
              "generated; n_train/n_test per example: "
              + ", ".join(_sizes(n, args) for n in args.examples) + ". wall s: the script's run in its process (in parentheses: "
              "the whole process, where the script's own time is missing)."]
    return "\n".join(lines)


def _sizes(name: str, args) -> str:
    n_train, n_test = args.n_train or EXAMPLES[name].n_train, args.n_test or EXAMPLES[name].n_test
    return f"{name} {n_train} names per language" if name == "char-lstm" else f"{name} {n_train}/{n_test}"


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(json.loads(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--opacus-repo", required=True, type=Path, help="an Opacus checkout (with examples/)")
    p.add_argument("--examples", default=",".join(EXAMPLES), help=f"comma-separated, of {', '.join(EXAMPLES)}")
    p.add_argument("--libs", default=",".join(LIBS), help="opacus,clipbias (the arms, in that order)")
    p.add_argument("--n-train", type=int, default=0, help="stand-in training size (0: the example's default)")
    p.add_argument("--n-test", type=int, default=0, help="stand-in test size (0: the example's default)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per run")
    p.add_argument("--epochs", type=int, default=0,
                   help="epochs for the examples that take --epochs (0: each example's default above)")
    p.add_argument("--clipbias-options", default="",
                   help="clipbias arm: keywords added to make_private, e.g. public_clip=True (comma-separated k=v; "
                        "values True/False/numbers); the script is otherwise unchanged")
    p.add_argument("--opacus-outplace", action="store_true",
                   help="Opacus arm: build nn.ReLU/nn.LeakyReLU out of place (Opacus 1.6's hooks fail on torch 2.13 "
                        "after an in-place activation, as in the dcgan example; the values are the same)")
    p.add_argument("--out", type=Path, help="also write the report (markdown) here")
    p.add_argument("--keep", action="store_true", help="keep the scratch folders (stdout/stderr of each run)")
    args = p.parse_args()
    args.examples = [e for e in args.examples.split(",") if e]
    libs = [lib for lib in args.libs.split(",") if lib]
    unknown = [e for e in args.examples if e not in EXAMPLES] + [lib for lib in libs if lib not in LIBS]
    if unknown:
        p.error(f"unknown: {unknown}")
    missing = [EXAMPLES[e].script for e in args.examples if not (args.opacus_repo / EXAMPLES[e].script).is_file()]
    if missing:
        p.error(f"not in {args.opacus_repo}: {missing} (--opacus-repo is an Opacus checkout)")
    scratch = Path(tempfile.mkdtemp(prefix="opacus_examples_"))
    results = []
    try:
        for name in args.examples:
            for lib in libs:
                print(f"[{name} / {lib}] ...", file=sys.stderr, flush=True)
                r = run_one(name, EXAMPLES[name], lib, args.opacus_repo.resolve(), args, scratch)
                print(f"[{name} / {lib}] {r['metric']} eps={r['epsilon']} {r['process_s']:.0f} s "
                      f"{r['error'] or 'ok'}", file=sys.stderr, flush=True)
                results.append(r)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    text = report(results, args)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.keep:
        print(f"\nScratch folders: {scratch}", file=sys.stderr)


if __name__ == "__main__":
    main()
