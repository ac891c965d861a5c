#!/usr/bin/env bash
# The audits of banded noise (docs/privacy.md, "Banded noise"): each line is the command of one table row;
# JSON results in benchmarks/results/audits/. PY names the interpreter (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
A="$PY -m clipbias audit --quiet --json"
O=benchmarks/results/audits
mkdir -p $O
# 1. canary audits, likelihood-ratio statistic, 100,000 runs per world: plain noise, 4 bands with the class
#    drawn per run (unknown to the adversary), known class 0, known class 3 (its last block truncated)
for cfg in "0.05 1.0 100" "0.05 1.5 100" "0.25 2.0 40"; do
  set -- $cfg
  C="--algo dpsgd --sample-rate $1 --noise-multiplier $2 --steps $3 --batch-size 10 --trials 100000 --statistic lr"
  $A $C > $O/bands1-q$1-z$2-T$3.json
  $A $C --bands 4 > $O/bands4-q$1-z$2-T$3.json
  for l in 0 3; do $A $C --bands 4 --band-class $l > $O/bands4-class$l-q$1-z$2-T$3.json; done
done
# 2. one block per class at rate b q = 1: the b-fold rate is visible (an accounting at rate q for T steps is refuted)
for b in 1 16; do
  $A --algo dpsgd --sample-rate 0.0625 --noise-multiplier 1.5 --steps 16 --batch-size 10 --trials 200000 \
     --statistic lr --bands $b $([ $b -gt 1 ] && echo --band-class 0) > $O/bands$b-single-block.json
done
# 3. white-box one-run through the engine (its sampler draws the classes), 5,000 Dirac canaries
for b in 1 4; do
  $A --mode one-run-ideal --algo dpsgd --sample-rate 0.05 --noise-multiplier 1.0 --steps 100 --batch-size 10 \
     --canaries 5000 --statistic lr --bands $b > $O/bands$b-one-run-ideal.json
done
# 4. black-box one-run through real training (digits, MLP, 500 gradient canaries)
for b in 1 4; do
  $A --mode one-run --algo dpsgd --data digits --model mlp --sample-rate 0.05 --noise-multiplier 1.0 --steps 100 \
     --canaries 500 --clip 1 --lr 0.5 --bands $b > $O/bands$b-one-run-digits.json
done
