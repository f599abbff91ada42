#!/usr/bin/env bash
# GPU call 2 (~8 min, carry .whl and .scratch/base-s5 = git archive 1bd00ff cpkv benchmarks):
# the CUDA tests of solo steps (CP attention over spawned lanes with cuda_ipc, the 1B-free
# lane-model tests through Ray) and of the section clock; then bench_steps at cp 4, the tree
# before solo steps against this one, alternating. The base runs from inside its own tree:
# in call 1 its lanes imported this tree's cpkv (Ray puts the driver's working directory on
# its workers' path), so that "base" was not one.
set -u
. scripts/_gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$OUT/env.txt" 2>&1
step 30 clock.txt python3 -m pytest -q -p no:cacheprovider tests/test_clock.py
step 150 cp-attention.txt python3 -m pytest -q -p no:cacheprovider tests/test_cp_attention.py
step 200 lane-model.txt python3 -m pytest -q -p no:cacheprovider tests/test_lane_model.py tests/test_results.py
ARGS="--cp 4 --dispatch graph --iters 100 --model llama-3.2-1b --num-gpus-per-lane 0.25"
ROOT=$PWD
for i in 1 2; do
  (cd .scratch/base-s5 && PYTHONPATH=/tmp/site:$ROOT/.scratch/base-s5 step 90 "steps-base-$i.txt" python3 benchmarks/bench_steps.py $ARGS)
  step 90 "steps-new-$i.txt" python3 benchmarks/bench_steps.py $ARGS
done
cat "$OUT/env.txt"; for f in clock cp-attention lane-model; do tail -2 "$OUT/$f.txt"; done
for f in "$OUT"/steps-*.txt; do echo "$(basename "$f"): $(grep -A1 "^cp  dispatch" "$f" | tail -1)"; done
