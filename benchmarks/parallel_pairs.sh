#!/usr/bin/env bash
# Run pairs of benchmarks/methods_fmnist.py on one GPU with many processes at once (one process
# keeps an H100 far from busy with a ResNet20 at B = 256).
#   phase A: the learning-rate grid at the tuning seed 0, one process per (pair, arm, rate);
#   phase B: seeds 1 and 2 at each arm's chosen rate, one process per (pair, arm, seed), then the
#            pairs are assembled from the run cache (OUT/methods_runs) into OUT/methods_<pair>.json.
# Every run is cached, so phase B (a separate call, or AB in one) reuses phase A's runs; the result
# is exactly what one sequential `methods_fmnist.py --pairs PAIR ... --seeds 0 1 2` would compute.
# Usage: benchmarks/parallel_pairs.sh A|B|AB PAIR [PAIR ...]
#   env: OUT (benchmarks/results/gpu), EPOCHS (10), DEVICE (cuda), PY (python)
set -u
cd "$(dirname "$0")/.."
phase=$1; shift
[ $# -ge 1 ] || { echo "usage: $0 A|B|AB PAIR [PAIR ...]" >&2; exit 2; }
OUT=${OUT:-benchmarks/results/gpu}; PY=${PY:-python}
mkdir -p "$OUT"
C="--epochs ${EPOCHS:-10} --batch-size 256 --clip 1.0 --epsilon 3 --delta 1e-5 --validation 5000
   --probe-size 256 --device ${DEVICE:-cuda} --out $OUT --quiet"
LRS="0.5 1 2 4"
status=0
run_phase() {  # $1 = A or B
  local pids=()
  for pair in "${@:2}"; do
    for arm in baseline method; do
      if [ "$1" = A ]; then
        for lr in $LRS; do
          $PY benchmarks/methods_fmnist.py --pairs "$pair" --arms $arm --lrs $lr --seeds 0 $C \
            > "$OUT/log.$pair.$arm.lr$lr" 2>&1 & pids+=($!)
        done
      else
        for s in 1 2; do
          $PY benchmarks/methods_fmnist.py --pairs "$pair" --arms $arm --lrs $LRS --seeds 0 $s $C \
            > "$OUT/log.$pair.$arm.seed$s" 2>&1 & pids+=($!)
        done
      fi
    done
  done
  for p in "${pids[@]}"; do wait "$p" || status=1; done
}
case $phase in
  A) run_phase A "$@" ;;
  B) run_phase B "$@" ;;
  AB) run_phase A "$@"; run_phase B "$@" ;;
  *) echo "phase must be A, B or AB" >&2; exit 2 ;;
esac
[ $status -eq 0 ] || { echo "a run failed: see $OUT/log.*" >&2; exit 1; }
if [ "$phase" != A ]; then
  $PY benchmarks/methods_fmnist.py --pairs "$@" --lrs $LRS --seeds 0 1 2 $C
fi
