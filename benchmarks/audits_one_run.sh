#!/usr/bin/env bash
# One-run audits of docs/privacy.md ("Audits"): Steinke, Nasr & Jagielski (2023), m = 1000 canaries.
# 1. DPSGD on the Fashion-MNIST CNN, white-box gradient canaries, at epsilon 3 and 8 (B = 2048, 5 epochs,
#    lr 4, C = 0.1, momentum 0.9: the benchmark protocol; z from `clipbias calibrate`), ~3-5 min each.
# 2. every algorithm with a row backend of its own, once, black-box input canaries, digits + mlp.
set -euo pipefail
cd "$(dirname "$0")/.."
O=benchmarks/audits
mkdir -p $O
A=".venv/bin/clipbias audit --mode one-run --quiet --json"
for cfg in "3 0.96630859375" "8 0.64794921875"; do
  set -- $cfg
  /usr/bin/time -v $A --algo dpsgd --data fashion-mnist --model cnn --noise-multiplier $2 --sample-rate 0.034 \
     --steps 145 --clip 0.1 --lr 4 --canaries 1000 > $O/one-run-dpsgd-cnn-eps$1.json 2> $O/one-run-dpsgd-cnn-eps$1.time
done
for algo in self-aug p-avg inner-outer dice-self-aug; do
  $A --algo $algo --data digits --model mlp --noise-multiplier 1 --sample-rate 0.05 --steps 300 --clip 1 --lr 0.5 \
     --canaries 200 --canary-type input > $O/one-run-$algo-digits.json
done
$A --algo dpgd-momentum --data digits --model mlp --noise-multiplier 5 --sample-rate 1 --steps 100 --clip 1 --lr 0.5 \
   --canaries 200 --canary-type gradient > $O/one-run-dpgd-momentum-digits.json
$A --algo batch-clip --data fashion-mnist --model cnn-gn --subset 2000 --noise-multiplier 1 --sample-rate 0.05 \
   --steps 100 --clip 1 --lr 0.5 --canaries 200 --canary-type input > $O/one-run-batch-clip-fmnist2000.json
