"""Issue 17's bad-input suite: one table of bad inputs and faults, CLI and API.

Every case runs in a fresh copy of prepared run directories (a finished run, a run interrupted after
its first epoch, a finished run's results.json alone, earlier compares, a truncated checkpoint, an
export, a file in the way) and asserts

* the exit code (CLI, through the in-process ``main``) or the exception type (API), never a traceback;
* that the message names the bad value and the fix (substrings);
* that every file that existed before is byte-identical afterwards, that only the files the case
  names appeared, and that no temporary of an atomic write is left behind.

Faults inside a write (a full disk, Ctrl-C, SIGTERM) are injected where the operating system would
raise them: the file object of the atomic write's temporary raises in the middle of torch.save.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
from torch import nn

from clipbias.cli import main
from clipbias.cli._common import Terminated
from clipbias.config import AlgoConfig
from clipbias.data.catalog import IdxFormatError
from clipbias.engine.core import DPEngine
from clipbias.errors import ClipbiasError, ConfigError, NonFiniteGradientError, UnsupportedModelError
from clipbias.privacy import gaussian
from clipbias.run.training import TrainConfig, train
from tests.test_data import write_fake_fashion, write_idx

# digits (N = 1347), logreg, one epoch, a given noise multiplier (no calibration): about a second.
FLAGS = ["--data", "digits", "--model", "logreg", "--algo", "dpsgd", "--noise-multiplier", "1", "--epochs", "1",
         "--batch-size", "64", "--lr", "0.5", "--accountant", "rdp", "--threads", "1", "--quiet"]
TRAIN = ["train", *FLAGS]
HALF = ["train", *FLAGS, "--epochs", "2"]  # the prepared run "half": stopped after epoch 1 of 2
COMPARE = ["compare", "--data", "digits", "--model", "logreg", "--algos", "dpsgd", "--seeds", "0", "--epochs", "1",
           "--batch-size", "64", "--lr", "0.5", "--noise-multiplier", "1", "--accountant", "rdp", "--threads",
           "1", "--quiet"]
ENOSPC = lambda: OSError(errno.ENOSPC, "No space left on device")  # noqa: E731


def cli(argv: list[str]) -> tuple[int, str]:
    """(exit code, stderr) of ``clipbias ARGV`` run in-process; argparse errors exit via SystemExit."""
    import contextlib
    import io
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


class _Failing:
    """A file object that writes ``after`` bytes, then raises ``exc()`` as the OS (ENOSPC) or a signal
    handler (KeyboardInterrupt) would, in the middle of the write."""

    def __init__(self, raw: Any, exc: Callable[[], BaseException], after: int = 300) -> None:
        self.raw, self.exc, self.left = raw, exc, after

    def write(self, data: Any) -> int:
        if len(data) > self.left:
            self.raw.write(bytes(data)[:self.left])
            self.left = 0
            raise self.exc()
        self.left -= len(data)
        return self.raw.write(data)

    def __enter__(self) -> "_Failing":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.raw.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


def fail_write(target: str, exc: Callable[[], BaseException], nth: int = 1):
    """A setup that makes the ``nth`` atomic write of a file named ``target`` fail mid-write."""
    def setup(tmp: Path, mp: pytest.MonkeyPatch) -> None:
        real, seen = os.fdopen, [0]

        def fdopen(fd, mode="r", *a, **k):
            fh = real(fd, mode, *a, **k)
            name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
            if "w" in mode and name.startswith(f".{target}.tmp"):
                seen[0] += 1
                if seen[0] == nth:
                    return _Failing(fh, exc)
            return fh
        mp.setattr(os, "fdopen", fdopen)
    return setup


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """The directories every case starts from (built once, copied per case)."""
    root = tmp_path_factory.mktemp("prepared")
    assert cli([*TRAIN, "--out", root / "run"])[0] == 0
    mp = pytest.MonkeyPatch()
    import clipbias.run.training as library
    check = library._refuse_diverged

    def ctrl_c_in_epoch_2(run, rec, history, out):  # after epoch 1's checkpoint, before epoch 2's
        check(run, rec, history, out)
        if rec["epoch"] == 2:
            raise KeyboardInterrupt
    mp.setattr(library, "_refuse_diverged", ctrl_c_in_epoch_2)
    code, err = cli([*HALF, "--out", root / "half"])
    mp.undo()
    assert code == 130 and "--resume" in err, err
    assert cli(["export", root / "run", root / "model.pt"])[0] == 0
    (root / "done").mkdir()
    (root / "done" / "results.json").write_text('{"kept": true}\n')
    (root / "cmp").mkdir()
    (root / "cmp" / "compare.json").write_text('{"old": true}\n')
    (root / "cmp" / "curves.png").write_bytes(b"old png")
    (root / "cmp2" / "dpsgd-s0").mkdir(parents=True)  # an interrupted compare: per-run results only
    (root / "cmp2" / "dpsgd-s0" / "results.json").write_text('{"seed": 0}\n')
    (root / "trunc").mkdir()
    (root / "trunc" / "checkpoint.pt").write_bytes((root / "run" / "checkpoint.pt").read_bytes()[:100])
    (root / "empty").mkdir()
    (root / "blocker").write_text("a file in the way\n")
    return root


def tree(root: Path) -> dict[str, str | None]:
    """Every path under ``root``: sha256 of a file, None for a directory."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
            for p in sorted(root.rglob("*"))}


@dataclass
class Case:
    """One bad input: ``argv`` (CLI, with ``{tmp}``) or ``call(tmp)`` (API); the exit code or exception
    type expected; substrings of the message (with ``{tmp}``); an optional ``setup(tmp, monkeypatch)``;
    ``creates``: paths that may appear; ``then(tmp)``: further assertions."""

    id: str
    expect: int | type
    needles: tuple[str, ...]
    argv: list | None = None
    call: Callable[[Path], Any] | None = None
    setup: Callable[[Path, pytest.MonkeyPatch], None] | None = None
    creates: tuple[str, ...] = ()
    then: Callable[[Path], None] | None = None


def C(id, argv, code, *needles, **kw) -> Case:
    return Case(id, code, needles, argv=argv, **kw)


def A(id, call, exc, *needles, **kw) -> Case:
    return Case(id, exc, needles, call=call, **kw)


def with_flag(argv: list, flag: str, value: str | None) -> list:
    """``argv`` with ``flag`` set to ``value`` (removed if None; appended if absent)."""
    argv = list(argv)
    if flag in argv:
        i = argv.index(flag)
        argv[i:i + 2] = [] if value is None else [flag, value]
    elif value is not None:
        argv += [flag, value]
    return argv


def T(flag: str, value: str | None, out: str = "{tmp}/new") -> list:
    return with_flag(TRAIN, flag, value) + ["--out", out]


def engine(model: nn.Module | None = None, **kw) -> DPEngine:
    """A tiny private engine: 4 features, 3 classes, n = 100, B = 10, 3 steps (RDP: accounted at once)."""
    torch.manual_seed(0)
    args = dict(n=100, batch_size=10.0, steps=3, noise_multiplier=1.0, config=AlgoConfig(lr=0.1), noise_seed=0,
                accountant="rdp")
    return DPEngine(model if model is not None else nn.Linear(4, 3), "dpsgd", **(args | kw))


def bn_model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))


def step(x: Callable[[], Any], y: Callable[[], Any], model: Callable[[], nn.Module] | None = None,
         after_build: Callable[[DPEngine], Any] | None = None) -> Callable[[Path], None]:
    """A step on a bad batch: it must raise before changing anything (weights, steps taken)."""
    def call(tmp: Path) -> None:
        eng = engine(model() if model else None)
        if after_build:
            after_build(eng)
        before = [p.detach().clone() for p in eng.params]
        try:
            eng.step(x(), y())
        finally:
            assert eng.steps_taken == 0 and all(torch.equal(a, b) for a, b in zip(before, eng.params))
    return call


def steps_past_budget(eng: DPEngine) -> None:
    for _ in range(eng.total_steps):
        eng.step(torch.randn(2, 4), torch.zeros(2, dtype=torch.long))
    assert eng.steps_taken == eng.total_steps
    eng.step(torch.randn(2, 4), torch.zeros(2, dtype=torch.long))


def lock(name: str):
    """A setup holding the lock of ``{tmp}/name`` as another run would."""
    def setup(tmp: Path, mp: pytest.MonkeyPatch):
        fh = open(tmp / name / ".clipbias.lock", "a+")
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fh
    return setup


def corrupt_fashion(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    """Fake Fashion-MNIST files with one label byte of 200 (a 201-class model, before issue 17)."""
    (tmp / "fm").mkdir()
    write_fake_fashion(tmp / "fm")
    labels = np.arange(6, dtype=np.uint8) % 10
    labels[3] = 200
    write_idx(tmp / "fm" / "train-labels-idx1-ubyte.gz", labels)
    mp.setenv("CLIPBIAS_FASHION_MNIST_DIR", str(tmp / "fm"))
    mp.setenv("CLIPBIAS_CACHE_DIR", str(tmp / "cache"))


def diverged_is_recorded(tmp: Path) -> None:
    res = json.loads((tmp / "new" / "results.json").read_text())
    assert res["diverged"] is True and "test_accuracy" not in res


def unwritable(tmp: Path, mp: pytest.MonkeyPatch) -> None:
    """As root every directory is writable: the permission check is what is tested."""
    import clipbias.run.checkpoint as ck
    mp.setattr(ck.os, "access", lambda path, mode: Path(path) != tmp)


def t(*flag_values: str, out: str = "{tmp}/new", base: list = TRAIN, extra: tuple = ()) -> list:
    argv = list(base)
    for flag, value in zip(flag_values[::2], flag_values[1::2]):
        argv = with_flag(argv, flag, value)
    return argv + list(extra) + ["--out", out]


def cmp(*flag_values: str, out: str = "{tmp}/c") -> list:
    return t(*flag_values, out=out, base=COMPARE)


CREATED_RUN = ("new",)  # the lock file is removed when the run ends
ACCOUNT = ["account", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5"]

CASES = [
    # --out: refused before any work, nothing created or changed
    C("out-is-a-file", t(out="{tmp}/blocker"), 2, "--out {tmp}/blocker is a file", "choose a directory path"),
    C("out-under-a-file", t(out="{tmp}/blocker/run"), 2, "lies under the file {tmp}/blocker", "choose a directory"),
    C("out-unwritable", t(), 2, "{tmp} is not writable", "choose a directory you can write to", setup=unwritable),
    C("out-holds-finished-results", t(out="{tmp}/done"), 2, "already holds a finished run's results.json",
      "--overwrite"),
    C("out-holds-checkpoint", t(out="{tmp}/run"), 2, "{tmp}/run already holds a checkpoint", "--resume",
      "--overwrite"),
    C("out-in-use", t(out="{tmp}/run", extra=("--overwrite",)), 2, "in use by another clipbias run",
      "choose another --out", setup=lock("run")),
    C("resume-without-checkpoint", t(extra=("--resume",)), 2, "no checkpoint at {tmp}/new/checkpoint.pt",
      "without --resume"),
    C("resume-changed-lr", t("--lr", "0.25", base=HALF, out="{tmp}/half", extra=("--resume",)), 2,
      "--lr changed (checkpoint 0.5, now 0.25)", "original setting"),
    C("resume-truncated-checkpoint", t(out="{tmp}/trunc", extra=("--resume",)), 2,
      "{tmp}/trunc/checkpoint.pt is truncated or corrupted", "--overwrite"),
    C("train-into-a-compare", t(out="{tmp}/cmp"), 2, "{tmp}/cmp holds a compare (compare.json, curves.png)",
      "--overwrite"),
    C("overwrite-refused-moves-nothing", t("--subset", "0", out="{tmp}/run", extra=("--overwrite",)), 2,
      "--subset must be an integer >= 1, got 0"),
    # settings
    C("batch-size-fraction", t("--batch-size", "0.5"), 2, "got 0.5", "must be >= 1"),
    C("batch-size-zero", t("--batch-size", "0"), 2, "--batch-size", "got 0"),
    C("batch-size-above-n", t("--batch-size", "5000"), 2, "[1, N=1347]", "got 5000"),
    C("batch-size-not-a-number", t("--batch-size", "abc"), 2, "--batch-size: invalid float value: 'abc'"),
    C("epochs-zero", t("--epochs", "0"), 2, "--epochs must be an integer >= 1, got 0"),
    C("epochs-fraction", t("--epochs", "2.5"), 2, "--epochs: invalid int value: '2.5'"),
    C("lr-nan", t("--lr", "nan"), 2, "--lr must be a positive finite number, got nan"),
    C("lr-zero", t("--lr", "0"), 2, "--lr must be a positive finite number, got 0.0"),
    C("clip-negative", t("--clip", "-1"), 2, "--clip must be a positive finite number, got -1.0"),
    C("delta-above-one", t("--delta", "2"), 2, "--delta must lie in (0, 1), got 2.0"),
    C("delta-zero", t("--delta", "0"), 2, "--delta must lie in (0, 1), got 0.0"),
    C("noise-negative", t("--noise-multiplier", "-1"), 2, "--noise-multiplier", "-1"),
    C("noise-zero", t("--noise-multiplier", "0"), 2, "--noise-multiplier", "got 0.0"),
    C("noise-1e-9-pld", t("--noise-multiplier", "1e-9", "--accountant", "pld"), 2, "1e-09 < 0.1",
      "--accountant rdp"),
    C("noise-0.01-pld-no-hang", t("--noise-multiplier", "0.01", "--accountant", "pld"), 2, "0.01 < 0.1",
      "larger --noise-multiplier"),
    C("epsilon-and-noise", t("--epsilon", "3"), 2, "give either --epsilon or --noise-multiplier, not both"),
    C("epsilon-negative", t("--noise-multiplier", None, "--epsilon", "-1"), 2,
      "--epsilon must be a positive finite number, got -1.0"),
    C("no-privacy-budget", t("--noise-multiplier", None), 2, "--epsilon is required", "--noise-multiplier"),
    C("ef-clip-without-feedback", t("--ef-clip", "0.1"), 2, "--algo dpsgd has no clipped feedback buffer",
      "drop --ef-clip"),
    C("ef-clip-negative", t("--algo", "dice", "--ef-clip", "-1"), 2,
      "--ef-clip must be a positive finite number, got -1.0"),
    C("subset-zero", t("--subset", "0"), 2, "--subset must be an integer >= 1, got 0"),
    C("subset-above-n", t("--subset", "100000"), 2, "<= the 1347 training examples, got 100000"),
    C("validation-above-n", t("--validation", "100000"), 2, "--validation 100000 must be smaller than the training"),
    C("max-physical-batch-zero", t("--max-physical-batch", "0"), 2,
      "--max-physical-batch must be an integer >= 1, got 0"),
    C("threads-negative", t("--threads", "-1"), 2, "--threads must be >= 0", "got -1"),
    C("momentum-one-and-a-half", t("--momentum", "1.5"), 2, "--momentum must lie in [0, 1), got 1.5"),
    C("weight-decay-negative", t("--weight-decay", "-1"), 2, "--weight-decay must be a finite number >= 0, got -1.0"),
    C("seed-negative", t("--seed", "-1"), 2, "--seed must be an integer >= 0, got -1"),
    C("image-model-on-flat-data", t("--model", "cnn"), 2, "--model cnn does not fit --data digits", "(64,)"),
    C("gamma-zero", t("--algo", "normalized", "--gamma", "0"), 2, "--gamma must be a positive finite number"),
    C("fast-path-where-it-does-not-apply", t("--algo", "perturb", "--grad-path", "fast"), 2,
      "--grad-path fast is not available", "--grad-path auto or --grad-path rows"),
    C("batch-clip-without-public-data", t("--algo", "batch-clip"), 2, "needs public features", "--public-size N"),
    C("refuted-bound-outside-its-conditions", t("--algo", "dice", "--dice-accounting", "paper"), 2, "z=1",
      "--dice-accounting sound"),
    C("unknown-accountant", t("--accountant", "moments"), 2, "invalid choice: 'moments'", "pld"),
    C("fashion-mnist-corrupted-label", t("--data", "fashion-mnist", "--batch-size", "2"), 2,
      "label 200 at index 3", "apt-get install --reinstall", setup=corrupt_fashion),
    # faults while training and writing
    C("diverged-run", t("--lr", "1e38"), 2, "training diverged in epoch 1", "Lower --lr (now 1e+38)",
      creates=(*CREATED_RUN, "new/results.json"), then=diverged_is_recorded),
    C("disk-full-checkpoint", t(), 2, "cannot write {tmp}/new/checkpoint.pt", "No space left on device",
      "Check the free disk space", setup=fail_write("checkpoint.pt", ENOSPC)),
    C("ctrl-c-in-first-checkpoint-write", t(), 130, "interrupted before the first epoch ended",
      "start the run again", setup=fail_write("checkpoint.pt", KeyboardInterrupt)),
    C("sigterm-in-first-checkpoint-write", t(), 143, "terminated (SIGTERM)", "no checkpoint was written",
      setup=fail_write("checkpoint.pt", Terminated)),
    C("ctrl-c-in-resumed-checkpoint-write", t(base=HALF, out="{tmp}/half", extra=("--resume",)), 130,
      "the last epoch-end checkpoint is in {tmp}/half/checkpoint.pt", "plus --resume",
      setup=fail_write("checkpoint.pt", KeyboardInterrupt)),
    C("disk-full-curves", t(), 2, "cannot write {tmp}/new/curves.png", "No space left on device",
      setup=fail_write("curves.png", ENOSPC),
      creates=(*CREATED_RUN, "new/checkpoint.pt", "new/results.json")),
    # export
    C("export-onto-existing-file", ["export", "{tmp}/run", "{tmp}/model.pt"], 2, "FILE {tmp}/model.pt exists",
      "--overwrite"),
    C("export-onto-the-checkpoint", ["export", "{tmp}/run", "{tmp}/run/checkpoint.pt", "--overwrite"], 2,
      "must not be the private checkpoint", "another file name"),
    C("export-without-checkpoint", ["export", "{tmp}/empty", "{tmp}/w.pt"], 2, "no checkpoint at {tmp}/empty",
      "train with --out DIR first"),
    C("export-truncated-checkpoint", ["export", "{tmp}/trunc", "{tmp}/w.pt"], 2, "truncated or corrupted"),
    C("export-under-a-file", ["export", "{tmp}/run", "{tmp}/blocker/w.pt"], 2, "cannot write {tmp}/blocker/w.pt",
      "A file is in the way", "choose another path"),
    C("export-overwrite-disk-full", ["export", "{tmp}/run", "{tmp}/model.pt", "--overwrite"], 2,
      "cannot write {tmp}/model.pt", "No space left on device", "the previous file, if any, is unchanged",
      setup=fail_write("model.pt", ENOSPC)),
    C("export-overwrite-ctrl-c", ["export", "{tmp}/run", "{tmp}/model.pt", "--overwrite"], 130, "interrupted",
      setup=fail_write("model.pt", KeyboardInterrupt)),
    # compare
    C("compare-into-a-train-run", cmp(out="{tmp}/run"), 2, "already holds results.json, checkpoint.pt, curves.png",
      "--overwrite"),
    C("compare-twice", cmp(out="{tmp}/cmp"), 2, "already holds compare.json, curves.png", "--overwrite"),
    C("compare-after-an-interrupted-compare", cmp(out="{tmp}/cmp2"), 2, "already holds dpsgd-s0", "--overwrite"),
    C("compare-in-use", cmp(out="{tmp}/cmp") + ["--overwrite"], 2, "in use by another clipbias run", setup=lock("cmp")),
    C("compare-out-is-a-file", cmp(out="{tmp}/blocker"), 2, "{tmp}/blocker is a file"),
    C("compare-unknown-algorithm", cmp("--algos", "nope"), 2, "unknown algorithm 'nope'", "choose from"),
    C("compare-algorithm-twice", cmp("--algos", "dpsgd") + ["--algos", "dpsgd", "dpsgd"], 2,
      "each algorithm may appear once", "dpsgd dpsgd"),
    C("compare-accounting-of-a-gaussian-method", cmp("--algos", "dpsgd:paper"), 2, "--algos dpsgd:paper",
      "applies only to DiceSGD"),
    C("compare-ef-ratio-zero", cmp("--ef-ratio", "0"), 2, "--ef-ratio must be > 0, got 0.0"),
    C("compare-ef-ratio-and-ef-clip", cmp("--ef-ratio", "0.1", "--ef-clip", "0.1"), 2,
      "give --ef-clip or --ef-ratio, not both"),
    C("compare-negative-seed", cmp("--seeds", "-1"), 2, "--seeds must be an integer >= 0, got -1"),
    # diagnose and toy: a file in the way is refused before the (long) recording or runs
    C("diagnose-out-is-a-file", ["diagnose", *FLAGS[:-1], "--out", "{tmp}/blocker"], 2,
      "--out {tmp}/blocker is a file", "choose a directory path"),
    C("diagnose-out-under-a-file", ["diagnose", *FLAGS[:-1], "--out", "{tmp}/blocker/d"], 2,
      "lies under the file {tmp}/blocker"),
    C("toy-figure-under-a-file", ["toy", "--problem", "chen-ex2", "--algo", "dpsgd", "--steps", "10", "--out",
                                  "{tmp}/blocker"], 2, "--out {tmp}/blocker is a file"),
    C("toy-figure-exists", ["toy", "--problem", "chen-ex2", "--algo", "dpsgd", "--steps", "10", "--figure",
                            "{tmp}/blocker"], 2, "{tmp}/blocker exists (an earlier figure)", "--overwrite"),
    # accounting
    C("account-noise-1e-9-pld", [*ACCOUNT, "--noise-multiplier", "1e-9"], 2, "1e-09 < 0.1", "--accountant rdp"),
    C("account-sample-rate-above-one", [*ACCOUNT, "--noise-multiplier", "1", "--sample-rate", "1.5"], 2,
      "--sample-rate", "1.5"),
    # API misuse
    A("engine-fed-more-rows-than-n", lambda tmp: engine().train_epoch(torch.randn(200, 4),
                                                                     torch.zeros(200, dtype=torch.long)),
      ConfigError, "200 inputs", "n=100", "pass exactly the n training examples"),
    A("engine-fractional-batch", lambda tmp: engine(batch_size=0.5), ConfigError, "[1, N=100], got 0.5"),
    A("engine-fractional-n", lambda tmp: engine(n=10.5), ConfigError, "n must be a positive integer, got 10.5"),
    A("engine-model-not-a-module", lambda tmp: engine(model="mlp"), ConfigError,
      "model must be a torch.nn.Module, got str"),
    A("engine-config-a-dict", lambda tmp: engine(config={"lr": 0.1}), ConfigError, "config must be an AlgoConfig",
      "got dict"),
    A("engine-identity-model", lambda tmp: engine(model=nn.Identity()), ConfigError,
      "(Identity) has no trainable parameters"),
    A("engine-batchnorm-in-train-mode", lambda tmp: engine(model=bn_model()), UnsupportedModelError,
      "BatchNorm1d", "nn.GroupNorm"),
    A("step-batchnorm-switched-to-train", step(lambda: torch.randn(5, 4), lambda: torch.zeros(5, dtype=torch.long),
                                               model=lambda: bn_model().eval(), after_build=lambda e: e.model.train()),
      UnsupportedModelError, "BatchNorm1d", "GroupNorm"),
    A("step-x-y-length-mismatch", step(lambda: torch.randn(5, 4), lambda: torch.zeros(4, dtype=torch.long)),
      ConfigError, "5 inputs, 4 labels", "one label (and index) per input"),
    A("step-float-labels", step(lambda: torch.randn(5, 4), lambda: torch.zeros(5)), ConfigError, "torch.float32",
      "y.long()"),
    A("step-2d-labels", step(lambda: torch.randn(5, 4), lambda: torch.zeros(5, 1, dtype=torch.long)), ConfigError,
      "got shape (5, 1)", "y.view(-1)"),
    A("step-negative-labels", step(lambda: torch.randn(5, 4), lambda: torch.full((5,), -100)), ConfigError,
      "got -100", "negative ones are not classes"),
    A("step-labels-out-of-range", step(lambda: torch.randn(5, 4), lambda: torch.full((5,), 9)), ConfigError,
      "(given: 9..9)", "class indices the model can output"),
    A("step-wrong-feature-size", step(lambda: torch.randn(5, 7), lambda: torch.zeros(5, dtype=torch.long)),
      ConfigError, "shape (7,)", "the shape and dtype the model expects"),
    A("step-numpy-inputs", step(lambda: np.zeros((5, 4), np.float32), lambda: torch.zeros(5, dtype=torch.long)),
      ConfigError, "got ndarray", "torch.as_tensor(x)"),
    A("step-nan-inputs", step(lambda: torch.full((5, 4), float("nan")), lambda: torch.zeros(5, dtype=torch.long)),
      NonFiniteGradientError, "example(s) [0, 1, 2, 3, 4]", "Check the input data for NaN/Inf"),
    A("step-past-the-budget", lambda tmp: steps_past_budget(engine()), ConfigError, "covers 3 steps and all were taken",
      "more `epochs`"),
    A("load-state-of-something-else", lambda tmp: engine().load_state_dict({"model": {}}), ConfigError,
      "not a DPEngine state", "DPEngine.state_dict()"),
    A("pld-noise-1e-9", lambda tmp: gaussian.epsilon(1e-9, 0.01, 100, 1e-5, "pld"), gaussian.NoiseTooSmallError,
      "1e-09", "`accountant='rdp'`"),
    A("pld-noise-0.01-no-hang", lambda tmp: gaussian.epsilon(0.01, 0.01, 100, 1e-5, "pld"),
      gaussian.NoiseTooSmallError, "0.01", "larger `noise_multiplier`"),
    A("config-fractional-batch", lambda tmp: TrainConfig(data="digits", model="logreg", algo="dpsgd", epsilon=3.0,
                                                        batch_size=0.5), ConfigError, "got 0.5"),
    A("config-ef-clip-without-feedback", lambda tmp: TrainConfig(data="digits", model="logreg", algo="dpsgd",
                                                                epsilon=3.0, ef_clip=0.1),
      ConfigError, "drop `ef_clip`"),
    A("train-into-a-file", lambda tmp: train(TrainConfig(data="digits", model="logreg", algo="dpsgd",
                                                         noise_multiplier=1.0, out=str(tmp / "blocker"))),
      ConfigError, "{tmp}/blocker'` is a file"),
    A("fashion-mnist-corrupted-label-api", lambda tmp: __import__("clipbias.data.catalog").data.load_dataset(
        "fashion-mnist", data_dir=tmp / "fm"), IdxFormatError, "label 200", "--reinstall", setup=corrupt_fashion),
]


@pytest.fixture
def case_dir(prepared: Path, tmp_path: Path) -> Path:
    tmp = tmp_path / "t"
    shutil.copytree(prepared, tmp, symlinks=True)
    return tmp


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, case_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = case_dir
    held = case.setup(tmp, monkeypatch) if case.setup else None
    before = tree(tmp)
    try:
        if case.argv is not None:
            code, message = cli([str(a).format(tmp=tmp) for a in case.argv])
            assert code == case.expect, message
            assert "Traceback" not in message
        else:
            with pytest.raises(ClipbiasError) as info:
                case.call(tmp)
            assert isinstance(info.value, case.expect), info.value
            message = str(info.value)
    finally:
        monkeypatch.undo()
        if held is not None:
            held.close()
    for needle in case.needles:
        assert needle.format(tmp=tmp) in message, (needle, message)
    after = tree(tmp)
    assert {p: h for p, h in after.items() if p in before} == before  # byte-identical, nothing removed
    assert set(after) - set(before) <= set(case.creates)
    assert not [p for p in after if ".tmp" in Path(p).name]  # no temporary of an atomic write is left
    if case.then is not None:
        case.then(tmp)


def test_the_table_is_large_and_every_case_names_something():
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)
    assert all(c.needles for c in CASES)


def test_numpy_integer_n_is_accepted():
    """``n=np.int64(200)`` used to be refused with a misleading message (issue 17)."""
    assert engine(n=np.int64(200)).n == 200


def test_an_interrupted_compare_overwrite_keeps_the_old_compare_whole(prepared, tmp_path, monkeypatch):
    """compare --overwrite sets the old compare aside (``.previous``) before its first run: interrupted,
    the old files are whole there and no new compare.json sits beside new per-run results; finished,
    the old ones are gone (issue 17: compare used to replace compare.json, results and curves.png)."""
    import clipbias.run.training as training  # compare imports run_many from there when it runs
    out = tmp_path / "cmp"
    shutil.copytree(prepared / "cmp", out)
    old = tree(out)

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(training, "run_many", interrupted)
    code, err = cli([*COMPARE, "--out", out, "--overwrite"])
    assert code == 130 and "interrupted" in err
    assert tree(out / ".previous") == old and not (out / "compare.json").exists()
    monkeypatch.undo()
    assert cli([*COMPARE, "--out", out, "--overwrite"])[0] == 0
    assert not (out / ".previous").exists() and json.loads((out / "compare.json").read_text())["rows"]
