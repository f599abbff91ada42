#!/usr/bin/env bash
# Call D: which process's malloc thresholds matter: default, the client's only (mallopt in
# the driver), every process's (MALLOC_* in the driver's environment), cp 1, twice.
set -u
. scripts/_gpu_env.sh
STEPS="--dispatch graph --iters 100 --model llama-3.2-1b --num-gpus-per-lane 0.25 --cp 1"
for i in 1 2; do
  step 70 steps-default-$i.txt python3 benchmarks/bench_steps.py $STEPS
  step 70 steps-client-$i.txt python3 .scratch/with_malloc.py benchmarks/bench_steps.py $STEPS
  MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=134217728 step 70 steps-env-$i.txt python3 benchmarks/bench_steps.py $STEPS
done
for f in steps-default-1 steps-client-1 steps-env-1 steps-default-2 steps-client-2 steps-env-2; do echo "$f: $(grep -A1 '^cp  dispatch' $OUT/$f.txt | tail -1) $(tail -1 $OUT/$f.txt)"; done
