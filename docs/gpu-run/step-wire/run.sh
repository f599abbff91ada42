#!/usr/bin/env bash
# GPU box, one call: this session's step-path changes ("new" = the working tree: the wire's
# dispatch table, rotation owners on ints, steps written by the queuing thread) against the
# code before them ("base" = .scratch/base, `git archive d1f53ec cpkv` plus this session's
# timeline script, bench_steps.py and, since, the benchmarks' _timing.py), alternating. Carry .whl and .scratch/base.
set -u
. scripts/_gpu_env.sh
ROOT=$PWD
run() {  # name dir cmd...
  local name=$1 dir=$2; shift 2
  echo "== $name: $*" >> "$OUT/log.txt"
  (cd "$dir" && PYTHONPATH="$dir:/tmp/site" timeout 150 "$@") > "$OUT/run.tmp" 2>&1
  grep -v WARNING "$OUT/run.tmp" | grep -v "^.\[3" | grep -v INFO | tail -24 >> "$OUT/log.txt"
}
nproc >> "$OUT/log.txt"
TL="python3 docs/gpu-run/step-timeline/timeline_step.py --iters 60"
BS="python3 benchmarks/bench_steps.py --cp 1,4 --dispatch graph --iters 60 --model llama-3.2-1b --num-gpus-per-lane 0.25"
[ "${ONLY_BS:-0}" = 1 ] || {
run bare "$ROOT" python3 docs/gpu-run/step-wire/bare_rounds.py 300 1000
run bench-wire "$ROOT" python3 benchmarks/bench_wire.py
for i in 1 2; do
  run "tl-1b-new-$i" "$ROOT" $TL --model llama-3.2-1b
  run "tl-1b-base-$i" "$ROOT/.scratch/base" $TL --model llama-3.2-1b
done
run tl-tiny-new "$ROOT" $TL
run tl-tiny-base "$ROOT/.scratch/base" $TL
}
for i in ${PAIRS:-1}; do
  run "bs-new-$i" "$ROOT" $BS
  run "bs-base-$i" "$ROOT/.scratch/base" $BS
done
rm -f "$OUT/run.tmp"
cat "$OUT/log.txt"
