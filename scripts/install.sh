#!/usr/bin/env bash
# Install cpkv and its test tools into the current Python, never pulling a
# multi-GB CUDA torch onto a machine without a GPU.
#   CPKV_TORCH_INDEX=<index URL> scripts/install.sh   # torch from that index instead
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
if ! "$py" -c 'import torch' 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "$py" -m pip install -q torch
    elif [ -n "${CPKV_TORCH_INDEX:-}" ]; then
        "$py" -m pip install -q torch --index-url "$CPKV_TORCH_INDEX"
    else
        # The CPU build by its local version (pip finds it on disk where a wheel folder holds
        # it), else from PyTorch's CPU index: a bare `torch` from PyPI is the CUDA build.
        "$py" -m pip install -q "torch==2.13.0+cpu" ||
            "$py" -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
    fi
fi
"$py" -m pip install -q -e ".[test,bench,dev]"
