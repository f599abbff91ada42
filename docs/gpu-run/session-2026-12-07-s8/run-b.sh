#!/usr/bin/env bash
# Call B (eighth session, carry .whl): the CUDA side of the seventh session's IPC fixes, run
# on a GPU for the first time: one CUDA IPC share per peer at three lanes (spawned lanes on one
# GPU; exchanges that regrow their slots and a group rebuilt on the same processes), CP
# attention over cuda_ipc at 2-4 lanes against one device, the kernels' CUDA tests, the clock.
set -u
. scripts/_gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; } > "$OUT/env.txt" 2>&1
step 150 exchange.txt python3 -m pytest -q -p no:cacheprovider tests/test_device_exchange.py
step 200 cp-attention.txt python3 -m pytest -q -p no:cacheprovider tests/test_cp_attention.py
step 150 kernels.txt python3 -m pytest -q -p no:cacheprovider tests/test_attention_kernels.py tests/test_decode_kernel.py tests/test_clock.py -x
cat "$OUT/env.txt"; for f in exchange cp-attention kernels; do echo "$f: $(tail -2 "$OUT/$f.txt" | tr '\n' ' ')"; done
