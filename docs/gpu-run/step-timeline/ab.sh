#!/usr/bin/env bash
# A/B/C on the GPU box, alternating: the working tree ("new": packed graphs, 16-bit logits),
# the packing alone ("packed", .scratch/head = git archive 0cbdf35 cpkv benchmarks docs/...)
# and the parent before packing ("base", .scratch/base = git archive 43c32bf, plus this
# timeline script); then bench_steps through the client's graph, and the graph tests.
# Carry .whl, .scratch/base and .scratch/head.
set -u
. scripts/_gpu_env.sh  # Ray from .whl/, its binaries executable
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
ROOT=$PWD
run() {  # name dir cmd...
  local name=$1 dir=$2; shift 2
  echo "== $name: $*" | tee -a "$OUT/log.txt"
  (cd "$dir" && PYTHONPATH="$dir:/tmp/site" timeout 120 "$@") > "$OUT/$name.txt" 2>&1
  grep -v WARNING "$OUT/$name.txt" | grep -v "^.\[3" | tail -13 | tee -a "$OUT/log.txt"
}
TL="python3 docs/gpu-run/step-timeline/timeline_step.py --iters 40"
for i in 1 2; do
  run "tl-1b-new-$i" "$ROOT" $TL --model llama-3.2-1b
  run "tl-1b-packed-$i" "$ROOT/.scratch/head" $TL --model llama-3.2-1b
  run "tl-1b-base-$i" "$ROOT/.scratch/base" $TL --model llama-3.2-1b
done
run "tl-tiny-new" "$ROOT" $TL
run "tl-tiny-base" "$ROOT/.scratch/base" $TL
BS="python3 benchmarks/bench_steps.py --cp 1,4 --dispatch graph --iters 30 --model llama-3.2-1b --num-gpus-per-lane 0.25"
run bs-new "$ROOT" $BS
run bs-base "$ROOT/.scratch/base" $BS
