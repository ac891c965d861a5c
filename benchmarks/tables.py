"""Print the markdown tables of docs/results.md from the stored benchmark runs (no training).

    python benchmarks/tables.py                       # benchmarks/results/fmnist_main_table (main table)
    python benchmarks/tables.py --out benchmarks/results/fmnist_40_epochs

Reads every ``OUT/runs/<model>-eps<E>/<variant>-s<seed>/results.json`` written by
``benchmarks/fmnist.py`` and summarises them per (model, epsilon, variant) with the same code as
``clipbias compare`` (mean ± std over the seeds found, epsilon, certified, noise multiplier,
seconds per epoch), so a partly finished benchmark prints what it has.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fmnist import label_order, markdown  # noqa: E402

from clipbias.run.training import summarize  # noqa: E402


def cells(out: Path) -> list[dict]:
    found: dict[tuple[str, float], dict[str, list[dict]]] = {}
    for f in sorted(out.glob("runs/*/*/results.json")):
        m = re.fullmatch(r"(.+)-eps([0-9.]+)", f.parent.parent.name)
        v = re.fullmatch(r"(.+)-s(\d+)", f.parent.name)
        if not (m and v):
            continue
        res = json.loads(f.read_text())
        if res["steps"] != res["planned_steps"]:
            continue  # unfinished run
        res["epsilon"] = math.inf if res["epsilon"] == "inf" else res["epsilon"]
        found.setdefault((m[1], float(m[2])), {}).setdefault(v[1], []).append(res)
    out_cells = []
    for (model, eps), runs in sorted(found.items(), key=lambda kv: (kv[0][0] != "scatter-linear", kv[0])):
        runs = {k: runs[k] for k in sorted(runs, key=label_order)}
        rows = summarize(runs)
        for r, name in zip(rows, runs):
            r["variant"] = name
        out_cells.append({"model": model, "target_epsilon": eps, "rows": rows,
                          "epochs": next(iter(runs.values()))[0]["config"]["epochs"]})
    return out_cells


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/fmnist_main_table")
    a = p.parse_args(argv)
    cs = cells(Path(a.out))
    if not cs:
        print(f"no finished runs under {a.out}/runs", file=sys.stderr)
        return 1
    print(markdown(cs))
    print()
    print("epochs per model: " + ", ".join(sorted({f"{c['model']} {c['epochs']}" for c in cs})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
