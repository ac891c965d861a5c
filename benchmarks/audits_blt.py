"""The mechanism-level audits of BLT noise (docs/privacy.md, "BLT noise"; ``clipbias.audit.blt``): each row
is one ``BLTAudit`` (two worlds of runs through ``step.BLTNoise``, the matched statistic on the
releases y = C g), its JSON in ``benchmarks/results/audits/blt-*.json`` (read by ``audit_table.py``), and
a line of the printed table: claim (the engine's epsilon), lower bound (Clopper-Pearson) and GDP reading.

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/audits_blt.py              # every row
    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python benchmarks/audits_blt.py --only k29   # rows whose name holds k29

Rows: k = 4 classes, T = 40, z in {1, 2}; k = 29, T = 87, z = 1.4 (the Fashion-MNIST protocol: 60,000
examples, B = 2048, 3 epochs); the canary in class 0 (whose steps reach furthest: it attains Delta(T) = 1)
and in the last class; momentum 0.9 (the protocol's SGD; the strategy is shaped for it) and one row at
momentum 0; one row with the worst sign pattern (``signs="worst"``); 100,000 runs per world, and one row at
1,000,000 for the GDP reading's resolution; one row running 2T steps on the strategy planned for T (at
1,000,000 runs: its lower bound refutes the claim at T, not the engine's claim at 2T). Every row's keys are
fresh OS keys (``--seed`` for reproducible ones). One core: about 1 s per 100,000 runs of T = 40.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from clipbias.audit.blt import BLTAudit, blt_audit

OUT = Path(__file__).resolve().parent / "results" / "audits"

ROWS = {
    "blt-k4-T40-z1.0-class0": BLTAudit(4, 40, 1.0, 0, momentum=0.9),
    "blt-k4-T40-z1.0-class3": BLTAudit(4, 40, 1.0, 3, momentum=0.9),
    "blt-k4-T40-z1.0-class3-worst": BLTAudit(4, 40, 1.0, 3, momentum=0.9, signs="worst"),
    "blt-k4-T40-z2.0-class0": BLTAudit(4, 40, 2.0, 0, momentum=0.9),
    "blt-k4-T40-z2.0-class3": BLTAudit(4, 40, 2.0, 3, momentum=0.9),
    "blt-k4-T40-z1.0-class0-momentum0": BLTAudit(4, 40, 1.0, 0, momentum=0.0),
    "blt-k29-T87-z1.4-class0": BLTAudit(29, 87, 1.4, 0, momentum=0.9),
    "blt-k29-T87-z1.4-class28": BLTAudit(29, 87, 1.4, 28, momentum=0.9),
    "blt-k4-T40-z1.0-class0-1M": BLTAudit(4, 40, 1.0, 0, runs=1_000_000, momentum=0.9),
    # a run of 2T steps on the strategy planned for T: the claim is the engine's at 2T (Delta(2T) = 1.44),
    # the claim at the planned T (Delta = 1) is what an accounting that ignored the extension would state
    "blt-k4-T40-z1.0-class0-run80": BLTAudit(4, 40, 1.0, 0, runs=1_000_000, momentum=0.9, run_steps=80),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="run only this row (its full name), or the rows whose name contains this")
    p.add_argument("--runs", type=int, default=None, help="runs per world instead of each row's")
    p.add_argument("--seed", type=int, default=None, help="reproducible keys (SecretKey.of(derived seeds))")
    p.add_argument("--out", type=Path, default=OUT, help="the folder of the JSON rows")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print("| row | k | T (run) | z | class | signs | momentum | runs | claim eps | lower bound | GDP eps (mu) | "
          "canary's exact eps (mu) | s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, audit in ROWS.items():
        if (name != args.only) if args.only in ROWS else (args.only not in name):  # a row's name: that row only
            continue
        if args.runs is not None or args.seed is not None:
            from dataclasses import replace
            audit = replace(audit, runs=args.runs or audit.runs, seed=args.seed)
        r = blt_audit(audit)
        run = f" ({audit.length}; claim at T: {r['epsilon_planned']:.3f})" if audit.length != audit.steps else ""
        print(f"| {name} | {audit.classes} | {audit.steps}{run} | {audit.noise_multiplier:g} | {audit.band_class} | "
              f"{audit.signs} | {audit.momentum:g} | {audit.runs} | {r['epsilon_claimed']:.3f} | "
              f"{r['epsilon_lower_bound']:.3f} | {r['epsilon_lower_bound_gdp']:.3f} ({r['mu_lower_bound']:.3f}) | "
              f"{r['epsilon_canary']:.3f} ({r['mu_canary']:.3f}) | {r['seconds']:.1f} |", flush=True)
        if not args.no_write:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{name}.json").write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
