#!/usr/bin/env bash
# GPU, one call: py-spy (carried as a wheel in .whl) samples the client, the coordinator and
# the lane while greedy 16-token prefills loop through the client's graph (cp=1, tiny model
# on the GPU), once without and once with native frames. Carry .whl.
set -u
. scripts/_gpu_env.sh
chmod +x /tmp/site/bin/py-spy 2>/dev/null
prof() {  # tag extra-py-spy-flags...
  local tag=$1; shift
  python3 docs/gpu-run/steps-greedy/prof_steps.py 1 40 > "$OUT/loop-$tag.txt" 2>&1 &
  local loop=$!
  for _ in $(seq 120); do grep -q READY "$OUT/loop-$tag.txt" && break; sleep 1; done
  local cpid lpid
  cpid=$(pgrep -f "ray::CoordinatorActor" | head -1); lpid=$(pgrep -f "ray::_Lane" | head -1)
  for who in client:$loop coordinator:$cpid lane:$lpid; do
    timeout 40 py-spy record -p "${who#*:}" -d 15 -r 400 --format raw --threads "$@" \
      -o "$OUT/$tag-${who%%:*}.raw" > /dev/null 2>&1 &
  done
  wait
}
prof plain --nonblocking
[ "${NATIVE:-1}" = 1 ] && prof native --native
tail -2 "$OUT"/loop-*.txt; ls -la "$OUT"
