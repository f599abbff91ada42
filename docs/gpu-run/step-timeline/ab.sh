#!/usr/bin/env bash
# A/B of the graphs' packing on the GPU box: the working tree ("packed") against the parent
# before packing ("base", .scratch/base = git archive 43c32bf cpkv benchmarks, plus this
# timeline script), alternating; then bench_steps through the client's graph, and the graph
# tests. Carry .whl and .scratch/base.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
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
  run "tl-1b-packed-$i" "$ROOT" $TL --model llama-3.2-1b
  run "tl-1b-base-$i" "$ROOT/.scratch/base" $TL --model llama-3.2-1b
  run "tl-tiny-packed-$i" "$ROOT" $TL
  run "tl-tiny-base-$i" "$ROOT/.scratch/base" $TL
done
BS="python3 benchmarks/bench_steps.py --cp 1,4 --dispatch graph --iters 40 --num-gpus-per-lane 0.25"
run bs-packed "$ROOT" $BS
run bs-base "$ROOT/.scratch/base" $BS
run tests "$ROOT" python3 -m pytest -q -x tests/test_step_graph.py tests/test_compiled_steps.py
