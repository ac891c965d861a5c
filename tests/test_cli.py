"""The command line: account/calibrate/train/compare/export, their outputs and their refusals."""

from __future__ import annotations

import json

import pytest
import torch

from clipbias.cli import main

PUBLISHED = ["--noise-multiplier", "1.1", "--sample-rate", "0.004266666666666667", "--steps", "14063",
             "--delta", "1e-5"]
# digits (N = 1347), logreg: a whole training run takes about a second.
TRAIN = ["train", "--data", "digits", "--model", "logreg", "--algo", "dpsgd", "--epsilon", "3",
         "--delta", "1e-5", "--epochs", "1", "--batch-size", "64", "--lr", "0.5", "--clip", "1",
         "--accountant", "rdp", "--threads", "1", "--quiet"]  # compare's tests keep the default --threads


def run(argv, capsys):
    """(exit code, stdout, stderr) of ``clipbias ARGV``; argparse errors exit via SystemExit."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def _replace(argv, flag, value):
    argv = list(argv)
    if flag in argv:
        i = argv.index(flag)
        if value is None:
            del argv[i:i + 2]
        else:
            argv[i + 1] = value
    else:
        argv += [flag, value]
    return argv


# ----------------------------------------------------------------------------- account / calibrate

@pytest.mark.parametrize("acc,expected", [("pld", 2.382), ("rdp", 2.597)])
def test_account_published_values(capsys, acc, expected):
    code, out, _ = run(["account", *PUBLISHED, "--accountant", acc, "--json"], capsys)
    assert code == 0
    d = json.loads(out)
    assert {"epsilon", "delta", "accountant", "basis", "certified"} <= set(d)
    assert d["epsilon"] == pytest.approx(expected, abs=1e-3) and d["certified"] is True


def test_console_spells_booleans_as_the_json_does(capsys):
    """true/false (never Python's True/False) and none for an empty list, as in results.json."""
    code, out, _ = run(["account", *PUBLISHED, "--accountant", "rdp"], capsys)
    lines = dict(line.split(None, 1) for line in out.splitlines())
    assert code == 0 and lines["certified"] == "true" and lines["caveats"] == "none"
    assert "True" not in out and "False" not in out and "[]" not in out
    from clipbias.cli._common import plain
    assert [plain(v) for v in (False, None, [], ["a", "b"], (True, 2))] == ["false", "none", "none", "a; b", "true; 2"]


def test_calibrate_json_has_noise_multiplier(capsys):
    code, out, _ = run(["calibrate", "--epsilon", "2", "--sample-rate", "0.01", "--steps", "100",
                        "--delta", "1e-5", "--accountant", "rdp", "--json"], capsys)
    assert code == 0
    d = json.loads(out)
    assert d["noise_multiplier"] > 0 and d["epsilon"] <= 2


def test_account_dice_authors_is_not_certified(capsys):
    code, out, _ = run(["account", "--algo", "dice", "--noise-multiplier", "2", "--sample-rate", "0.01",
                        "--steps", "100", "--delta", "1e-5", "--batch-size", "100",
                        "--dice-accounting", "authors", "--accountant", "rdp", "--json"], capsys)
    assert code == 0 and json.loads(out)["certified"] is False


ACCOUNT = ["account", *PUBLISHED]
CALIBRATE = ["calibrate", "--epsilon", "2", "--sample-rate", "0.01", "--steps", "100", "--delta", "1e-5"]


@pytest.mark.parametrize("base,flag,value", [
    (ACCOUNT, "--noise-multiplier", "0"), (ACCOUNT, "--noise-multiplier", "-1"),
    (ACCOUNT, "--noise-multiplier", "abc"), (ACCOUNT, "--sample-rate", "0"),
    (ACCOUNT, "--sample-rate", "1.5"), (ACCOUNT, "--steps", "0"), (ACCOUNT, "--steps", "2.5"),
    (ACCOUNT, "--delta", "0"), (ACCOUNT, "--delta", "1"), (ACCOUNT, "--delta", "-1e-5"),
    (ACCOUNT, "--accountant", "moments"), (ACCOUNT, "--dataset-size", "0"),
    (ACCOUNT + ["--algo", "dice", "--batch-size", "10"], "--clip", "0"),
    (ACCOUNT + ["--algo", "dice", "--batch-size", "10"], "--ef-clip", "-1"),
    (ACCOUNT + ["--algo", "dice", "--batch-size", "10"], "--grad-bound", "0"),
    (ACCOUNT + ["--algo", "dice"], "--batch-size", "0"),
    (ACCOUNT + ["--algo", "dice", "--batch-size", "10"], "--dice-accounting", "magic"),
    (ACCOUNT, "--algo", "adam"),
    (CALIBRATE, "--epsilon", "0"), (CALIBRATE, "--epsilon", "-2"), (CALIBRATE, "--epsilon", "inf"),
    (CALIBRATE, "--sample-rate", "2"), (CALIBRATE, "--steps", "-3"), (CALIBRATE, "--delta", "2"),
    (CALIBRATE, "--accountant", "x"),
])
def test_account_calibrate_bad_flags(capsys, base, flag, value):
    code, out, err = run(_replace(base, flag, value), capsys)
    assert code != 0
    assert flag in err, err


def test_account_missing_required_flag(capsys):
    code, _, err = run(["account", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-5"], capsys)
    assert code != 0 and "--noise-multiplier" in err


# ----------------------------------------------------------------------------- train

@pytest.mark.parametrize("flag,value", [
    ("--epsilon", "0"), ("--epsilon", "-1"), ("--epsilon", "nan"), ("--epsilon", "inf"),
    ("--epsilon", None), ("--delta", "0"), ("--delta", "1"), ("--delta", "x"),
    ("--epochs", "0"), ("--epochs", "1.5"), ("--batch-size", "0"), ("--batch-size", "-4"),
    ("--batch-size", "100000"), ("--lr", "0"), ("--lr", "-0.1"), ("--clip", "0"), ("--clip", "-1"),
    ("--ef-clip", "0"), ("--grad-bound", "-1"), ("--momentum", "1"), ("--momentum", "-0.5"),
    ("--weight-decay", "-1"), ("--gamma", "0"), ("--noise-multiplier", "0"),
    ("--max-physical-batch", "0"), ("--validation", "-1"), ("--validation", "100000"),
    ("--subset", "0"), ("--subset", "100000"), ("--seed", "-1"), ("--accountant", "moments"),
    ("--dice-accounting", "magic"), ("--algo", "nope"), ("--model", "nope"), ("--data", "cifar"),
    ("--optimizer", "lbfgs"), ("--device", "tpu"), ("--threads", "-1"),
    ("--p", "3"), ("--augmentations", "2"), ("--perturb-k", "0.1"),  # not for --algo dpsgd
])
def test_train_bad_flags(capsys, tmp_path, flag, value):
    code, out, err = run(_replace(TRAIN, flag, value) + ["--out", tmp_path / "r"], capsys)
    assert code != 0
    assert flag in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("algo,flag,value", [
    ("perturb", "--perturb-k", "-1"), ("p-avg", "--p", "1"), ("self-aug", "--augmentations", "0"),
    ("inner-outer", "--gamma0", "2"), ("inner-outer", "--gamma1", "0"), ("inner-outer", "--k0", "-1"),
    ("batch-clip", "--public-size", "0"), ("batch-clip", "--public-size", None),
])
def test_train_bad_method_flags(capsys, tmp_path, algo, flag, value):
    argv = _replace(TRAIN, "--algo", algo) + ([flag, value] if value is not None else [])
    code, _, err = run(argv + ["--out", tmp_path / "m"], capsys)
    assert code != 0 and flag in err, err
    assert "Traceback" not in err


def test_train_runs_and_reports(capsys, tmp_path):
    out = tmp_path / "run"
    code, stdout, err = run(TRAIN + ["--out", out, "--validation", "200"], capsys)
    assert code == 0, err
    for word in ("dataset", "N ", "q ", "B ", "steps", "noise multiplier", "target epsilon", "delta",
                 "accountant", "basis", "certified", "test accuracy", "val accuracy"):
        assert word in stdout, word
    res = json.loads((out / "results.json").read_text())
    assert res["epsilon"] <= 3 and res["certified"] is True and res["val_accuracy"] is not None
    assert (out / "curves.png").is_file() and (out / "checkpoint.pt").is_file()
    # an existing run is not overwritten silently
    code, _, err = run(TRAIN + ["--out", out], capsys)
    assert code != 0 and "--resume" in err and "--overwrite" in err
    # --resume of a finished run changes nothing; a changed privacy setting is refused
    code, _, err = run(_replace(TRAIN, "--epsilon", "2") + ["--out", out, "--resume"], capsys)
    assert code != 0 and "--epsilon" in err
    code, _, err = run(_replace(TRAIN, "--data", "wine") + ["--out", out, "--resume"], capsys)
    assert code != 0 and "--data" in err
    code, _, err = run(TRAIN + ["--out", out, "--resume"], capsys)  # --validation 200 forgotten
    assert code != 0 and "--validation" in err
    code, stdout, _ = run(TRAIN + ["--out", out, "--validation", "200", "--resume", "--json"], capsys)
    assert code == 0 and json.loads(stdout)["epsilon"] == pytest.approx(res["epsilon"])


def test_train_json_non_private_epsilon_is_inf(capsys, tmp_path):
    argv = _replace(_replace(TRAIN, "--algo", "sgd"), "--epsilon", None)
    code, stdout, err = run(argv + ["--out", tmp_path / "s", "--json"], capsys)
    assert code == 0, err
    d = json.loads(stdout)
    assert d["epsilon"] == "inf" and d["certified"] is False
    assert "non-private" in err  # the header (on stderr with --json)


def test_train_dice_authors_header_says_refuted(capsys, tmp_path):
    argv = _replace(_replace(TRAIN, "--algo", "dice"), "--dice-accounting", "authors")
    code, stdout, err = run(argv + ["--out", tmp_path / "d"], capsys)
    assert code == 0, err
    assert "false  (NOT a guarantee: a DiceSGD bound refuted by a canary attack" in stdout
    assert "REFUTED" in stdout  # in the basis line too


def test_train_delta_warning(capsys, tmp_path):
    code, stdout, err = run(_replace(TRAIN, "--delta", "0.001") + ["--out", tmp_path / "w"], capsys)
    assert code == 0 and "1/N" in err


def test_train_missing_fashion_mnist_names_the_package(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("CLIPBIAS_FASHION_MNIST_DIR", str(tmp_path / "nothing"))
    code, _, err = run(_replace(TRAIN, "--data", "fashion-mnist") + ["--out", tmp_path / "f"], capsys)
    assert code != 0 and "dataset-fashion-mnist" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")
def test_train_cuda_unavailable(capsys, tmp_path):
    code, _, err = run(TRAIN + ["--device", "cuda", "--out", tmp_path / "c"], capsys)
    assert code != 0 and "--device cuda" in err and "CUDA" in err


def test_model_that_does_not_fit_the_data(capsys, tmp_path):
    code, _, err = run(_replace(TRAIN, "--model", "cnn") + ["--out", tmp_path / "m"], capsys)
    assert code != 0 and "--model" in err


# ----------------------------------------------------------------------------- export

def test_export_writes_weights_only(capsys, tmp_path):
    # a given noise multiplier: export is tested, not DiceSGD's calibration (test_compare_table_and_files)
    argv = _replace(_replace(TRAIN, "--algo", "dice"), "--epsilon", None) + [
        "--noise-multiplier", "2", "--ef-clip", str(1 / 64), "--out", tmp_path / "r"]
    assert run(argv, capsys)[0] == 0
    code, out, err = run(["export", tmp_path / "r", tmp_path / "w.pt", "--json"], capsys)
    assert code == 0, err
    blob = torch.load(tmp_path / "w.pt", weights_only=True)
    assert set(blob) == {"state_dict", "meta"}
    assert set(blob["state_dict"]) == {"fc.weight", "fc.bias"}
    assert "engine" not in blob and "e" not in blob["meta"] and blob["meta"]["certified"] is True
    code, _, err = run(["export", tmp_path / "r", tmp_path / "w.pt"], capsys)
    assert code != 0 and "--overwrite" in err
    code, _, err = run(["export", tmp_path / "nowhere", tmp_path / "x.pt"], capsys)
    assert code != 0 and "checkpoint" in err
    # a checkpoint from before the refutation (dice_accounting "certified", certified: true) exports as
    # refuted, never as certified
    ck = torch.load(tmp_path / "r" / "checkpoint.pt", weights_only=False)
    ck["config"]["dice_accounting"] = "certified"
    ck["format"] = 1  # the format of the checkpoints written then
    ck["history"][-1].update(certified=True, basis="DiceSGD Thm 3.8 (Zhang et al.) ...")
    torch.save(ck, tmp_path / "r" / "checkpoint.pt")
    code, _, err = run(["export", tmp_path / "r", tmp_path / "old.pt"], capsys)
    meta = torch.load(tmp_path / "old.pt", weights_only=True)["meta"]
    assert code == 0 and meta["certified"] is False and "REFUTED" in meta["basis"]


# ----------------------------------------------------------------------------- compare

def test_compare_table_and_files(capsys, tmp_path):
    out = tmp_path / "cmp"
    code, stdout, err = run(["compare", "--data", "digits", "--model", "logreg", "--algos", "dpsgd", "dice",
                             "dice:authors", "--seeds", "0", "1", "--epochs", "1", "--batch-size", "64",
                             "--lr", "0.5", "--clip", "1", "--momentum", "0", "--accountant", "rdp",
                             "--out", out, "--quiet"], capsys)
    assert code == 0, err
    assert "mean ± std, 2 seeds" in stdout and "basis" in stdout
    rows = {line.split()[0]: line for line in stdout.splitlines() if line.startswith(("dpsgd ", "dice"))}
    assert "true" in rows["dice"] and "false (REFUTED bound)" in rows["dice:authors"]
    d = json.loads((out / "compare.json").read_text())
    by = {r["label"]: r for r in d["rows"]}
    assert set(by) == {"dpsgd", "dice", "dice:authors"}
    assert by["dice"]["certified"] and not by["dice:authors"]["certified"]
    assert by["dice"]["ef_clip"] == pytest.approx(0.01 / 64)  # r = 0.01 by default
    assert by["dice"]["dice_accounting"] == "sound" and "REFUTED" in by["dice:authors"]["basis"]
    # sound accounting (PLD) costs noise over DPSGD's under the same accountant: feedback is never amplified.
    # DPSGD with 1% less noise than DiceSGD's would still spend less than 3: DiceSGD's z exceeds DPSGD's
    # calibrated z (within 1% of the exact root), checked with one PLD evaluation instead of a bisection
    from clipbias.privacy import gaussian
    assert gaussian.epsilon(0.99 * by["dice"]["noise_multiplier"], 64 / 1347, 21, 1e-5, "pld") < 3.0
    assert len(by["dpsgd"]["test_accuracies"]) == 2
    assert (out / "curves.png").is_file()
    # the closing advice: the certified row with the best mean (never the refuted dice:authors) if it
    # leads by more than the seeds' spread, with a train line that runs its settings; else a tie
    best, other = sorted(("dpsgd", "dice"), key=lambda k: -by[k]["test_accuracy_mean"])
    line = next(x for x in stdout.splitlines() if x.startswith("best sound configuration:"))
    if by[best]["test_accuracy_mean"] - by[other]["test_accuracy_mean"] <= max(by[best]["test_accuracy_std"],
                                                                               by[other]["test_accuracy_std"]):
        assert d["best_sound"] is None and d["tied_at_top"] == [best, other]
        assert line.startswith("best sound configuration: a tie (2 seeds: ")
        return
    assert d["best_sound"]["label"] == best and d["tied_at_top"] == []
    assert line.startswith(f"best sound configuration: {best} ({100 * by[best]['test_accuracy_mean']:.2f} % mean of 2 seeds")
    cmd = d["best_sound"]["command"].split()
    assert cmd[:2] == ["clipbias", "train"] and cmd[cmd.index("--algo") + 1] == best
    assert float(cmd[cmd.index("--lr") + 1]) == 0.5 and ("--ef-clip" in cmd) == (best == "dice")
    assert f"run it: {d['best_sound']['command']}" in stdout


def test_compare_bad_flags(capsys, tmp_path):
    base = ["compare", "--data", "digits", "--model", "logreg", "--epochs", "1", "--batch-size", "64",
            "--out", tmp_path / "c", "--quiet"]
    for extra, flag in [(["--algos", "nope"], "--algos"), (["--algos", "dpsgd:authors"], "--algos"),
                        (["--epsilon", "-1"], "--epsilon"), (["--seeds"], "--seeds"),
                        (["--ef-ratio", "0"], "--ef-ratio")]:
        code, _, err = run(base + extra, capsys)
        assert code != 0 and flag in err, (extra, err)


def test_help_lists_commands(capsys):
    code, out, _ = run(["--help"], capsys)
    for cmd in ("train", "compare", "account", "calibrate", "export"):
        assert cmd in out


def test_finished_runs_are_never_overwritten_silently(capsys, tmp_path):
    """A results.json without checkpoint (train) and an earlier compare are refused without
    --overwrite, and the files stay byte-identical (issue 17)."""
    d = tmp_path / "done"
    d.mkdir()
    (d / "results.json").write_text('{"kept": true}')
    code, _, err = run(TRAIN + ["--out", d], capsys)
    assert code == 2 and "--overwrite" in err and (d / "results.json").read_text() == '{"kept": true}'
    c = tmp_path / "cmp"
    c.mkdir()
    (c / "compare.json").write_text("old")
    code, _, err = run(["compare", "--data", "digits", "--model", "logreg", "--algos", "dpsgd", "--seeds", "0",
                        "--epochs", "1", "--batch-size", "64", "--lr", "0.5", "--clip", "1", "--accountant", "rdp",
                        "--out", c, "--quiet"], capsys)
    assert code == 2 and "compare.json" in err and "--overwrite" in err and (c / "compare.json").read_text() == "old"


def test_bad_out_is_refused_before_training_and_refusals_leave_no_directory(capsys, tmp_path):
    """--out that is a file or lies under one is refused at once (not after an epoch); a run refused
    for another reason leaves no empty --out behind (issue 17)."""
    f = tmp_path / "file"
    f.write_text("x")
    for out, what in ((f, "is a file"), (f / "sub", "lies under the file")):
        code, _, err = run(TRAIN + ["--out", out], capsys)
        assert code == 2 and what in err and f.read_text() == "x"
    code, _, err = run(_replace(TRAIN, "--algo", "batch-clip") + ["--out", tmp_path / "never"], capsys)
    assert code == 2 and "--public-size" in err and not (tmp_path / "never").exists()


def test_interrupt_before_the_first_checkpoint_says_there_is_none(capsys, tmp_path, monkeypatch):
    import clipbias.run.training as training  # the command imports train from there when it runs

    def stop(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(training, "train", stop)
    code, _, err = run(TRAIN + ["--out", tmp_path / "r"], capsys)
    assert code == 130 and "no checkpoint was written" in err and "--resume." not in err


def test_sigterm_stops_a_run_cleanly_with_exit_143(tmp_path):
    """SIGTERM used to end a run silently (issue 17): now the same clean stop as Ctrl-C, exit 143."""
    import signal
    import subprocess
    import sys
    import time
    out = tmp_path / "r"
    args = [str(a) for a in _replace(_replace(TRAIN, "--epochs", "400"), "--epsilon", None)
            + ["--noise-multiplier", "1", "--out", out]]  # no calibration before the first epoch
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from clipbias.cli import main; "
                             "sys.exit(main(sys.argv[1:]))", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (out / "checkpoint.pt").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "terminated (SIGTERM)" in err and "--resume" in err
    assert "Traceback" not in err


def test_export_into_a_file_path_is_a_clear_error(capsys, tmp_path):
    """An export that cannot be written (here: its directory is a file) exits 2 with a message, no
    traceback, and leaves nothing behind (issue 17)."""
    assert run(TRAIN + ["--out", tmp_path / "r"], capsys)[0] == 0
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    code, _, err = run(["export", tmp_path / "r", blocker / "w.pt"], capsys)
    assert code == 2 and "cannot write" in err and "Traceback" not in err and blocker.read_text() == "x"


def test_diagnose_builds_the_run_train_builds(tmp_path, capsys):
    """Issue 13's drift: ``diagnose --algo batch-clip`` exited 2 ("needs a BatchNorm network") where
    ``train`` with the same flags works. Both now build through ``run.build_run``; the recorder reads
    the BatchClipping row source (gradients through the BatchNorm group). The data: 200 training and 60 test
    images of Fashion-MNIST's shape in an .npz file (train's majority vote over the real 10,000 test images,
    each run with public features, was 10 s of the test's CPU)."""
    import numpy as np
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "images.npz", x_train=rng.random((200, 1, 28, 28), dtype=np.float32),
             y_train=rng.integers(0, 10, 200), x_test=rng.random((60, 1, 28, 28), dtype=np.float32),
             y_test=rng.integers(0, 10, 60), num_classes=np.array(10))
    flags = ["--data", "npz", "--data-path", tmp_path / "images.npz", "--model", "cnn-gn", "--algo", "batch-clip",
             "--public-size", "20", "--subset", "200", "--epochs", "1", "--batch-size", "100", "--lr", "0.5",
             "--noise-multiplier", "1.0", "--vote-draws", "1", "--p", "2"]
    code, _, err = run(["diagnose", *flags, "--record-size", "8", "--reference-size", "50", "--track-size", "4",
                        "--track-reference-size", "20", "--no-figures", "--quiet", "--steps-at", "0,end",
                        "--out", tmp_path / "d"], capsys)
    assert code == 0, err
    res = json.loads((tmp_path / "d" / "diagnostics.json").read_text())
    assert [r["step"] for r in res["records"]] == [0, 2] and res["config"]["algo"] == "batch-clip"
    assert res["records"][0]["norms"]["n"] == 8 and res["records"][-1]["norms"]["mean_norm"] > 0
    code, _, err = run(["train", *flags, "--quiet", "--out", tmp_path / "t"], capsys)
    assert code == 0, err


def test_train_grad_path_fast_end_to_end(tmp_path, capsys):
    """``--grad-path fast`` through the CLI: the header says which path runs, the run trains and is
    accounted and certified like the rows path; where it does not apply it is refused with the reason."""
    base = ["train", "--data", "digits", "--model", "mlp", "--epochs", "1", "--batch-size", "64", "--lr", "0.5",
            "--epsilon", "3", "--accountant", "rdp", "--quiet"]
    code, out, err = run(base + ["--algo", "dpsgd", "--grad-path", "fast", "--out", tmp_path / "f"], capsys)
    assert code == 0, err
    assert "fast (per-layer norms" in out
    res = json.loads((tmp_path / "f" / "results.json").read_text())
    assert res["config"]["grad_path"] == "fast" and 0 < res["epsilon"] <= 3
    assert res["certified"] is True and res["caveats"] == []  # it clips what it sums, as the rows path does
    assert res["test_accuracy"] > 0.3  # ten classes (chance 0.1); one epoch under a fresh secret key: 0.48 seen
    code, _, err = run(base + ["--algo", "p-avg", "--grad-path", "fast", "--out", tmp_path / "p"], capsys)
    assert code == 2 and "computes its own rows" in err


def test_every_flag_of_every_command_has_help():
    """--help documents every flag (issue 16: --epochs, --lr and --momentum had none)."""
    import argparse

    from clipbias.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"{name} {'/'.join(a.option_strings)}" for name, p in sub.choices.items() for a in p._actions
               if a.option_strings and not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert not missing, missing


def test_cache_command_shows_and_clears_only_its_own_files(tmp_path, monkeypatch, capsys):
    """`clipbias cache` reports both caches' files and size; --clear deletes exactly those files."""
    data, cal = tmp_path / "data", tmp_path / "cal"
    (data / "scatter").mkdir(parents=True)
    cal.mkdir()
    monkeypatch.setenv("CLIPBIAS_CACHE_DIR", str(data))
    monkeypatch.setenv("CLIPBIAS_CACHE", str(cal))
    mine = [data / "fashion-mnist-abc.pt", data / "scatter" / "train-J2.pt", cal / "calibrations.json",
            cal / "band_strategies.json", cal / "blt_strategies.json", cal / "choices.json"]
    for f in mine:
        f.write_bytes(b"x" * 1000)
    other = data / "notes.txt"
    other.write_text("keep me")
    assert main(["cache", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["files"] == 6 and got["bytes"] == sum(f.stat().st_size for f in mine)  # (choices.json: rewritten
    # by the parsers when they read the cache: this process had not loaded the algorithms)
    assert main(["cache", "--clear", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cleared"] == 6
    assert not any(f.exists() for f in mine) and other.read_text() == "keep me"


def test_default_output_directories_are_new_for_every_run(capsys, tmp_path, monkeypatch):
    """Without --out every train, compare, diagnose and toy run gets a directory of its own under
    runs/ (printed at its start and its end), so the README's commands can follow one another; no
    lock file stays behind; a refused run leaves no directory; --resume needs --out."""
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    dirs = []
    for _ in range(2):
        code, stdout, err = run(TRAIN, capsys)
        assert code == 0, err
        new = sorted(set(runs.iterdir()) - set(dirs))
        assert len(new) == 1 and new[0].name.startswith("digits-logreg-dpsgd-eps3-s0-")
        dirs += new
        rel = f"runs/{new[0].name}"
        assert stdout.splitlines()[0] == f"run directory: {rel}" and f"{rel}/results.json" in stdout.splitlines()[-2]
        assert sorted(p.name for p in new[0].iterdir()) == ["checkpoint.pt", "curves.png", "results.json"]
    code, _, err = run(_replace(TRAIN, "--algo", "batch-clip"), capsys)  # refused: --public-size missing
    assert code == 2 and "--public-size" in err and sorted(runs.iterdir()) == dirs
    code, _, err = run(TRAIN + ["--resume"], capsys)
    assert code == 2 and "--resume needs --out DIR" in err and sorted(runs.iterdir()) == dirs
    compare = ["compare", "--data", "digits", "--model", "logreg", "--algos", "dpsgd", "--seeds", "0", "--epochs",
               "1", "--batch-size", "64", "--lr", "0.5", "--clip", "1", "--accountant", "rdp", "--quiet"]
    code, stdout, err = run(compare, capsys)  # right after the trains: a directory of its own
    assert code == 0, err
    new = sorted(set(runs.iterdir()) - set(dirs))
    assert len(new) == 1 and new[0].name.startswith("compare-digits-logreg-eps3-")
    dirs += new
    assert f"-> runs/{new[0].name}" in stdout.splitlines()[0] and f"wrote runs/{new[0].name}/compare.json" in stdout
    assert "test acc (1 seed)" in stdout and "±" not in stdout  # one seed has no spread to show
    assert (new[0] / "compare.json").is_file() and not list(new[0].rglob(".clipbias.lock"))
    code, stdout, err = run(["toy", "--problem", "chen-ex2", "--algo", "sgd", "--steps", "20", "--compare", "sgd"],
                            capsys)
    assert code == 0, err
    new = sorted(set(runs.iterdir()) - set(dirs))
    assert len(new) == 1 and new[0].name.startswith("toy-chen-ex2-") and (new[0] / "toy-chen-ex2.png").is_file()
    assert f"runs/{new[0].name}/toy-chen-ex2.png" in stdout


def test_new_run_dir_never_reuses_a_directory(tmp_path, monkeypatch):
    """Runs started in the same second get -2, -3, ...; a file in the way is a clear error."""
    import time

    from clipbias.errors import WriteError
    from clipbias.files import new_run_dir, remove_if_empty
    monkeypatch.setattr(time, "strftime", lambda fmt: "20260101-120000")
    made = [new_run_dir("train", tmp_path / "runs") for _ in range(3)]
    assert [p.name for p in made] == ["train-20260101-120000", "train-20260101-120000-2", "train-20260101-120000-3"]
    assert all(p.is_dir() for p in made)
    (made[0] / "kept").write_text("x")
    remove_if_empty(made[0])
    remove_if_empty(made[1])
    assert made[0].is_dir() and not made[1].exists()
    (tmp_path / "blocker").write_text("x")
    with pytest.raises(WriteError, match="cannot create a run directory under .*blocker.*`out` DIR"):
        new_run_dir("train", tmp_path / "blocker")


@pytest.mark.parametrize("over", [
    {"algo": "dpsgd", "momentum": 0.9, "ema": 0.9},
    {"algo": "dice", "ef_clip": 0.001, "dice_accounting": "sound", "accountant": "rdp"},
    {"algo": "inner-outer", "extra": {"K0": 3, "gamma1": 0.8, "normalize": True}},
    {"algo": "dpsgd+disk", "extra": {"kappa": 0.6, "disk_gamma": 0.4}, "weight_decay": 0.01, "subset": 500},
    {"algo": "dpsgd", "momentum": 0.9, "bands": 4},
])
def test_compare_best_line_runs_exactly_the_row_config(over):
    """The train line compare prints for its best row parses back into the same TrainConfig (method
    settings through their own flags, switches, DiSK through --kalman)."""
    import dataclasses

    from clipbias.cli import build_parser
    from clipbias.cli.compare import train_command
    from clipbias.cli.train import config_from_args
    from clipbias.run import TrainConfig
    cfg = TrainConfig(data="digits", model="mlp", epsilon=3.0, epochs=2, batch_size=64.0, lr=0.7, clip=0.3,
                      **over)
    cmd = train_command(cfg.to_dict())
    args = build_parser().parse_args(cmd.split()[1:])
    back = config_from_args(args)
    ignore = {"out", "seed", "resume", "overwrite", "max_physical_batch", "eval_batch_size", "grad_path"}
    a = {k: v for k, v in dataclasses.asdict(back).items() if k not in ignore}
    b = {k: v for k, v in cfg.to_dict().items() if k not in ignore}
    assert a == b, cmd


def test_compare_gives_each_algorithm_the_method_flags_it_reads():
    """--kappa goes to disk and not to dpsgd beside it; a flag no listed algorithm reads is refused."""
    from clipbias.cli import build_parser
    from clipbias.cli.compare import _variants
    from clipbias.errors import ConfigError
    parse = build_parser().parse_args
    args = parse(["compare", "--algos", "dpsgd", "disk", "inner-outer", "--kappa", "0.5", "--k0", "3"])
    variants, _ = _variants(args, args.algos)
    assert [over["extra"] for _, over in variants] == [{}, {"kappa": 0.5}, {"K0": 3}]
    args = parse(["compare", "--algos", "dpsgd", "dice", "--kappa", "0.5"])
    with pytest.raises(ConfigError, match="--kappa applies to none of --algos dpsgd dice"):
        _variants(args, args.algos)
