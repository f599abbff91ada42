"""Compile the TMA attention kernel for sm_90a on a machine with no GPU, and say what came out.

Triton compiles for a target it is told (no device needed); ptxas, cuobjdump and nvdisasm ship
inside Triton's NVIDIA backend. Prints the shared memory, the registers and stack a thread
takes, and the SASS counts that tell the kernel's structure: HGMMA (tensor-core MMAs),
MUFU.EX2 (exponentials), USETMAXREG (register moves between the warpgroups of a
warp-specialised kernel). Or the compiler's failure.

    python docs/gpu-run/hopper-attention/9-halves-ws/compile_sm90.py 64 64 64 4 2 \
        PAIR_TILES=True

Arguments: head dim, block_m, block_n, warps, stages, then NAME=VALUE for any other
constexpr of the kernel (True/False/ints; a name the kernel lacks is refused: ``HALVES``
belonged to the halves variant, ``halves.patch`` beside this script). ``SASS_OUT=path`` in
the environment writes the disassembly there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import cpkv.kernels.paged_attention_tma as tma


def main() -> None:
    d, bm, bn, warps, stages = (int(a) for a in sys.argv[1:6])
    fn = tma._paged_attention_tma_kernel
    types = {
        "q_ptr": "*bf16", "q_desc": f"tensordesc<bf16[{bm // 2},{d}]>", "q_pos_ptr": "*i64",
        "cu_q_ptr": "*i32", "k_desc": f"tensordesc<bf16[{bn},{d}]>",
        "v_desc": f"tensordesc<bf16[{bn},{d}]>", "page_table_ptr": "*i32",
        "page_pos_ptr": "*i64", "page_len_ptr": "*i32", "cu_pages_ptr": "*i32",
        "block_seq_ptr": "*i32", "cu_blocks_ptr": "*i64", "out_ptr": "*bf16",
        "lse_ptr": "*fp32", "qk_scale": "fp32", "n_seqs": "i32", "stride_qt": "i32",
        "stride_qh": "i32",
    }  # fmt: skip
    consts: dict[str, object] = dict(
        N_HEADS=32, GROUP=4, PAGE_SIZE=max(64, bn), HEAD_DIM=d, HP=1, BLOCK_M=bm, BLOCK_N=bn,
        SCAN=32, WARP_SPECIALIZE=False, HEADS_FIRST=False, PAIR_TILES=False, UPCAST=False,
        HALVES=False, EXP_POLY=0, LAZY_RESCALE=False,
    )  # fmt: skip
    for arg in sys.argv[6:]:
        name, value = arg.split("=")
        if name not in fn.arg_names:
            sys.exit(f"{name} is not an argument of this kernel: {', '.join(fn.arg_names)}")
        consts[name] = int(value) if value.isdigit() else value == "True"
    # Defaults of experiments' variants (HALVES, EXP_POLY, ...) the kernel may not have.
    consts = {k: v for k, v in consts.items() if k in fn.arg_names}
    sig = {a: ("constexpr" if a in consts else types[a]) for a in fn.arg_names}
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    try:
        k = triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages)
        )
    except Exception as exc:
        print(f"compile failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}")
        sys.exit(1)
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([f"{tools}/cuobjdump", "-res-usage", f.name], capture_output=True)
        sass = subprocess.run([f"{tools}/nvdisasm", "-c", f.name], capture_output=True).stdout
    if os.environ.get("SASS_OUT"):  # the whole disassembly, to read
        with open(os.environ["SASS_OUT"], "wb") as out:
            out.write(sass)
    usage = re.search(rb"REG:(\d+) STACK:(\d+)", res.stdout)
    ops = Counter(re.findall(rb"\b(HGMMA|MUFU\.EX2|USETMAXREG)\b", sass))
    print(
        f"shared {k.metadata.shared} B, warps {k.metadata.num_warps}, "
        f"registers {usage[1].decode()}, stack {usage[2].decode()} B; SASS: "
        + ", ".join(f"{n.decode()} {c}" for n, c in sorted(ops.items()))
    )


if __name__ == "__main__":
    main()
