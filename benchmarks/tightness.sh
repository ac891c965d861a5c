#!/usr/bin/env bash
# Tightness of the audits (docs/privacy.md, "Tightness"): lower bound / claim for every algorithm, white-box
# Dirac canaries. JSON in benchmarks/results/tightness/; the table: python benchmarks/tightness_table.py.
# Run from the repository root; PY names the interpreter (default .venv/bin/python). Each command is short
# (seconds to two minutes on one shared core); run the script under nice on a shared machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
A="$PY -m clipbias audit --quiet --json"
O=benchmarks/results/tightness
mkdir -p $O
# 1. DPSGD-GC, full batch (q = 1, T = 4: the Gaussian mechanism, mu = 2/z), claims 2.0, 4.4, 7.6:
#    many-run canary audit (lr statistic, 20,000 runs per world) and one white-box run with 10,000 canaries
for z in 4 2 1.25; do
  $A --algo dpsgd --noise-multiplier $z --sample-rate 1 --steps 4 --batch-size 10 --statistic lr --trials 20000 \
     > $O/dpsgd-full-z$z-canary.json
  $A --mode one-run-ideal --algo dpsgd --noise-multiplier $z --sample-rate 1 --steps 4 --batch-size 10 \
     --canaries 10000 > $O/dpsgd-full-z$z-one-run.json
done
# 2. DPSGD-GC, Poisson rate 0.1, T = 50, claims 2.5, 5.1, 8.1 (10,000 runs per world; 4,000 canaries)
for z in 1.5 1.0 0.8; do
  $A --algo dpsgd --noise-multiplier $z --sample-rate 0.1 --steps 50 --batch-size 10 --statistic lr --trials 10000 \
     > $O/dpsgd-q0.1-z$z-canary.json
  $A --mode one-run-ideal --algo dpsgd --noise-multiplier $z --sample-rate 0.1 --steps 50 --batch-size 10 \
     --statistic lr --canaries 4000 > $O/dpsgd-q0.1-z$z-one-run.json
done
# 3. the other algorithms with per-example rows, many-run canary audit (4,000 runs per world):
#    Gaussian ones at q = 0.1, T = 50, z = 1 (lr statistic); the DiceSGD family at q = 0.02, T = 300, z = 8,
#    B = 10, C2 = 0.1, G = 1e4 with the anti-canary (gradient -1000); dice also without it and its paper basis
for algo in normalized perturb; do
  $A --algo $algo --noise-multiplier 1 --sample-rate 0.1 --steps 50 --batch-size 10 --statistic lr --trials 4000 \
     > $O/$algo-canary.json
done
D="--noise-multiplier 8 --sample-rate 0.02 --steps 300 --batch-size 10 --clip 1 --ef-clip 0.1 --grad-bound 10000 --trials 4000"
for algo in dice dice-adam dice-auto dice-perturb; do
  $A --algo $algo $D --anti-canary 1000 > $O/$algo-anti-canary.json
done
$A --algo dice $D > $O/dice-canary.json
$A --algo dice $D --dice-accounting paper --anti-canary 1000 > $O/dice-paper-anti-canary.json
# 4. every algorithm with hidden state, one white-box run of its own engine (2,000 canaries): per-example momentum
#    (full batch, T = 8, z = 2), inner-outer momentum, perturbation, adaptive clipping, DiceSGD (q = 0.1, T = 50, z = 1)
$A --mode one-run-ideal --algo dpgd-momentum --noise-multiplier 2 --sample-rate 1 --steps 8 --batch-size 10 \
   --canaries 2000 > $O/dpgd-momentum-one-run.json
for algo in inner-outer perturb adaptive dice dice-auto; do
  $A --mode one-run-ideal --algo $algo --noise-multiplier 1 --sample-rate 0.1 --steps 50 --batch-size 10 \
     --statistic lr --canaries 2000 > $O/$algo-one-run.json
done
