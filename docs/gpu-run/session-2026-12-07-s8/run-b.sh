#!/usr/bin/env bash
# Call B (eighth session, carry .whl): the CUDA side of the seventh session's IPC fixes, run
# on a GPU for the first time: one CUDA IPC share per peer at three lanes (spawned lanes on one
# GPU; exchanges that regrow their slots and a group rebuilt on the same processes), CP
# attention over cuda_ipc at 2-4 lanes against one device; then the step's fixed cost at cp 1
# and 4 (issue 22 item 2) and decode at 4k (item 3).
set -u
. scripts/_gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$OUT/env.txt" 2>&1
step 120 exchange.txt python3 -m pytest -q -p no:cacheprovider tests/test_device_exchange.py
step 170 cp-attention.txt python3 -m pytest -q -p no:cacheprovider tests/test_cp_attention.py
step 120 steps.txt python3 benchmarks/bench_steps.py --cp 1,4 --dispatch graph --iters 100 --model llama-3.2-1b --num-gpus-per-lane 0.25
step 90 decode.txt python3 benchmarks/bench_decode_gpu.py --contexts 4096 --cps 1 --steps 20 --json "$OUT/decode.json"
cat "$OUT/env.txt"; for f in exchange cp-attention; do echo "$f: $(tail -1 "$OUT/$f.txt")"; done
grep -h -A3 "^cp  dispatch" "$OUT/steps.txt"; tail -1 "$OUT/steps.txt"
grep -h "batch\|cpkv\|rc=" "$OUT/decode.txt"
