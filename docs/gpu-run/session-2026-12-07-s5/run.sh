#!/usr/bin/env bash
# GPU call 1 of the fifth session (~9 min, carry .whl): the attention table on the H200 with
# D=64's paired tiles (issue 20), the cp=1 1B prefill against transformers at 32k and 128k
# (issue 20), and the step's steady fixed cost at cp 1 and 4 (issue 22 item 2), at cp 4 also
# for the tree before solo steps (.scratch/base-s5 = git archive 1bd00ff cpkv benchmarks,
# carried).
set -u
. scripts/_gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$OUT/env.txt" 2>&1
step 30 clock.txt python3 -m pytest -q -p no:cacheprovider tests/test_clock.py
step 150 attention.txt python3 benchmarks/bench_attention.py
step 170 prefill.txt python3 benchmarks/bench_prefill_gpu.py --tokens 32768,131072 --cps 1 --json "$OUT/prefill.json"
step 170 steps.txt python3 benchmarks/bench_steps.py --cp 1,4 --dispatch graph --iters 100 --model llama-3.2-1b --num-gpus-per-lane 0.25
PYTHONPATH=/tmp/site:$PWD/.scratch/base-s5 step 120 steps-base.txt python3 .scratch/base-s5/benchmarks/bench_steps.py --cp 4 --dispatch graph --iters 100 --model llama-3.2-1b --num-gpus-per-lane 0.25
cat "$OUT/env.txt"; tail -2 "$OUT/clock.txt"; grep -h "/cudnn =\|rc=" "$OUT/attention.txt" | grep -v pointer
grep -h "transformers\|rc=" "$OUT/prefill.txt"
grep -h -A3 "^cp  dispatch" "$OUT/steps.txt" "$OUT/steps-base.txt"; tail -1 "$OUT/steps.txt" "$OUT/steps-base.txt"
