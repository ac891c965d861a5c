#!/bin/bash
cd /work/main
run() { # eps lr clip seed
  d=benchmarks/results/selection_compare_blt_k29/runs/final-eps$1-blt29-lr$2-clip$3-s$4
  [ -f $d/results.json ] && return
  .venv/bin/python -m clipbias train --data fashion-mnist --model scatter-linear --epsilon $1 --delta 1e-5 --momentum 0.9 --threads 1 --quiet --epochs 3 --batch-size 2048 --algo dpsgd --lr $2 --clip $3 --ema 0.9 --seed $4 --bands 29 --bands-strategy blt --out $d --overwrite > /dev/null
}
for s in 0 1 2; do run 3 56 0.05 $s & run 8 224 0.025 $s; wait; done
echo done
