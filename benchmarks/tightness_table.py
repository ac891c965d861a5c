"""Print the "Tightness" table of docs/privacy.md from the JSON files of ``benchmarks/results/tightness/``
(written by ``benchmarks/tightness.sh``; each file is one command).

    python benchmarks/tightness_table.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DIR = Path(__file__).resolve().parent / "results" / "tightness"


def _row(name: str, d: dict) -> str:
    st = d["settings"]
    basis = st.get("dice_accounting") if st["algo"].startswith("dice") else None
    algo = st["algo"] + (f" ({basis})" if basis else "")
    cfg = f"q = {st['sample_rate']:g}, T = {st['steps']}, z = {st['noise_multiplier']:g}"
    eps = d["epsilon_claimed"]
    if d["method"] == "canary":
        adversary = f"{st['statistic']} statistic" + (f", anti-canary {st['anti_norm']:g}" if st.get("anti_norm") else "")
        size, model_based, label = f"{d['trials']} runs per world", d["epsilon_lower_bound_gdp"], "GDP"
        method = "many-run canary"
    else:
        adversary = f"{st['statistic']} statistic"
        size, model_based, label = f"{d['canaries']} canaries", d["epsilon_lower_bound_fdp"], "f-DP"
        method = "one-run, white-box engine"
    lb = d["epsilon_lower_bound"]
    return (f"| {name} | {algo} | {method} ({adversary}) | {cfg}, {size} | {eps:.3g} | {lb:.3g} ({lb / eps:.0%}) | "
            f"{label}: {model_based:.3g} ({model_based / eps:.0%}) | {'**refuted**' if d['refuted'] else 'holds'} |")


def main() -> int:
    print("| file | algo | audit | configuration | epsilon claimed | lower bound (/ claim) | "
          "Gaussian-curve reading (/ claim) | verdict |")
    print("|---|---|---|---|---|---|---|---|")
    for f in sorted(DIR.glob("*.json")):
        text = f.read_text().strip()
        if text:
            print(_row(f.stem, json.loads(text)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
