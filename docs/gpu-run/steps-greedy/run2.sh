#!/usr/bin/env bash
# GPU, one call: the greedy path's CUDA tests against transformers, then the step path over
# 300 iterations (past the coordinator's 1024 remembered calls), "new" = the working tree
# against "base" = .scratch/base (`git archive 536728e cpkv`, before the reply cache's fix),
# alternating. Carry .whl and .scratch/base.
set -u
. scripts/_gpu_env.sh
ROOT=$PWD
step 250 tests.txt python3 -m pytest -q -p no:cacheprovider tests/test_lane_model.py tests/test_results.py
BS="python3 $ROOT/benchmarks/bench_steps.py --cp 1 --dispatch graph --iters 300 --model llama-3.2-1b --num-gpus-per-lane 0.25"
for arm in new base; do
  dir=$ROOT; [ $arm = base ] && dir=$ROOT/.scratch/base
  (cd "$dir" && PYTHONPATH="$dir:/tmp/site" step 150 "steps-$arm.txt" $BS)
done
tail -3 "$OUT/tests.txt"; grep -h -A3 "^cp  dispatch" "$OUT"/steps-*.txt
