"""How long the command line takes to answer `--help`, per command, and what importing torch costs.

    python benchmarks/startup.py          # min and median over 7 runs of each, fresh processes

Each row is `python -m clipbias [COMMAND] --help` in a new process (wall time, from spawn to exit);
`import torch` and `import clipbias.privacy` (the accountants) are the references for what building the
parsers no longer imports.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ["", "train", "compare", "account", "calibrate", "audit", "toy", "diagnose", "export", "cache", "tune"]
REPEATS = 7


def wall(argv: list[str]) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    times = []
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, *argv], env=env, stdout=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - t0)
    return times


def main() -> int:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    print(f"# {cpu}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}; min / median of {REPEATS}")
    print("| command | min s | median s |")
    print("|---|---|---|")
    rows = [(f"clipbias {c} --help".replace("  ", " "), ["-m", "clipbias", *([c] if c else []), "--help"])
            for c in COMMANDS]
    rows += [("python -c 'import torch'", ["-c", "import torch"]),
             ("python -c 'import clipbias.privacy'", ["-c", "import clipbias.privacy"])]
    for label, argv in rows:
        t = wall(argv)
        print(f"| `{label}` | {min(t):.3f} | {statistics.median(t):.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
