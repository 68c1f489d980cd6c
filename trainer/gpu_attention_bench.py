"""What one layer's attention costs in a captured engine round, per way of calling it, at the reference target's shapes.

Why: on the H200 a captured plain step of SmolLM2-135M spends 0.21 of 1.05 ms in 30 cuDNN attention kernels (7 us
each, for one query row over ~640 cached keys) and a 31-node tree round 0.38 of 1.80 ms (`h200-2026-12-02e`). The
engine hands transformers' "sdpa" attention a boolean mask over the whole static cache, so transformers repeats the
3 K/V heads to 9 (`repeat_kv`: a GQA call with a mask would fall back to the math kernel) and SDPA picks its
kernel. This script times the alternatives the engine could take, each compiled and captured in one CUDA graph of
30 layers (distinct caches, as in the model), replayed back to back:

  * `hf`: `repeat_kv` + SDPA with the boolean mask, the backend SDPA picks (what the engine does now);
  * `hf_efficient`, `hf_cudnn`, `hf_math`: the same with one SDPA backend allowed;
  * `gqa`: SDPA with `enable_gqa=True` and the mask (no repeated K/V);
  * `flex`: `flex_attention` with `enable_gqa=True` and a mask_mod that reads the same boolean mask, one BlockMask
    over the whole cache made once (what a capture-safe flex attention function would do);
  * `window<W>`: `hf` over the first W keys only (what per-length graphs would read);
  * `triton_<mode><BLOCK_N>[w<warps>][s<SPLIT_N>][m<BLOCK_M>][p<STAGES>][e]`, e.g. `triton_scan64`, `triton_skip128w8`,
    `triton_dense128s256m16`:
    the engine's Triton kernel (`hf_carryover/engine/triton_attention.py`, `SpeculativeEngine(attention="triton")`),
    which reads only the keys some query row sees; `s<SPLIT_N>`: the keys in use cut into parts of SPLIT_N walked
    at the same time (no `s`: one program walks them all, as before 2026-12-03c); `dense`: the scan's end, then every
    key block up to it without the per-block branch on the mask (K/V loads issued with the mask's); `m<BLOCK_M>`:
    (query row, head) pairs a program (default: all of a K/V head's, 16 to 64); `p<STAGES>`: Triton's num_stages;
    `e`: each batch row's end of the keys in use handed to the kernel (`key_end`) instead of found by its scan.

Each row records microseconds per layer and the largest difference from a float64 reference.

    python trainer/gpu_attention_bench.py --out $OUT/attention_bench.json
    python trainer/gpu_attention_bench.py --device cpu --keys 128 --queries 1 --variants hf gqa --replays 2  # plumbing
"""

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from evaluate_tau import environment  # noqa: E402

from hf_carryover.engine.graphs import capture_round  # noqa: E402

BACKENDS = {"hf_efficient": "EFFICIENT_ATTENTION", "hf_cudnn": "CUDNN_ATTENTION", "hf_math": "MATH"}


def make_inputs(layers, q_rows, keys, valid, heads, kv_heads, head_dim, dtype, device, seed=0, batch=1):
    """Per-layer queries and caches of `batch` rows, and the round's boolean mask `[batch, 1, q_rows, keys]`: the first
    `valid` keys are committed context; query row i also sees the i+1 keys after them (a causal block, as a linear
    round verifies). Every batch row has the same context length (its own mask rows, as in the engine's rounds)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = [torch.randn(batch, heads, q_rows, head_dim, generator=g).to(device, dtype) for _ in range(layers)]
    k = [torch.randn(batch, kv_heads, keys, head_dim, generator=g).to(device, dtype) for _ in range(layers)]
    v = [torch.randn(batch, kv_heads, keys, head_dim, generator=g).to(device, dtype) for _ in range(layers)]
    col = torch.arange(keys)
    mask = col[None, :] < valid + 1 + torch.arange(q_rows)[:, None]  # [q_rows, keys]
    return q, k, v, mask[None, None].expand(batch, 1, q_rows, keys).contiguous().to(device)


def repeat_kv(x, n):
    """`[b, kvh, L, d]` -> `[b, kvh * n, L, d]`, as transformers' `repeat_kv` (expand, then reshape)."""
    b, kvh, L, d = x.shape
    return x[:, :, None].expand(b, kvh, n, L, d).reshape(b, kvh * n, L, d)


def layer_fn(variant, heads, kv_heads, mask, keys):
    """One layer's attention `(q, k, v) -> [batch, heads, q_rows, head_dim]` for `variant`."""
    rep = heads // kv_heads
    if variant.startswith("triton_"):
        import re

        from hf_carryover.engine.triton_attention import masked_gqa_attention

        mode, block_n, warps, split, block_m, stages, given = re.fullmatch(
            r"triton_(scan|skip|dense)(\d+)(?:w(\d+))?(?:s(\d+))?(?:m(\d+))?(?:p(\d+))?(e)?", variant).groups()
        # `e`: each batch row's end of the keys in use given (what the mask's last row sees), not scanned
        end = mask[:, 0].any(1).int().cumsum(-1).argmax(-1).add(1).int() if given else None  # [batch]
        return lambda q, k, v: masked_gqa_attention(q, k, v, mask, q.shape[-1] ** -0.5, mode, int(block_n),
                                                    int(warps or 4), int(split or 0), block_m=int(block_m or 0),
                                                    num_stages=int(stages or 0),
                                                    key_end=end).transpose(1, 2)  # [b, h, q, d]
    if variant.startswith("window"):
        w = int(variant[len("window"):])
        m = mask[..., :w]
        return lambda q, k, v: F.scaled_dot_product_attention(q, repeat_kv(k[:, :, :w], rep),
                                                              repeat_kv(v[:, :, :w], rep), attn_mask=m)
    if variant.startswith("hf"):
        return lambda q, k, v: F.scaled_dot_product_attention(q, repeat_kv(k, rep), repeat_kv(v, rep), attn_mask=mask)
    if variant == "gqa":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    if variant == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        m3 = mask[:, 0]  # [batch, q_rows, keys]

        def mask_mod(b, h, qi, kv):
            return m3[b, qi, kv]

        block_mask = create_block_mask(mask_mod, mask.shape[0], 1, mask.shape[2], keys, device=mask.device)
        return lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    raise ValueError(f"unknown variant {variant!r}")


def reference(q, k, v, mask, heads, kv_heads):
    """float64 attention of one layer, for the error column."""
    rep = heads // kv_heads
    k, v = repeat_kv(k.double(), rep), repeat_kv(v.double(), rep)
    s = (q.double() @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return s.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def time_variant(variant, args, q_rows, keys, valid, device, dtype, batch=1):
    """Microseconds per layer of `variant`, compiled and (on CUDA) captured with all layers in one graph; `valid`
    committed keys in the mask; `batch` rows."""
    q, k, v, mask = make_inputs(args.layers, q_rows, keys, valid, args.heads, args.kv_heads, args.head_dim, dtype,
                                device, batch=batch)
    fn = layer_fn(variant, args.heads, args.kv_heads, mask, keys)

    def all_layers():
        return [fn(q[i], k[i], v[i]) for i in range(args.layers)]

    torch._dynamo.reset()
    backend = BACKENDS.get(variant)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([getattr(SDPBackend, backend)]) if backend else contextlib.nullcontext():
        run = torch.compile(all_layers, fullgraph=True) if args.compile else all_layers
        outs = run()  # compiles under the backend restriction
        err = max((o.double() - reference(q[i], k[i], v[i], mask, args.heads, args.kv_heads)).abs().max().item()
                  for i, o in enumerate(outs))
        # the engine's capture: warm-up on a side stream, then record (nothing to restore: inputs are read only)
        step = capture_round(run, [], warmup=2).replay if device.type == "cuda" else run
        step()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        for _ in range(args.replays):
            step()
        sync()
    us = 1e6 * (time.perf_counter() - t) / args.replays / args.layers
    return {"variant": variant, "batch": batch, "q_rows": q_rows, "keys": keys, "valid": valid,
            "us_per_layer": round(us, 3), "max_abs_err": err}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--variants", nargs="+",
                   default=["hf", "hf_efficient", "hf_cudnn", "hf_math", "gqa", "flex", "window256", "window384"])
    p.add_argument("--queries", type=int, nargs="+", default=[1, 16, 47], help="query rows per round")
    p.add_argument("--keys", type=int, nargs="+", default=[640, 1024], help="static cache length (max_len)")
    p.add_argument("--valid", type=int, nargs="+", default=[200], help="committed context lengths in the mask")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="batch rows (a batch-8 tree round: --batch 8 "
                   "--queries 32)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv_heads", type=int, default=3)
    p.add_argument("--head_dim", type=int, default=64)
    p.add_argument("--replays", type=int, default=300)
    p.add_argument("--no_compile", dest="compile", action="store_false")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    result = {"command": " ".join(["trainer/gpu_attention_bench.py", *(argv if argv is not None else sys.argv[1:])]),
              "env": environment(), "args": vars(args), "rows": []}
    cases = [(b, keys, q_rows, min(v, keys - q_rows - 1)) for b in args.batch for keys in args.keys
             for v in args.valid for q_rows in args.queries]
    for b, keys, q_rows, valid in dict.fromkeys(cases):  # a valid length cut to the cache may repeat: once
        for variant in args.variants:
            if variant.startswith("window") and not valid + q_rows + 1 <= int(variant[len("window"):]) < keys:
                continue  # a window must hold every key the mask lets through, and be shorter than the cache
            try:
                row = time_variant(variant, args, q_rows, keys, valid, device, dtype, batch=b)
            except Exception as e:  # a backend that refuses these shapes is a result too
                row = {"variant": variant, "batch": b, "q_rows": q_rows, "keys": keys, "valid": valid,
                       "error": f"{type(e).__name__}: {e}"[:300]}
            print(json.dumps(row), flush=True)
            result["rows"].append(row)
            if args.out:
                Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
