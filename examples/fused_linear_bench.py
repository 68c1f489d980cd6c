"""`hf_carryover.engine.fused_linear` at the reference target's projections, per kernel setting, inside CUDA graphs.

Why: the kernel's settings (`fused_linear.settings`) were guesses; a decoding step is launch- and latency-bound, so
which column width and warp count keep a few-row projection near its fixed cost is a question for the GPU. Each
timing is a CUDA graph of `--layers` calls of one shape, each with its own weight (streamed from memory, as in a
forward), replayed back to back (`gemm_bench.graph_us`): per-call time with launch gaps, as in a captured round.
cuBLAS's bare GEMM of the same shape is timed beside it (`cublas_mm_us`: without the norm, SiLU * up or add).
With --bare each shape is also timed on the kernel with nothing folded (`NAME-bare@M`: the same weight as one plain
GEMM, a merged gate/up's 2N columns), which splits what the folds cost from what the tiled GEMM itself costs: at 8
and 32 rows the folded kernel lost to cuBLAS in whole rounds (`h100-2026-12-06g`, `h100-2026-12-06h`), and in
`h100-2026-12-07` the tiled GEMM alone was near cuBLAS while the norm fold cost 1.0-2.3 us a call. (The late-norm
rows of `h100-2026-12-07c` came from an option since removed: `fused_linear.py`'s docstring.)

    python examples/fused_linear_bench.py --rows 1 8 32 --out fused_linear_bench.json
    python examples/fused_linear_bench.py --rows 16 32 --bare --out fused_linear_bench_rows.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# (name, N, K, norm, glu, residual): a decoder layer's four projections as the engine folds them, and the head
SHAPES = [("qkv", 960, 576, True, False, False), ("o", 576, 576, False, False, True),
          ("gate_up", 1536, 576, True, True, False), ("down", 576, 1536, False, False, True),
          ("head", 49152, 576, True, False, False)]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], choices=[s[0] for s in SHAPES])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--block_n", nargs="+", type=int, default=[4, 8, 16, 32])
    p.add_argument("--block_k", nargs="+", type=int, default=[128, 256])
    p.add_argument("--warps", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--bare", action="store_true", help="also time each shape with nothing folded (NAME-bare@M)")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from gemm_bench import graph_us, start_record, try_settings

    record, out = start_record(args)
    from hf_carryover.engine.fused_linear import fused_linear, reference, settings

    dev, dt = "cuda", torch.bfloat16
    picked = [s for s in SHAPES if s[0] in args.shapes]
    shapes = list(picked)
    if args.bare:  # nothing folded: the same weights as plain GEMMs (a merged gate/up as its 2N columns)
        shapes += [(f"{name}-bare", 2 * n if glu else n, k, False, False, False) for name, n, k, _, glu, _ in picked]
    for m in args.rows:
        for name, n, k, norm, glu, resid in shapes:
            layers = 1 if name.startswith("head") else args.layers  # one head a forward (56 MB of weight)
            ws = [torch.randn(2 * n if glu else n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(layers)]
            x = torch.randn(m, k, device=dev, dtype=dt)
            nw = (1 + 0.1 * torch.randn(k, device=dev)).to(dt) if norm else None
            r = torch.randn(m, n, device=dev, dtype=dt) if resid else None
            ref = reference(x, ws[0], nw, 1e-5, r, glu).float()
            wts = [w.T.contiguous() for w in ws]  # [K, N], as inductor's frozen weights feed extern mm
            row = {"N": n, "K": k, "M": m, "norm": norm, "glu": glu, "residual": resid,
                   "default": settings(m, n, k, glu),
                   "cublas_mm_us": graph_us([lambda w=w: torch.mm(x, w) for w in wts], args.replays)}
            block_ks = [0] if m == 1 else args.block_k  # one row loads K whole

            def measure(bn, bk, nwp):
                y = fused_linear(x, ws[0], nw, 1e-5, r, glu, bn, bk, nwp)
                err = (y.float() - ref).abs().max().item()
                return err, graph_us([lambda w=w: fused_linear(x, w, nw, 1e-5, r, glu, bn, bk, nwp)
                                      for w in ws], args.replays)

            configs = itertools.product(args.block_n, block_ks, args.warps)
            tried, ok = try_settings(configs, ("block_n", "block_k", "warps"), measure)
            row["best"] = ok[0] if ok else None
            row["tried"] = tried
            if ok:
                print(f"M={m} {name} [{n}x{k}]: cuBLAS mm {row['cublas_mm_us']:.2f} us, fused {ok[0]['us']:.2f} us "
                      f"({ok[0]['block_n']}/{ok[0]['block_k']}/{ok[0]['warps']}w, err {ok[0]['max_err']:.3g})",
                      flush=True)
            record["shapes"][f"{name}@{m}"] = row
            out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
