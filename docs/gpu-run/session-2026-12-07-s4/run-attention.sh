#!/usr/bin/env bash
# GPU call 2 (~8 min, no Ray): the CUDA tests of today's kernel changes (merge offsets,
# decode checks, TMA checks, paired key tiles); the paired-tiles A/B beside cuDNN and flash
# (issue 20); the attention table when the card is an H200.
set -u
OUT=${OUT:-results/gpu}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
step() {
  local t=$1 name=$2 s=$SECONDS; shift 2
  echo "== $*" > "$OUT/$name"
  timeout "$t" "$@" >> "$OUT/$name" 2>&1
  echo "rc=$? wall $((SECONDS - s))s" >> "$OUT/$name"
}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$OUT/env.txt" 2>&1
step 120 kernels.txt python3 -m pytest -q -p no:cacheprovider tests/test_decode_kernel.py tests/test_attention_kernels.py -k "merge or decode or tma"
step 300 pairs.txt python3 docs/gpu-run/hopper-attention/11-pair-tiles/run.py
grep -q H200 "$OUT/env.txt" && step 120 attention.txt python3 benchmarks/bench_attention.py
cat "$OUT/env.txt"; tail -3 "$OUT/kernels.txt"; grep "x cudnn\|rc=" "$OUT/pairs.txt"
grep -h "/cudnn =" "$OUT/attention.txt" 2>/dev/null | grep -v pointer
