#!/usr/bin/env bash
# bench_actors on the GPU box (its 16 cores, no lanes' compute): the code at $BASE (a copy of
# an earlier cpkv/ package, e.g. `git worktree add` then copy its cpkv/ under a carried,
# git-ignored folder) and this tree, alternating, $PAIRS pairs. Outputs go to $OUT/actors.txt.
set -uo pipefail
. "$(dirname "$0")/_gpu_env.sh"
nproc > "$OUT/nproc.txt"
for i in $(seq "${PAIRS:-3}"); do
  for v in ${BASE:+base} now; do
    if [ "$v" = base ]; then pp=/tmp/site:$BASE; else pp=/tmp/site:$PWD; fi
    echo "== $v run $i" >> "$OUT/actors.txt"
    PYTHONPATH=$pp timeout 120 python3 benchmarks/bench_actors.py --iters 300 2>&1 \
      | grep -v "core_worker.cc\|repeated [0-9]*x\|^\s*$" | tail -7 >> "$OUT/actors.txt"
  done
done
cat "$OUT/actors.txt"
