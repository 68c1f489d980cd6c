"""One launch of each form of `fused_linear`'s tiled kernel (and cuBLAS's GEMM of the same weight), for Nsight Compute.

Why: at 32 rows on an H100 the kernel with nothing folded runs at cuBLAS's speed, while the exact norm fold adds
1.5-2.3 us a call (`h100-2026-12-07`, `-07c`); the late norm, which had no pass over x before the products, was slower
still. Timing cannot say which stage costs; a profiler's stall reasons, issue counts and memory traffic per form can.
Each form is launched once to compile and warm up, then once more inside `torch.cuda.profiler` markers, in the order
printed, so that `ncu --profile-from-start off` sees exactly one launch of each:

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section WarpStateStats \
        --section SchedulerStats --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
        python3 examples/fused_linear_ncu.py --rows 32 > ncu.txt

Shapes are the reference target's q/k/v (960 x 576, the norm folded) and gate/up (2 x 1536 x 576, the norm and
SiLU * up folded), at the engine's settings (`fused_linear.settings`), bf16. With `--device cpu` (Triton's
interpreter, float32) it checks that the forms run and agree, nothing more.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fused_linear_bench import SHAPES  # noqa: E402  (the reference target's projections, as the bench times them)

FORMS = ("cublas", "bare", "fold")


def forms(m: int, n: int, k: int, glu: bool, device: str, fused_linear, settings, reference):
    """({form: a callable launching it once}, {form: what it should return}): cuBLAS's mm of the same [K, N']
    weight, the tiled kernel with nothing folded (N' = 2N columns for gate/up), and the kernel with the norm (and
    SiLU * up) folded, as the engine calls it; the expected values are the eager modules' (`fused_linear.reference`).
    """
    g = torch.Generator(device=device).manual_seed(0)
    dt = torch.bfloat16 if device == "cuda" else torch.float32  # (the interpreter does not compute in bf16)
    cols = 2 * n if glu else n
    x = torch.randn(m, k, generator=g, device=device).to(dt)
    w = (torch.randn(cols, k, generator=g, device=device) / k ** 0.5).to(dt)
    wt = w.T.contiguous()  # [K, N'], as inductor's frozen weights feed cuBLAS
    nw = (1 + 0.1 * torch.randn(k, generator=g, device=device)).to(dt)
    launch = {"cublas": lambda: torch.mm(x, wt),
              "bare": lambda: fused_linear(x, w, None, 1e-5, None, False, *settings(m, cols, k, False)),
              "fold": lambda: fused_linear(x, w, nw, 1e-5, None, glu, *settings(m, n, k, glu))}
    plain = reference(x, w)
    return launch, {"cublas": plain, "bare": plain, "fold": reference(x, w, nw, 1e-5, None, glu)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton's import
    from hf_carryover.engine.fused_linear import fused_linear, reference, settings

    shapes = {name: (n, k, glu) for name, n, k, _, glu, _ in SHAPES if name in ("qkv", "gate_up")}  # norm folded
    launches = []
    for name, (n, k, glu) in shapes.items():
        launch, expected = forms(args.rows, n, k, glu, args.device, fused_linear, settings, reference)
        for form in FORMS:
            out = launch[form]().float()  # compiles and warms up; checked against the eager modules' result
            ref = expected[form].float()
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            if err > 2 ** -7:  # one bf16 step of the largest value: another summation order, no more
                raise SystemExit(f"{name}/{form}: relative error {err:.3g} against the eager modules")
            launches.append((f"{name}/{form}", launch[form]))
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    for label, launch in launches:
        launch()
        print(label, flush=True)
    if args.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
