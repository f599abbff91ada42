#!/usr/bin/env bash
# GPU, one call: a step's fixed cost at a long job's steady state (bench_steps.py after 300
# logits prefills, beside the cold figure), and the cp=4 logits step's timeline after the
# same warm-up; issue 20's attention table too when the card is an H200 (the issue's).
# Carry .whl.
set -u
. scripts/_gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$OUT/env.txt" 2>&1
step 200 steps.txt python3 benchmarks/bench_steps.py --cp 1,4 --dispatch graph --iters 100 --model llama-3.2-1b --num-gpus-per-lane 0.25
TL="python3 docs/gpu-run/step-timeline/timeline_step.py --iters 100 --model llama-3.2-1b --num-gpus-per-lane 0.25"
step 120 timeline-cp4.txt $TL --cp 4
grep -q H200 "$OUT/env.txt" && step 100 attention.txt python3 benchmarks/bench_attention.py
cat "$OUT/env.txt"; grep -h -A3 "^cp  dispatch" "$OUT/steps.txt"; tail -2 "$OUT/steps.txt"
grep -v "CoordinatorActor\|WARNING" "$OUT/timeline-cp4.txt"
grep -h "/cudnn =" "$OUT/attention.txt" 2>/dev/null | grep -v pointer
