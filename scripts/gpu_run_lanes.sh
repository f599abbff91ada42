#!/usr/bin/env bash
# The GPU run for the lanes' compute (issues 13 and 14): the 1B Llama prefill against
# transformers, the attention kernels against SDPA, and the CUDA tests of kernels, CP
# attention and lanes. One H200, torch+triton but no Ray: Ray comes as wheels in .whl/
# (tools/ray-wheels-py312.sh .whl). Outputs go to $OUT.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import sys,torch,triton,ray,numpy,transformers;print(sys.version.split()[0],"torch",torch.__version__,"triton",triton.__version__,"ray",ray.__version__,"numpy",numpy.__version__,"transformers",transformers.__version__)'
} > "$OUT/env.txt" 2>&1
step ${PREFILL_S:-260} prefill.txt python3 benchmarks/bench_prefill_gpu.py --json "$OUT/prefill.json"
step ${ATTN_S:-120} attention.txt python3 benchmarks/bench_attention.py --json "$OUT/attention.json"
step ${TESTS_S:-170} tests.txt python3 -m pytest -q -p no:cacheprovider -W ignore ${TEST_ARGS:-tests/test_attention_kernels.py tests/test_cp_attention.py tests/test_lane_attention.py tests/test_lane_model.py}
for f in "$OUT"/*.txt; do grep -v "core_worker.cc\|repeated [0-9]*x" "$f" > "$f.tmp" && mv "$f.tmp" "$f"; done
for f in "$OUT"/*.txt; do echo "--- $f"; tail -n 12 "$f"; done
