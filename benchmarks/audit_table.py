"""Print the "Audits" table of docs/privacy.md from the JSON files of ``benchmarks/results/audits/``
(written by ``benchmarks/audits.sh``, ``benchmarks/audits_one_run.sh``, ``audits_bands.sh`` and ``audits_blt.py``;
each file is one command, or one row of ``audits_blt.py``).

    python benchmarks/audit_table.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DIR = Path(__file__).resolve().parent / "results" / "audits"


def main() -> int:
    print("| file (command in benchmarks/audits*.sh) | algo | method | configuration | epsilon claimed | certified "
          "| audit: epsilon >= | verdict |")
    print("|---|---|---|---|---|---|---|---|")
    for f in sorted(DIR.glob("*.json")):
        text = f.read_text().strip()
        if not text:
            continue
        d = json.loads(text)
        st = d["settings"]
        if d["method"] == "canary":
            blt = "" if st.get("bands_strategy") != "blt" else (
                f"BLT noise in k = {st['bands']} classes (no amplification; mechanism level, audits_blt.py), "
                f"class {st['band_class']}, ")
            cfg = (f"{blt}q = {st['sample_rate']:.4g}, T = {st['steps']}, B = {st['batch_size']:g}, z = "
                   f"{st['noise_multiplier']:.4g}" + (f" (claim at z = {st['claim_noise_multiplier']:g})"
                                                      if st.get("claim_noise_multiplier") else "")
                   + f", {d['trials']} runs per world")
        else:
            where = f"{st['data']}/{st['model']}, " if "data" in st else ""  # white-box engine runs: no data
            acc = f", test acc {100 * d['test_accuracy']:.1f} %" if "test_accuracy" in d else ""
            cfg = (f"{where}q = {d.get('sample_rate') or st.get('sample_rate'):.3g}, T = {st['steps']}, z = "
                   f"{st['noise_multiplier']:.4g}" + (f" (claim at z = {st['claim_noise_multiplier']:g})"
                                                      if st.get("claim_noise_multiplier") else "")
                   + f", {d['canaries']} canaries{acc}")
        claimed = d["epsilon_claimed"]
        claimed = claimed if isinstance(claimed, str) else f"{claimed:.4g}"
        verdict = "**refuted**" if d["refuted"] else "holds"
        basis = st.get("dice_accounting") if st["algo"].startswith("dice") else None
        algo = st["algo"] + (f" ({basis})" if basis else "")
        method = "canary" if d["method"] == "canary" else ("one-run, " + d["method"].split("(")[1].split(" ")[0])
        lb = f"{d['epsilon_lower_bound']:.3g}"
        if "epsilon_lower_bound_fdp" in d:
            lb += f" (f-DP {d['epsilon_lower_bound_fdp']:.3g})"
        print(f"| {f.stem} | {algo} | {method} | {cfg} | {claimed} | {str(d['certified']).lower()} | "
              f"{lb} | {verdict} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
