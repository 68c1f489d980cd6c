"""The tree round's Triton kernels on the GPU, before a timing trusts them (`h100-2026-12-06c`): `vocab_topk` on random
bf16 logits against an exact ranking (a stable sort of the logits) and float64 log-softmax, and how often torch's topk
picks the same tokens; `skinny_mm` in bf16 against a float32 product, and in fp32 against float32's worst-case
rounding bound; `fused_linear` (norm, SiLU * up and residual folded in) against the eager modules' computation;
`silu_mul_mm` (the gated MLPs' down projection, `gated_mlp.py`) the same way against SiLU(gate) * up
rounded to the inputs' dtype, as a separate kernel stores it. A case that fails records its error and the rest still
run (a Triton kernel can compile on the interpreter and not on the card). Prints one JSON line, with the commit, GPU
and versions (`env`).

    python trainer/gpu_kernel_sanity.py > sanity.json
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from evaluate_tau import environment  # noqa: E402
from fused_linear_bench import SHAPES  # noqa: E402

from hf_carryover.engine.fused_linear import fused_linear  # noqa: E402
from hf_carryover.engine.fused_linear import reference as fused_reference  # noqa: E402
from hf_carryover.engine.fused_linear import settings as fused_settings  # noqa: E402
from hf_carryover.engine.skinny_gemm import settings, silu_mul_mm, skinny_mm  # noqa: E402
from hf_carryover.engine.vocab_topk import vocab_topk  # noqa: E402

torch.manual_seed(0)
res = {"env": environment()}  # commit, GPU and versions
x = (torch.randn(2, 15, 49152, device="cuda") * 3).to(torch.bfloat16)
v, i = vocab_topk(x, 8)
order = torch.sort(-x.float(), dim=-1, stable=True).indices[..., :8]
res["topk_ids_exact"] = bool(torch.equal(i, order))
res["topk_val_err"] = (v.double() - x.double().log_softmax(-1).gather(-1, i)).abs().max().item()
_, torch_ids = x.float().log_softmax(-1).topk(8, -1)
res["topk_ids_vs_torch"] = (torch_ids == i).float().mean().item()


def case(name, fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - recorded, the next case runs
        res[name + "_error"] = f"{type(e).__name__}: {str(e)[:300]}"


def skinny(m, n, k):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    y, ref = skinny_mm(a, w, *settings(m, k)), a.float() @ w.float().T
    res[f"skinny_{m}x{n}x{k}_rel"] = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    a32, w32 = a.float(), w.float()
    y32, ref64 = skinny_mm(a32, w32, *settings(m, k)), a32.double() @ w32.double().T
    bound = k * 2 ** -24 * (a32.double().abs() @ w32.double().abs().T)
    res[f"skinny32_{m}x{n}x{k}_err_over_bound"] = ((y32.double() - ref64).abs() / bound).max().item()


def gated(m, n, k):
    gate_up = torch.randn(m, 2 * k, device="cuda", dtype=torch.bfloat16)
    gate, up = gate_up[:, :k], gate_up[:, k:]  # the two halves of a merged gate/up GEMM's output, strided
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    prod = (torch.nn.functional.silu(gate.float()) * up.float()).to(torch.bfloat16)
    y, ref = silu_mul_mm(gate, up, w, *settings(m, k)), prod.float() @ w.float().T
    res[f"silu_mul_{m}x{n}x{k}_rel"] = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    g32, u32, w32 = gate.float(), up.float(), w.float()
    prod32 = torch.nn.functional.silu(g32) * u32
    y32, ref64 = silu_mul_mm(g32, u32, w32, *settings(m, k)), prod32.double() @ w32.double().T
    bound = (k + 4) * 2 ** -24 * (prod32.double().abs() @ w32.double().abs().T)  # + the product's own roundings
    res[f"silu_mul32_{m}x{n}x{k}_err_over_bound"] = ((y32.double() - ref64).abs() / bound).max().item()


for m, n, k in ((32, 960, 576), (16, 576, 2880), (8, 576, 1536), (32, 576, 1536), (64, 576, 1536)):
    case(f"skinny_{m}x{n}x{k}", lambda: skinny(m, n, k))
# the reference target's and drafter's down projections (32 and 16 rows), and the most rows skinny_rows allows
for m, n, k in ((32, 576, 1536), (16, 576, 1536), (64, 576, 1536)):
    case(f"silu_mul_{m}x{n}x{k}", lambda: gated(m, n, k))


def folded(m, n, k, norm, glu, resid):
    """`fused_linear` against the eager modules' computation (`fused_linear.reference`): bf16 against bf16 eager
    (relative to the output's largest value), fp32 against float64 (relative error; the norm itself is float32)."""
    for dtype, tag in ((torch.bfloat16, ""), (torch.float32, "32")):
        x = torch.randn(m, k, device="cuda").to(dtype)
        w = (torch.randn(2 * n if glu else n, k, device="cuda") / k ** 0.5).to(dtype)
        nw = (1 + 0.1 * torch.randn(k, device="cuda")).to(dtype) if norm else None
        r = torch.randn(m, n, device="cuda").to(dtype) if resid else None
        y = fused_linear(x, w, nw, 1e-5, r, glu, *fused_settings(m, n, k, glu))
        if dtype == torch.bfloat16:
            ref = fused_reference(x, w, nw, 1e-5, r, glu).float()
        else:
            ref = fused_reference(x.double(), w.double(), None if nw is None else nw.double(), 1e-5,
                                  None if r is None else r.double(), glu)
        res[f"folded{tag}_{m}x{n}x{k}{'_norm' * norm}{'_glu' * glu}{'_resid' * resid}_rel"] = (
            (y.to(ref.dtype) - ref).abs().max() / ref.abs().max()).item()


# the reference target's q/k/v (norm), o (residual), gate/up (norm, SiLU * up), down (residual) and vocabulary head
# (norm), as `examples/fused_linear_bench.py` times them, at a plain step's 1 row, batch 8's 8 and a tree verify's 32
for m in (1, 8, 32):
    for _, n, k, norm, glu, resid in SHAPES:
        case(f"folded_{m}x{n}x{k}", lambda: folded(m, n, k, norm, glu, resid))
# New cases go last: every case draws its inputs from the one generator, so a case run before an older one changes
# that one's inputs and its figures can no longer be compared with an earlier run's (h100-2026-12-07b: cases of a
# since removed option, then interleaved, moved the 8- and 32-row exact cases' inputs).
print(json.dumps(res))
