#!/usr/bin/env bash
# GPU, one call (short, device time nearly spent): where a cp=4 step's fixed cost goes
# (timeline_step.py --cp 4) and the step path's fixed cost at cp 1 and 4 of main at af112a5.
# Carry .whl.
set -u
. scripts/_gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$OUT/env.txt" 2>&1
TL="python3 docs/gpu-run/step-timeline/timeline_step.py --iters 60 --model llama-3.2-1b --greedy --num-gpus-per-lane 0.25"
step 80 timeline-cp4.txt $TL --cp 4
step 120 steps.txt python3 benchmarks/bench_steps.py --cp 1,4 --dispatch graph --iters 100 --model llama-3.2-1b --num-gpus-per-lane 0.25
cat "$OUT/env.txt"; grep -h -A3 "^cp  dispatch" "$OUT/steps.txt"; tail -1 "$OUT/steps.txt"
grep -v "CoordinatorActor\|WARNING" "$OUT/timeline-cp4.txt"
