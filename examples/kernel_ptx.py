"""A digest of the PTX that Triton's compiler makes of `fused_linear`'s kernels for a Hopper GPU, on a CPU machine.

Why: a change to a kernel's source that should not change what runs (removing a compile-time branch, moving a
declaration) can be checked without a GPU: the same PTX, instruction for instruction, runs the same on the machine.
Each variant the CPU test compiles (`tests/test_round_kernels.py::test_fused_linear_kernels_compile_for_hopper`:
every fold in bf16, all folds in float32) is compiled for `GPUTarget("cuda", 90, 32)` and its PTX hashed without
the debug information (`.loc`/`.file` lines and the `.debug` sections, which name the source file's path and lines).
Run it on two commits and compare the files:

    PYTHONPATH=/path/to/old/checkout python examples/kernel_ptx.py --out ptx_old.json
    python examples/kernel_ptx.py --out ptx_new.json

A kernel that still has a compile-time option the other lacks is compiled with that option at its default
(`--set NAME=0`, e.g. `--set LATE_NORM=0` for the tiled kernel before `0c99a46`).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import re
import subprocess
from pathlib import Path

PTRS = ("x_ptr", "nw_ptr", "w_ptr", "r_ptr", "y_ptr")
KERNELS = {  # name -> (its runtime integer arguments, the constants a call fixes besides the folds)
    "one_row": (("N", "sxk", "swn", "swk", "srn"), dict(K=576, KP=1024, BLOCK_N=4)),
    "rows": (("M", "N", "sxm", "sxk", "swn", "swk", "srm", "srn", "sym"),
             dict(K=576, BLOCK_M=32, BLOCK_N=16, BLOCK_K=256, STAGES=3))}


def code_only(ptx: str) -> str:
    """PTX without what names the source: the `.debug` sections and the `.loc`/`.file` lines."""
    ptx = re.split(r"\.section\s+\.debug", ptx)[0]
    return "\n".join(line for line in ptx.splitlines() if not line.strip().startswith((".loc", ".file")))


def variants(fl, extra=None):
    """Yield (key, compiled kernel) for each variant: `fl` the `fused_linear` module, `extra` constexprs to set where
    a kernel has them. Needs Triton's compiler with `ASTSource(constexprs=...)` and its CUDA backend, not a GPU."""
    from triton import compiler
    from triton.backends.compiler import GPUTarget

    for name, dtype, folds in itertools.product(KERNELS, ("bf16", "fp32"), itertools.product((False, True), repeat=3)):
        if dtype == "fp32" and not all(folds):
            continue
        kernel = getattr(fl, f"_{name}_kernel")
        ints, consts = KERNELS[name]
        constexprs = {**consts, **dict(zip(("NORM", "GLU", "RESID"), folds)), "F64": False}
        if name == "rows":  # the tiled kernel's tl.dot: IEEE products for float32
            constexprs["IEEE"] = dtype == "fp32"
        constexprs.update({k: v for k, v in (extra or {}).items() if k in kernel.arg_names})
        signature = {**{a: "*" + dtype for a in PTRS}, **{i: "i32" for i in ints}, "eps": "fp32",
                     **{c: "constexpr" for c in constexprs}}
        signature = {a: signature[a] for a in kernel.arg_names}  # the kernel's argument order
        key = f"{name}_{dtype}_" + "".join("NGR"[i] if f else "-" for i, f in enumerate(folds))
        yield key, compiler.compile(compiler.ASTSource(kernel, signature, constexprs=constexprs),
                                    target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", nargs="*", default=[], help="NAME=INT: a constexpr the kernel has and the default lacks")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import triton

    from hf_carryover.engine import fused_linear as fl

    extra = {k: int(v) for k, v in (s.split("=", 1) for s in args.set)}
    src = Path(fl.__file__).resolve().parent  # the checkout the kernels came from (PYTHONPATH), and its commit
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "."], capture_output=True,
                           text=True).stdout.strip()
    record = {"commit": commit, "kernels_dirty": bool(dirty), "triton": triton.__version__, "target": "cuda sm_90",
              "set": extra, "kernels": {}}
    print(f"kernels of {src} at {commit[:7]}{' (modified)' * bool(dirty)}", flush=True)
    for key, binary in variants(fl, extra):
        code = code_only(binary.asm["ptx"])
        record["kernels"][key] = {"sha256": hashlib.sha256(code.encode()).hexdigest(), "lines": len(code.splitlines())}
        print(key, record["kernels"][key]["sha256"][:16], record["kernels"][key]["lines"], flush=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
