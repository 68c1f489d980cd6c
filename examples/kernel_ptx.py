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

By default the variants are compiled with no assumption about their arguments, which is what the digests of
`h100-2026-12-07d/cpu/` used. `--as_launched` compiles them as Triton's launcher specialises a call on contiguous,
16-byte-aligned tensors of the reference target's shapes (unit strides as the constant 1, pointers and the other
sizes and strides marked divisible by 16): the vectorised loads and asynchronous copies that run on the GPU, so its
PTX is the one to read for what a change costs. `--ops` adds each variant's instruction count by opcode, e.g.

    python examples/kernel_ptx.py --as_launched --ops --out ptx_ops.json
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
UNIT = ("sxk", "swk", "srn")  # strides of 1 in a launch on contiguous tensors (Triton makes them constants)
KERNELS = {  # name -> (its runtime integer arguments, the constants a call fixes besides the folds)
    "one_row": (("N", "sxk", "swn", "swk", "srn"), dict(K=576, KP=1024, BLOCK_N=4)),
    "rows": (("M", "N", "sxm", "sxk", "swn", "swk", "srm", "srn", "sym"),
             dict(K=576, BLOCK_M=32, BLOCK_N=16, BLOCK_K=256, STAGES=3))}


def code_only(ptx: str) -> str:
    """PTX without what names the source: the `.debug` sections and the `.loc`/`.file` lines."""
    ptx = re.split(r"\.section\s+\.debug", ptx)[0]
    return "\n".join(line for line in ptx.splitlines() if not line.strip().startswith((".loc", ".file")))


def opcodes(ptx: str) -> dict:
    """{opcode: count} of the PTX's instructions (directives, labels and comments left out), most frequent first."""
    ops = re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)[\s;]", code_only(ptx), re.M)
    return dict(sorted(((op, ops.count(op)) for op in set(ops)), key=lambda kv: -kv[1]))


def variants(fl, extra=None, as_launched=False):
    """Yield (key, compiled kernel) for each variant: `fl` the `fused_linear` module, `extra` constexprs to set where
    a kernel has them, `as_launched` the launcher's specialisation (module docstring). Needs Triton's compiler with
    `ASTSource(constexprs=...)` and its CUDA backend, not a GPU."""
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
        if "NORM_K" in kernel.arg_names:  # (since the norm's chunks: the width a launch of these shapes gets)
            constexprs["NORM_K"] = fl.norm_chunk(consts["K"], consts["BLOCK_K"])
        constexprs.update({k: v for k, v in (extra or {}).items() if k in kernel.arg_names})
        if as_launched:
            constexprs.update({s: 1 for s in UNIT if s in kernel.arg_names})
        signature = {**{a: "*" + dtype for a in PTRS}, **{i: "i32" for i in ints}, "eps": "fp32",
                     **{c: "constexpr" for c in constexprs}}
        signature = {a: signature[a] for a in kernel.arg_names}  # the kernel's argument order
        attrs = {}
        if as_launched:  # every pointer, and every size or stride left (960, 576, 32, ...), is a multiple of 16
            attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a, t in signature.items()
                     if t.startswith("*") or (t == "i32")}
        key = f"{name}_{dtype}_" + "".join("NGR"[i] if f else "-" for i, f in enumerate(folds))
        yield key, compiler.compile(compiler.ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs),
                                    target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", nargs="*", default=[], help="NAME=INT: a constexpr the kernel has and the default lacks")
    p.add_argument("--as_launched", action="store_true", help="compile as a launch on contiguous tensors is")
    p.add_argument("--ops", action="store_true", help="also record each variant's instruction count by opcode")
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
              "set": extra, "as_launched": args.as_launched, "kernels": {}}
    print(f"kernels of {src} at {commit[:7]}{' (modified)' * bool(dirty)}", flush=True)
    for key, binary in variants(fl, extra, args.as_launched):
        code = code_only(binary.asm["ptx"])
        row = record["kernels"][key] = {"sha256": hashlib.sha256(code.encode()).hexdigest(),
                                        "lines": len(code.splitlines())}
        if args.ops:
            row["ops"] = opcodes(binary.asm["ptx"])
            row["instructions"] = sum(row["ops"].values())
        print(key, row["sha256"][:16], row["lines"], *(["instructions", row["instructions"]] if args.ops else []),
              flush=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
