#!/usr/bin/env bash
# The single-GPU run (issue 8): tests with CUDA visible, kernel and actor benchmarks,
# the demo and a bench sweep, on a machine with torch+triton but no Ray.
# Ray comes as wheels in .whl/ (tools/ray-wheels-py312.sh .whl). Outputs go to $OUT.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
mkdir -p "$OUT/bench"
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import sys,torch,triton,ray,numpy;print(sys.version.split()[0],"torch",torch.__version__,"triton",triton.__version__,"ray",ray.__version__,"numpy",numpy.__version__)'
} > "$OUT/env.txt" 2>&1
step 280 tests.txt python3 scripts/run_tests.py -q -p no:cacheprovider -W ignore ${TEST_ARGS:-}
step 120 kernels.txt python3 benchmarks/bench_kernels.py
step 60 actors.txt python3 benchmarks/bench_actors.py --iters 200
step 60 demo.txt python3 -m cpkv demo --no-progress
step 120 bench.txt python3 -m cpkv bench --lanes 1,2,4 --context 32k,128k,1M --requests 6 --no-progress --no-plot --out "$OUT/bench"
rm -f "$OUT/bench/bench.csv"
for f in "$OUT"/*.txt; do grep -v "WARNING\|core_worker.cc\|repeated [0-9]*x" "$f" > "$f.tmp" && mv "$f.tmp" "$f"; done
for f in "$OUT"/*.txt; do tail -n 3 "$f"; done
