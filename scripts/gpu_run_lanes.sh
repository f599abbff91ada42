#!/usr/bin/env bash
# The GPU run for the lanes' compute (issues 13 and 14): the 1B Llama prefill against
# transformers, the attention kernels against SDPA (and the zigzag/contiguous ablation), the
# prefill bench's ablation through the lanes, and the CUDA tests of kernels, CP attention and
# lanes. One H200, torch+triton but no Ray: Ray comes as wheels in .whl/
# (tools/ray-wheels-py312.sh .whl). Outputs go to $OUT.
#
# STEPS picks what runs, in this order (default: all but sweep):
#   sweep      bench_attention.py --only-sweep --sweep-d 64 (tiling candidates at head dim 64)
#   ipc        pytest tests/test_device_exchange.py (the CUDA IPC exchange, a peer dying)
#   prefill    bench_prefill_gpu.py --tokens $PREFILL_TOKENS (cp 1/2/4 against transformers)
#   attention  bench_attention.py (kernels against SDPA, split ablation)
#   bench      cpkv bench --prefill, 1B shape at $BENCH_CONTEXT, lanes packed on the GPU
#   steps      bench_steps.py: a tiny prefill's and a decode step's latency, 1B shape, cp 1 and 4
#   decode     bench_decode_gpu.py: decode steps (CUDA graphs at cp=1) against transformers
#   tests      pytest $TEST_ARGS
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
STEPS=${STEPS:-prefill attention bench tests}
{
  date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import sys,torch,triton,ray,numpy,transformers;print(sys.version.split()[0],"torch",torch.__version__,"triton",triton.__version__,"ray",ray.__version__,"numpy",numpy.__version__,"transformers",transformers.__version__)'
} > "$OUT/env.txt" 2>&1
for s in $STEPS; do
  case $s in
    sweep) step ${SWEEP_S:-150} sweep.txt python3 benchmarks/bench_attention.py --only-sweep \
      --sweep-d 64 --sweep-seconds $(( ${SWEEP_S:-150} - 20 )) --json "$OUT/sweep.json" ;;
    ipc) step ${IPC_S:-150} ipc.txt python3 -m pytest -q -s -p no:cacheprovider -W ignore \
      tests/test_device_exchange.py ;;
    prefill) step ${PREFILL_S:-260} prefill.txt python3 benchmarks/bench_prefill_gpu.py \
      --tokens ${PREFILL_TOKENS:-32768} --json "$OUT/prefill.json" ;;
    attention) step ${ATTN_S:-150} attention.txt python3 benchmarks/bench_attention.py \
      --json "$OUT/attention.json" ;;
    bench) step ${BENCH_S:-200} bench.txt python3 -m cpkv bench --prefill --lanes 1,2,4 \
      --context ${BENCH_CONTEXT:-32768} --model llama-3.2-1b --num-gpus-per-lane 0.25 --requests 2 \
      --no-progress --out "$OUT/bench" ;;
    steps) step ${STEPS_S:-150} steps.txt python3 benchmarks/bench_steps.py --cp 1,4 \
      --model llama-3.2-1b --num-gpus-per-lane 0.25 --iters 30 --json "$OUT/steps.json" ;;
    decode) step ${DECODE_S:-300} decode.txt python3 benchmarks/bench_decode_gpu.py \
      --contexts ${DECODE_CONTEXTS:-4096,32768} --json "$OUT/decode.json" ;;
    tests) step ${TESTS_S:-170} tests.txt python3 -m pytest -q -p no:cacheprovider -W ignore \
      --durations=8 ${TEST_ARGS:-tests/test_attention_kernels.py tests/test_cp_attention.py tests/test_lane_attention.py tests/test_lane_model.py} ;;
    *) echo "unknown step $s" >&2; exit 2 ;;
  esac
done
for f in "$OUT"/*.txt; do grep -v "core_worker.cc\|repeated [0-9]*x" "$f" > "$f.tmp" && mv "$f.tmp" "$f"; done
for f in "$OUT"/*.txt; do echo "--- $f"; tail -n 14 "$f"; done
