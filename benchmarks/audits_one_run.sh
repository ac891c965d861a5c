#!/usr/bin/env bash
# One-run audits of docs/privacy.md ("Audits"): Steinke, Nasr & Jagielski (2023).
# 1. DPSGD on the Fashion-MNIST CNN, white-box gradient canaries (m = 1000), at epsilon 3 and 8 (B = 2048,
#    5 epochs, lr 4, C = 0.1, momentum 0.9: the benchmark protocol; z from `clipbias calibrate`), ~4 min each.
# 2. every algorithm with a row backend of its own, once, black-box input canaries (m = 200), on the first
#    2000 Fashion-MNIST images (cnn-gn), and dpgd-momentum (full batch) on digits.
# SKIP_CNN=1 runs part 2 only; ALGOS="..." restricts its list.
set -euo pipefail
cd "$(dirname "$0")/.."
O=benchmarks/results/audits
mkdir -p $O
A="${PY:-.venv/bin/python} -m clipbias audit --mode one-run --quiet --json"
if [ -z "${SKIP_CNN:-}" ]; then
  for cfg in "3 0.96630859375" "8 0.64794921875"; do
    set -- $cfg
    /usr/bin/time -v $A --algo dpsgd --data fashion-mnist --model cnn --noise-multiplier $2 --sample-rate 0.034 \
       --steps 145 --clip 0.1 --lr 4 --canaries 1000 > $O/one-run-dpsgd-cnn-eps$1.json 2> $O/one-run-dpsgd-cnn-eps$1.time
  done
fi
for algo in ${ALGOS:-self-aug p-avg inner-outer dice-self-aug batch-clip disk}; do
  m=0.9; [ $algo = inner-outer ] && m=0  # inner-outer has its own outer momentum
  $A --algo $algo --data fashion-mnist --model cnn-gn --subset 2000 --noise-multiplier 1 --sample-rate 0.05 \
     --steps 200 --clip 1 --lr 0.5 --momentum $m --canaries 200 --canary-type input > $O/one-run-$algo-fmnist2000.json
done
$A --algo dpgd-momentum --data digits --model mlp --noise-multiplier 5 --sample-rate 1 --steps 100 --clip 1 --lr 0.5 \
   --canaries 200 --canary-type input > $O/one-run-dpgd-momentum-digits.json
