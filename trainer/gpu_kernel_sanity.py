"""GPU sanity of the round kernels (vocab_topk, skinny_mm) on bf16/fp32 inputs: exact ranks, log-probabilities, GEMM error."""
import json, torch
from hf_carryover.engine.vocab_topk import vocab_topk
from hf_carryover.engine.skinny_gemm import skinny_mm, settings
torch.manual_seed(0)
res = {}
x = (torch.randn(2, 15, 49152, device="cuda") * 3).to(torch.bfloat16)
v, i = vocab_topk(x, 8)
order = torch.sort(-x.float(), dim=-1, stable=True).indices[..., :8]
res["topk_ids_exact"] = bool(torch.equal(i, order))
res["topk_val_err"] = (v.double() - x.double().log_softmax(-1).gather(-1, i)).abs().max().item()
tv, ti = x.float().log_softmax(-1).topk(8, -1)
res["topk_ids_vs_torch"] = (ti == i).float().mean().item()
for m, n, k in ((32, 960, 576), (16, 576, 2880), (8, 576, 1536)):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16); w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    y = skinny_mm(a, w, *settings(m, k)); ref = a.float() @ w.float().T
    res[f"skinny_{m}x{n}x{k}_rel"] = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    a32, w32 = a.float(), w.float()
    y32 = skinny_mm(a32, w32, *settings(m, k)); ref64 = a32.double() @ w32.double().T
    res[f"skinny32_{m}x{n}x{k}_err_over_bound"] = ((y32.double() - ref64).abs() / (k * 2**-24 * (a32.double().abs() @ w32.double().abs().T))).max().item()
print(json.dumps(res))
