#!/usr/bin/env bash
# GPU, one call (~9 min) when only one can be had: the CUDA tests of today's kernel changes;
# the paired-tiles A/B beside cuDNN and flash (issue 20); the step's steady fixed cost at
# cp 1 and 4 (issue 22 item 2; its cuda_ipc lane groups run today's comm change). Carry .whl.
set -u
. scripts/_gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$OUT/env.txt" 2>&1
step 100 kernels.txt python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernel.py tests/test_attention_kernels.py -k "merge or decode or tma"
step 230 pairs.txt python3 docs/gpu-run/hopper-attention/11-pair-tiles/run.py
step 200 steps.txt python3 benchmarks/bench_steps.py --cp 1,4 --dispatch graph --iters 100 --model llama-3.2-1b --num-gpus-per-lane 0.25
cat "$OUT/env.txt"; tail -3 "$OUT/kernels.txt"; grep "x cudnn\|rc=" "$OUT/pairs.txt"
grep -h -A3 "^cp  dispatch" "$OUT/steps.txt"; tail -2 "$OUT/steps.txt"
