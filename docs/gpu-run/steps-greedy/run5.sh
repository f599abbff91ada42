#!/usr/bin/env bash
# GPU (an H200 if lent), one call: the attention table (issue 20), the step path's fixed cost
# with greedy prefills (issue 22 item 2), then run4.sh's py-spy profile. Carry .whl.
set -u
. scripts/_gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$OUT/env.txt" 2>&1
# The attention table only where the card is the issue's (an H100's was taken in run.sh).
grep -q H200 "$OUT/env.txt" && step 90 attention.txt python3 benchmarks/bench_attention.py
step 150 steps.txt python3 benchmarks/bench_steps.py --cp 1,4 --dispatch graph --iters 100 --model llama-3.2-1b --num-gpus-per-lane 0.25
grep -h "cudnn =" "$OUT/attention.txt" 2>/dev/null | grep -v pointer; grep -h -A3 "^cp  dispatch" "$OUT/steps.txt"
NATIVE=0 OUT=$OUT bash docs/gpu-run/steps-greedy/run4.sh > /dev/null 2>&1  # the plain profile only (device time)
tail -1 "$OUT"/loop-*.txt; ls "$OUT"
