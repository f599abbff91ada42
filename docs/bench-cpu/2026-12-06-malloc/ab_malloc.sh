set -u
cd /work/main
for i in 1 2; do
  echo "== new $i"; PYTHONPATH=/work/main timeout 300 python .scratch/decode_logits.py 8 2>&1 | grep -v "WARN\|owner plan"
  echo "== pre $i"; PYTHONPATH=/work/main/.scratch/pre timeout 300 python .scratch/decode_logits.py 8 2>&1 | grep -v "WARN\|owner plan"
done
for i in 1 2; do
  echo "== tl new $i"; PYTHONPATH=/work/main timeout 200 python docs/gpu-run/step-timeline/timeline_step.py --iters 60 --vocab 128256 --dtype bfloat16 2>&1 | grep -v "WARN\|owner plan" | tail -4
  echo "== tl pre $i"; PYTHONPATH=/work/main/.scratch/pre timeout 200 python docs/gpu-run/step-timeline/timeline_step.py --iters 60 --vocab 128256 --dtype bfloat16 2>&1 | grep -v "WARN\|owner plan" | tail -4
done
