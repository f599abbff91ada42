#!/usr/bin/env bash
# Call A (eighth session, carry .whl; the seventh's run-a, never run for want of a machine,
# with the decode row moved to call B): issue 20's attention table and the cp=1 1B prefill
# against transformers on the card the issue names; at D=64 today's TMA config against the
# pairs' second exp2 on the FMA pipes (TmaConfig.exp_fma), in turn, twice; the TMA tests on
# the GPU (the exp2 emulation compiled for sm_90 too).
set -u
. scripts/_gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
step 150 attention.txt python3 benchmarks/bench_attention.py
step 100 sweep64.txt python3 benchmarks/bench_attention.py --only-sweep --sweep-d 64 --sweep-seconds 45
step 170 prefill.txt python3 benchmarks/bench_prefill_gpu.py --tokens 32768,131072 --cps 1 --json "$OUT/prefill.json"
step 90 tma-tests.txt python3 -m pytest -q -p no:cacheprovider tests/test_attention_kernels.py -k "tma or exp2"
grep -h "/cudnn =\|rc=" "$OUT/attention.txt" | grep -v pointer
grep -h "pairs\|rc=" "$OUT/sweep64.txt"
grep -h "transformers\|rc=" "$OUT/prefill.txt"
tail -2 "$OUT/tma-tests.txt"
