#!/usr/bin/env bash
# GPU (asked for nvidia-h200; an H100 came), one call: the step path's fixed cost with greedy prefills (issue 22 item 2), the
# attention table and the cp=1 1B prefill against transformers (issue 20). Carry .whl.
set -u
. scripts/_gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
  python3 -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, triton.__version__)"
} > "$OUT/env.txt" 2>&1
BS="python3 benchmarks/bench_steps.py --cp 1,4 --dispatch graph --iters 60 --model llama-3.2-1b --num-gpus-per-lane 0.25"
step 150 steps-1.txt $BS
step 90 timeline-greedy.txt python3 docs/gpu-run/step-timeline/timeline_step.py --iters 60 --model llama-3.2-1b --greedy
step 90 attention.txt python3 benchmarks/bench_attention.py --json "$OUT/attention.json"
step 150 steps-2.txt $BS
step 170 prefill.txt python3 benchmarks/bench_prefill_gpu.py --tokens 32768,131072 --cps 1
grep -h -A12 "^cp  dispatch" "$OUT"/steps-*.txt
tail -20 "$OUT/timeline-greedy.txt"; tail -30 "$OUT/attention.txt"; tail -14 "$OUT/prefill.txt"
