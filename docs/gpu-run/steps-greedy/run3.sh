#!/usr/bin/env bash
# GPU, right after run2.sh on the same warm machine: the cp=4 pair, new then base, 200
# iterations. Carry .whl and .scratch/base (`git archive 536728e cpkv`).
. scripts/_gpu_env.sh
ROOT=$PWD
BS="python3 $ROOT/benchmarks/bench_steps.py --cp 4 --dispatch graph --iters 200 --model llama-3.2-1b --num-gpus-per-lane 0.25"
for arm in new base; do
  dir=$ROOT; [ $arm = base ] && dir=$ROOT/.scratch/base
  (cd "$dir" && PYTHONPATH="$dir:/tmp/site" step 200 "steps-cp4-$arm.txt" $BS)
done
grep -h -A2 "^cp  dispatch" "$OUT"/steps-*.txt
