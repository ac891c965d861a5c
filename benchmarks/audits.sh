#!/usr/bin/env bash
# The audits of docs/privacy.md ("Audits"): each line is the command of one table row; JSON results in
# benchmarks/results/audits/. Canary audits take seconds to a minute each on one CPU core; one-run audits minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
A=".venv/bin/clipbias audit --quiet --json"
O=benchmarks/results/audits
mkdir -p $O
# 1. the refutation of DiceSGD's Thm 3.8 (issue configuration), every basis
for b in paper authors sound conservative; do
  $A --algo dice --noise-multiplier 8 --sample-rate 0.01 --steps 1000 --batch-size 10 --clip 1 --ef-clip 0.1 \
     --grad-bound 10000 --dice-accounting $b --trials 20000 > $O/dice-canary-$b.json
done
# 2. Fashion-MNIST scale (q = 256/60000, T = 2340, z = 8, r = 1)
for b in paper sound; do
  $A --algo dice --noise-multiplier 8 --sample-rate 0.004266666666666667 --steps 2340 --batch-size 256 --clip 1 \
     --ef-clip 0.00390625 --dice-accounting $b --trials 20000 > $O/dice-fmnist-$b.json
done
# 3. the authors' protocol at its own calibration for epsilon = 2 (z_DPSGD(2) sqrt(1 + 2r), r = 1)
z=$(.venv/bin/clipbias calibrate --algo dice --dice-accounting authors --epsilon 2 --delta 1e-5 \
    --sample-rate 0.004266666666666667 --steps 2340 --batch-size 256 --ef-clip 0.00390625 --json \
    | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["noise_multiplier"])')
$A --algo dice --noise-multiplier $z --sample-rate 0.004266666666666667 --steps 2340 --batch-size 256 --clip 1 \
   --ef-clip 0.00390625 --dice-accounting authors --trials 20000 > $O/dice-fmnist-authors-eps2.json
# 4. DPSGD: honest at several (q, z, T), and a mechanism that adds 10x less noise than it claims
for cfg in "0.01 1.0 300" "0.01 0.6 1000" "0.1 2.0 200" "0.004266666666666667 0.7 2340"; do
  set -- $cfg
  $A --algo dpsgd --sample-rate $1 --noise-multiplier $2 --steps $3 --batch-size 10 --trials 20000 \
     > $O/dpsgd-q$1-z$2-T$3.json
done
$A --algo dpsgd --noise-multiplier 0.3 --claim-noise-multiplier 3 --sample-rate 0.01 --steps 1000 --batch-size 10 \
   --trials 20000 > $O/dpsgd-cheat.json
# 5. every other algorithm with per-example rows, once (batched canary): Gaussian ones at DPSGD's
#    z = 0.6 configuration, the feedback ones at the DiceSGD configuration of 1.
for algo in normalized perturb; do
  $A --algo $algo --noise-multiplier 0.6 --sample-rate 0.01 --steps 1000 --batch-size 10 --clip 1 --trials 20000 \
     > $O/$algo-canary.json
done
for algo in dice-adam dice-auto dice-perturb; do
  $A --algo $algo --noise-multiplier 8 --sample-rate 0.01 --steps 1000 --batch-size 10 --clip 1 --ef-clip 0.1 \
     --grad-bound 10000 --trials 20000 > $O/$algo-canary.json
done
