#!/usr/bin/env bash
# Call C (sixth session): on an H200 the attention table and the cp=1 1B prefill against
# transformers (#20); on an H100, whether glibc's fixed thresholds in the client process
# (MALLOC_* in the driver's environment) cut the logits row's cost (bench_steps cp 1,
# alternating twice).
set -u
. scripts/_gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$OUT/env.txt" 2>&1
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
for m in default fix default fix; do python3 .scratch/heap.py $m | tail -1; done | tee "$OUT/heap.txt"
if grep -q H200 "$OUT/env.txt"; then
  step 170 attention.txt python3 benchmarks/bench_attention.py
  grep -h "/cudnn =\|rc=" "$OUT/attention.txt" | grep -v pointer
  step 220 prefill.txt python3 benchmarks/bench_prefill_gpu.py --tokens 32768,131072 --cps 1 --json "$OUT/prefill.json"
  grep -h "transformers\|rc=" "$OUT/prefill.txt"
else
  STEPS="--dispatch graph --iters 100 --model llama-3.2-1b --num-gpus-per-lane 0.25 --cp 1"
  for i in 1 2; do
    step 80 steps-default-$i.txt python3 benchmarks/bench_steps.py $STEPS
    MALLOC_MMAP_THRESHOLD_=67108864 MALLOC_TRIM_THRESHOLD_=134217728 step 80 steps-malloc-$i.txt python3 benchmarks/bench_steps.py $STEPS
  done
  for f in steps-default-1 steps-malloc-1 steps-default-2 steps-malloc-2; do echo "$f: $(grep -A1 '^cp  dispatch' $OUT/$f.txt | tail -1) $(tail -1 $OUT/$f.txt)"; done
fi
