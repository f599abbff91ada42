#!/usr/bin/env bash
# Install cpkv and its test tools into the current Python, never pulling a
# multi-GB CUDA torch onto a machine without a GPU.
#   CPKV_TORCH_INDEX=<index URL> scripts/install.sh   # torch from that index instead
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
# The torch pyproject.toml asks for ("torch>=X.Y"): an older one installed would be upgraded by
# the `pip install -e .` below from PyPI, i.e. to the CUDA build. Compared by hand: `packaging`
# may be absent. The installs below ask for that range too: a bare `torch` is satisfied by
# the old one and upgrades nothing.
torch_min=$(sed -n 's/^ *"torch>=\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' pyproject.toml | head -n 1)
torch_ok() {
    "$py" - "${torch_min:-0.0}" <<'PY' 2>/dev/null
import re
import sys

import torch

want = tuple(int(x) for x in sys.argv[1].split("."))
have = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
sys.exit(0 if have >= want else 1)
PY
}
if ! torch_ok; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "$py" -m pip install -q "torch>=${torch_min:-0}"
    elif [ -n "${CPKV_TORCH_INDEX:-}" ]; then
        "$py" -m pip install -q "torch>=${torch_min:-0}" --index-url "$CPKV_TORCH_INDEX"
    else
        # The CPU build by its local version (pip finds it on disk where a wheel folder holds
        # it), else from PyTorch's CPU index: a bare `torch` from PyPI is the CUDA build.
        "$py" -m pip install -q "torch==2.13.0+cpu" ||
            "$py" -m pip install -q "torch>=${torch_min:-0}" \
                --index-url https://download.pytorch.org/whl/cpu
    fi
fi
"$py" -m pip install -q -e ".[test,bench,dev]"
