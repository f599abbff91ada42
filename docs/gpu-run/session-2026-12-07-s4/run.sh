#!/usr/bin/env bash
# GPU call 1 (~7 min): the step's fixed cost at a long job's steady state (bench_steps after
# 300 logits prefills) and the cp=4 logits step's timeline (issue 22 item 2); the CUDA tests
# of the lanes' steps and decode graphs. Carry .whl.
set -u
. scripts/_gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$OUT/env.txt" 2>&1
step 170 steps.txt python3 benchmarks/bench_steps.py --cp 1,4 --dispatch graph --iters 100 --model llama-3.2-1b --num-gpus-per-lane 0.25
step 100 timeline-cp4.txt python3 docs/gpu-run/step-timeline/timeline_step.py --iters 100 --model llama-3.2-1b --num-gpus-per-lane 0.25 --cp 4
step 170 tests.txt python3 -m pytest -q -p no:cacheprovider tests/test_decode_graph.py tests/test_cp_attention.py tests/test_lane_model.py -k "not lanes_match_single_device and not group_rebuilt and not generate and not greedy_prefill"
cat "$OUT/env.txt"; grep -h -A3 "^cp  dispatch" "$OUT/steps.txt"; tail -2 "$OUT/steps.txt"
grep -v "CoordinatorActor\|WARNING" "$OUT/timeline-cp4.txt"; tail -3 "$OUT/tests.txt"
