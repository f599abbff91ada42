#!/usr/bin/env bash
# Call A (written in the seventh session, run in the eighth; carry .whl): issue 20's attention table and the cp=1 1B prefill
# against transformers on the card the issue names, the step's fixed cost at cp 1 and 4
# (issue 22 item 2), decode at 4k (item 3), and the attention kernels' CUDA tests.
set -u
. scripts/_gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
step 150 attention.txt python3 benchmarks/bench_attention.py
step 170 prefill.txt python3 benchmarks/bench_prefill_gpu.py --tokens 32768,131072 --cps 1 --json "$OUT/prefill.json"
step 120 steps.txt python3 benchmarks/bench_steps.py --cp 1,4 --dispatch graph --iters 100 --model llama-3.2-1b --num-gpus-per-lane 0.25
step 90 decode.txt python3 benchmarks/bench_decode_gpu.py --contexts 4096 --cps 1 --steps 20 --json "$OUT/decode.json"
grep -h "/cudnn =\|rc=" "$OUT/attention.txt" | grep -v pointer
grep -h "transformers\|rc=" "$OUT/prefill.txt"
grep -h -A3 "^cp  dispatch" "$OUT/steps.txt"; tail -1 "$OUT/steps.txt"
grep -h "batch\|cpkv\|rc=" "$OUT/decode.txt"
