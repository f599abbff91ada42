#!/usr/bin/env bash
# GPU, one call: where a cp=4 step's fixed cost goes (timeline_step.py --cp 4), and the
# sender that polls instead of being woken (60da2f4; run at af112a5) against its base
# (5d3d44f), PAIRS pairs alternating (default 1; ARMS=new: the new code alone). Carry .whl
# and .scratch/base (`git archive 5d3d44f cpkv`).
set -u
. scripts/_gpu_env.sh
ROOT=$PWD
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$OUT/env.txt" 2>&1
TL="python3 $ROOT/docs/gpu-run/step-timeline/timeline_step.py --iters 60 --model llama-3.2-1b --greedy --num-gpus-per-lane 0.25"
step 90 timeline-cp4.txt $TL --cp 4
BS="python3 $ROOT/benchmarks/bench_steps.py --cp 1,4 --dispatch graph --iters 100 --model llama-3.2-1b --num-gpus-per-lane 0.25"
for i in $(seq "${PAIRS:-1}"); do
  for arm in ${ARMS:-new base}; do
    dir=$ROOT; [ $arm = base ] && dir=$ROOT/.scratch/base
    (cd "$dir" && PYTHONPATH="$dir:/tmp/site" step 130 "steps-$arm-$i.txt" $BS)
  done
done
step 60 timeline-cp1.txt $TL --cp 1
# Issue 20's table where the card is the (the H100's was taken the same day).
grep -q H200 "$OUT/env.txt" && step 100 attention.txt python3 benchmarks/bench_attention.py
for f in "$OUT"/steps-*.txt; do echo "$f"; grep -h -A2 "^cp  dispatch" "$f"; tail -1 "$f"; done
grep -v "CoordinatorActor\|WARNING" "$OUT"/timeline-cp*.txt
grep -h "/cudnn =" "$OUT/attention.txt" 2>/dev/null | grep -v pointer
