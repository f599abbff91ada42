#!/usr/bin/env bash
# GPU (an H200 if lent), one short call: the attention table where the card is an H200 (issue
# 20), then the step path's fixed cost with greedy prefills (issue 22 item 2). Carry .whl.
set -u
. scripts/_gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$OUT/env.txt" 2>&1
grep -q H200 "$OUT/env.txt" && step 90 attention.txt python3 benchmarks/bench_attention.py
step 150 steps.txt python3 benchmarks/bench_steps.py --cp 1,4 --dispatch graph --iters 60 --model llama-3.2-1b --num-gpus-per-lane 0.25
cat "$OUT/env.txt"; grep -h "cudnn =" "$OUT/attention.txt" 2>/dev/null | grep -v pointer
grep -h -A3 "^cp  dispatch" "$OUT/steps.txt"
