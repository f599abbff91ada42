#!/usr/bin/env bash
# Call B (sixth session): the coordinator reading ready lanes first (c376176) against the
# tree before it (.scratch/base-s6 = git archive d4fba3f cpkv benchmarks, run from inside its
# own tree), bench_steps at cp 4 alternating twice, cp 1 once; the late-actor round; a hop
# trace at cp 4.
set -u
. scripts/_gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
ROOT=$PWD
STEPS="--dispatch graph --iters 100 --model llama-3.2-1b --num-gpus-per-lane 0.25"
step 60 compiled-graph.txt python3 benchmarks/bench_compiled_graph.py
for i in 1 2; do
  step 100 steps-new-$i.txt python3 benchmarks/bench_steps.py --cp 4 $STEPS
  (cd .scratch/base-s6 && PYTHONPATH=/tmp/site:$ROOT/.scratch/base-s6 OUT=$OUT step 100 steps-base-$i.txt python3 benchmarks/bench_steps.py --cp 4 $STEPS)
done
step 80 steps-new-cp1.txt python3 benchmarks/bench_steps.py --cp 1 $STEPS
tail -6 "$OUT/compiled-graph.txt"
for f in steps-new-1 steps-base-1 steps-new-2 steps-base-2 steps-new-cp1; do echo "$f: $(grep -A1 '^cp  dispatch' $OUT/$f.txt | tail -1) $(tail -1 $OUT/$f.txt)"; done
rm -rf /tmp/tr && mkdir /tmp/tr && cp -r cpkv /tmp/tr/
(cd /tmp/tr && patch -p1 -s < $ROOT/.scratch/trace.patch && cp $ROOT/.scratch/_trace.py cpkv/_trace.py
 rm -rf /tmp/trace; mkdir -p /tmp/trace
 PYTHONPATH=/tmp/site:/tmp/tr CPKV_TRACE=1 timeout 100 python3 $ROOT/.scratch/trace/loop.py llama-3.2-1b 10 4 0.25 > $OUT/loop-cp4.txt 2>&1
 python3 $ROOT/.scratch/trace/analyze.py > $OUT/trace-cp4.txt 2>&1)
grep "^n " $OUT/loop-cp4.txt; cat $OUT/trace-cp4.txt
