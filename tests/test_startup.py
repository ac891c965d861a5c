"""The command line starts at once: building the parsers (``--help`` of the program and of every
command) imports neither torch nor the accountants, and the choices the parsers offer without them
(``clipbias/cli/_snapshot.py``) are the live registry's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "dp_accounting", "scipy", "numpy", "matplotlib", "sklearn", "clipbias.algorithms",
         "clipbias.privacy", "clipbias.run", "clipbias.models", "clipbias.data")

_PROBE = """
import contextlib, io, json, sys
from clipbias.cli import build_parser, main
commands = sorted(build_parser()._subparsers._group_actions[0].choices)
helps = {}
for argv in [["--help"]] + [[c, "--help"] for c in commands]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as e:
            assert e.code == 0, (argv, e.code)
    helps[" ".join(argv)] = len(out.getvalue())
print(json.dumps({"commands": commands, "helps": helps, "modules": sorted(sys.modules)}))
"""


def test_help_of_every_command_imports_no_torch():
    got = json.loads(subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True,
                                    check=True, env={"PYTHONPATH": str(ROOT), "PATH": ""}).stdout)
    assert {"train", "compare", "account", "calibrate", "audit", "toy", "diagnose", "export", "cache",
            "tune"} <= set(got["commands"])
    assert all(n > 200 for n in got["helps"].values()), got["helps"]  # each printed its help
    loaded = [m for m in got["modules"] if any(m == h or m.startswith(h + ".") for h in HEAVY)]
    assert loaded == [], f"--help imported {loaded[:10]}"


def test_the_parsers_snapshot_is_the_live_registry():
    from clipbias.cli import _choices
    from clipbias.cli._snapshot import SNAPSHOT
    assert SNAPSHOT == _choices.live(), ("clipbias/cli/_snapshot.py is out of date: regenerate it with "
                                         "`python -m clipbias.cli._choices > clipbias/cli/_snapshot.py`")
    assert (ROOT / "clipbias/cli/_snapshot.py").read_text() == _choices.source()


_CALIBRATE = """
import contextlib, io, json, sys
from clipbias.cli import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    assert main(["calibrate", "--algo", "dpsgd", "--epsilon", "3", "--delta", "1e-5", "--sample-rate", "0.01",
                 "--steps", "100", "--json"]) == 0
print(json.dumps({"result": json.loads(out.getvalue()), "modules": sorted(sys.modules)}))
"""


def test_a_dpsgd_calibration_imports_no_torch(tmp_path):
    """`clipbias calibrate --algo dpsgd` (no bands) needs the accountants only: torch's import was half of a
    calibration's 3 s on a fresh cache. Its answer is the library's (the same call in this process)."""
    got = json.loads(subprocess.run([sys.executable, "-c", _CALIBRATE], cwd=ROOT, capture_output=True, text=True,
                                    check=True, env={"PYTHONPATH": str(ROOT), "PATH": "",
                                                     "CLIPBIAS_CACHE": str(tmp_path)}).stdout)
    assert not [m for m in got["modules"] if m == "torch" or m.startswith("torch.")]
    from clipbias.privacy import AccountingSpec, calibrate
    assert got["result"]["noise_multiplier"] == calibrate(AccountingSpec("gaussian", 0.01), 3.0, 1e-5, 100)
