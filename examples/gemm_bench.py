"""cuBLAS against `hf_carryover.engine.skinny_gemm` at the reference target's projection shapes, inside CUDA graphs.

Why: in a tree round of 32 verified rows the target's 121 GEMMs took 0.50 of 1.05 ms on an H100
(`h100-2026-12-06c`), 3.7-4.2 us each, where the bytes they read would take well under 1 us. Whether a kernel that
gives each program a narrow column slice for all rows beats cuBLAS there is a question for the GPU, per shape and row
count, before the engine uses it.

Each timing is a CUDA graph of `--layers` GEMMs of one shape, every one with its own weight (so the weights stream
from memory as in a forward, not from L2), replayed back to back: per-GEMM time with launch gaps included, as in a
captured round. `chain` rows time the four projections of a layer in order, 30 layers, cuBLAS against each shape's
fastest kernel setting: the estimate of what a round's target forward would save.

    python examples/gemm_bench.py --rows 8 16 32 48 --out gemm_bench.json

The JSON (written after every shape) carries the command, commit, GPU and versions.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# (name, N, K) of the reference target's projections (SmolLM2-135M: hidden 576, 9 + 2 * 3 heads of 64, MLP 1536)
# and the drafter's input projection (5 tapped layers of 576)
# "down_gated": the down projection of SiLU(gate) * up, that input made by eager SiLU and product kernels before
# cuBLAS, against made in the kernel's loads (`silu_mul_mm`, `gated_mlp=True`); gate and up the halves of one tensor
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536), ("fc", 576, 2880),
          ("down_gated", 576, 1536)]


def graph_us(fns, replays: int) -> float:
    """Mean us per function of `fns` (called in order), captured as one CUDA graph and replayed `replays` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # warm up (Triton compiles, cuBLAS picks its kernel) outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - t) / replays / len(fns)


def start_record(args, **fields) -> tuple[dict, Path]:
    """What a kernel bench starts with: a GPU (its timings are CUDA graphs, `graph_us`), seed 0, and the record it
    rewrites at `args.out` after every shape: the command, commit, GPU and versions (`env`), `shapes` and `fields`.
    Returns (record, out path)."""
    script = Path(sys.argv[0]).name
    if not torch.cuda.is_available():
        raise SystemExit(f"{script} times CUDA graphs: it needs a GPU")
    from evaluate_tau import environment

    torch.manual_seed(0)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return {"command": " ".join(sys.argv), "env": environment(), "shapes": {}, **fields}, out


def try_settings(configs, names, measure) -> tuple[list, list]:
    """Each setting of `configs` (tuples, their fields named by `names`) through `measure(*setting) -> (max_err, us)`.
    A setting Triton cannot build is recorded with its error and the rest still run. Returns (every setting tried, as
    dicts; those that ran, fastest first)."""
    tried = []
    for cfg in configs:
        row = dict(zip(names, cfg))
        try:
            err, us = measure(*cfg)
        except Exception as e:  # noqa: BLE001  (a setting Triton cannot build: skip it, keep the rest)
            tried.append({**row, "error": f"{type(e).__name__}: {e}"[:200]})
            continue
        tried.append({**row, "us": us, "max_err": err})
    return tried, sorted((t for t in tried if "us" in t), key=lambda t: t["us"])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", type=int, default=[8, 16, 32, 48])
    p.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES[:5]], choices=[s[0] for s in SHAPES])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--block_n", nargs="+", type=int, default=[16, 32, 64])
    p.add_argument("--block_k", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--warps", nargs="+", type=int, default=[2, 4])
    p.add_argument("--stages", nargs="+", type=int, default=[2, 3, 4])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    record, out = start_record(args, chain={})
    from hf_carryover.engine.skinny_gemm import silu_mul_mm, skinny_mm

    dev, dt = "cuda", torch.bfloat16
    shapes = {name: (n, k) for name, n, k in SHAPES if name in args.shapes}
    weights = {name: [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(args.layers)]
               for name, (n, k) in shapes.items()}
    configs = list(itertools.product(args.block_n, args.block_k, args.warps, args.stages))
    best = {}
    for m in args.rows:
        for name, (n, k) in shapes.items():
            ws = weights[name]
            if name == "down_gated":
                gu = torch.randn(m, 2 * k, device=dev, dtype=dt)
                gate, up = gu[:, :k], gu[:, k:]  # [m, k] each, strided: a merged gate/up GEMM's output

                def lhs():  # what cuBLAS multiplies: the pointwise kernels' output
                    return torch.nn.functional.silu(gate) * up

                def kernel(w, *cfg):
                    return silu_mul_mm(gate, up, w, *cfg)
            else:
                x = torch.randn(m, k, device=dev, dtype=dt)

                def lhs():
                    return x

                def kernel(w, *cfg):
                    return skinny_mm(x, w, *cfg)
            ref = lhs().float() @ ws[0].float().T
            row = {"N": n, "K": k, "M": m,
                   "cublas_linear_us": graph_us([lambda w=w: torch.nn.functional.linear(lhs(), w) for w in ws],
                                                args.replays)}
            wts = [w.T.contiguous() for w in ws]  # [K, N], as inductor's frozen weights feed extern mm
            row["cublas_mm_us"] = graph_us([lambda w=w: torch.mm(lhs(), w) for w in wts], args.replays)
            def measure(*cfg):
                err = (kernel(ws[0], *cfg).float() - ref).abs().max().item()
                return err, graph_us([lambda w=w: kernel(w, *cfg) for w in ws], args.replays)

            tried, ok = try_settings(configs, ("block_n", "block_k", "warps", "stages"), measure)
            row["best"] = ok[0] if ok else None
            row["tried"] = tried
            cublas = min(row["cublas_linear_us"], row["cublas_mm_us"])
            if ok:
                best[(m, name)] = ok[0]
                print(f"M={m} {name} [{n}x{k}]: cuBLAS {cublas:.2f} us, skinny {ok[0]['us']:.2f} us "
                      f"({ok[0]['block_n']}/{ok[0]['block_k']}/{ok[0]['warps']}w/{ok[0]['stages']}s, "
                      f"err {ok[0]['max_err']:.3g})", flush=True)
            record["shapes"][f"{name}@{m}"] = row
            out.write_text(json.dumps(record, indent=1))
        layer = [s for s in ("qkv", "o", "gate_up", "down") if s in shapes]
        if all((m, s) in best for s in layer):  # a layer's projections in order, every layer: cuBLAS vs the best
            xs = {s: torch.randn(m, shapes[s][1], device=dev, dtype=dt) for s in layer}
            wts = {s: [w.T.contiguous() for w in weights[s]] for s in layer}
            cub = [lambda s=s, i=i: torch.mm(xs[s], wts[s][i]) for i in range(args.layers) for s in layer]
            sk = [lambda s=s, i=i, c=best[(m, s)]: skinny_mm(xs[s], weights[s][i], c["block_n"], c["block_k"],
                                                              c["warps"], c["stages"])
                  for i in range(args.layers) for s in layer]
            n_gemm = len(cub)
            c_us, s_us = graph_us(cub, args.replays) * n_gemm, graph_us(sk, args.replays) * n_gemm
            record["chain"][str(m)] = {"gemms": n_gemm, "cublas_us": c_us, "skinny_us": s_us}
            print(f"M={m} chain of {n_gemm} GEMMs: cuBLAS {c_us:.1f} us, skinny {s_us:.1f} us", flush=True)
            out.write_text(json.dumps(record, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
