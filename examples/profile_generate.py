"""Where a `generate(assistant_model=drafter)` round spends its time, against plain decoding (reference target).

Why: through `generate()` a round costs one target verification of k+1 rows plus one drafter call, and pays
only if τ tokens come out of it faster than τ plain decoding steps. On a small CPU both costs are far from
"one decode step", and this prints them:
  * per target forward, by kind (prefill, 1-row decode, multi-row verification) and per drafter round;
  * a target forward over n new rows on a 200-token cache, for n = 1..16 (what a verification of n-1
    proposals costs; BLAS kernels are not monotone in n at these sizes);
  * the target's LM head alone over n rows (the drafter uses it for every proposal row).

    python examples/profile_generate.py --num_assistant_tokens 15 4 --out profile.json
    python examples/profile_generate.py --device cuda --lookup 15 --out profile_gpu.json   # bf16 on a GPU

On a GPU every timed section is bracketed by synchronisations, so the split is of wall time (what batch-1 decoding
pays); the split itself costs a few syncs per round. "other" is transformers' own assisted-decoding loop.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import defaultdict

import torch


def _median_ms(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return 1000 * sorted(ts)[len(ts) // 2]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default="model_cards/smollm2-135m-instruct-dflash-carryover")
    p.add_argument("--prompt", default="Write a short Python function that checks whether a number is prime.")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--num_assistant_tokens", type=int, nargs="+", default=[15, 4])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 5, 8, 9, 12, 16])
    p.add_argument("--lookup", type=int, help="also profile each setting with prompt_lookup_num_tokens=N")
    p.add_argument("--device", default="cpu", help="cpu (fp32) or cuda (bf16)")
    p.add_argument("--out")
    args = p.parse_args()

    import hf_carryover  # noqa: F401  (installs the generate() hook)
    from transformers import AutoModel, DynamicCache

    from hf_carryover.reference import reference_target

    torch.manual_seed(0)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target, tok = reference_target(dtype=dtype)
    target.to(dev)
    drafter = AutoModel.from_pretrained(args.drafter, trust_remote_code=True, dtype=dtype).to(dev)
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                  return_tensors="pt")
    ids = (ids if torch.is_tensor(ids) else ids["input_ids"]).to(dev)

    def now():  # wall time, after the device has caught up
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter()

    spent, calls = defaultdict(float), defaultdict(int)
    forward = target.forward

    def timed_forward(*a, **k):  # classify each target forward by its number of new rows
        t = now()
        out = forward(*a, **k)
        x = k.get("input_ids") if k.get("input_ids") is not None else a[0]
        first = not any(c for key, c in calls.items() if key.startswith("target"))
        kind = "target_prefill" if first else "target_decode_1row" if x.shape[1] == 1 else "target_verify"
        spent[kind] += now() - t
        calls[kind] += 1
        return out

    target.forward = timed_forward
    for mod in list(sys.modules.values()):  # the package's and the remote-code copy's generator classes
        cls = getattr(mod, "CarryoverCandidateGenerator", None)
        if isinstance(cls, type) and not getattr(cls, "_profiled", False):
            def timed(self, *a, _orig=cls.get_candidates, **k):
                t = now()
                out = _orig(self, *a, **k)
                spent["drafter_round"] += now() - t
                calls["drafter_round"] += 1
                return out
            cls.get_candidates, cls._profiled = timed, True

    runs = []
    settings = [("plain", {})] + [(f"speculative k={k}", {"assistant_model": drafter, "num_assistant_tokens": k})
                                  for k in args.num_assistant_tokens]
    if args.lookup:
        settings += [(f"{name} lookup={args.lookup}", {**kw, "prompt_lookup_num_tokens": args.lookup})
                     for name, kw in settings[1:]]
    for label, kw in settings:
        for rep in range(2):  # the first pass warms up; the second is reported
            spent.clear()
            calls.clear()
            t = now()
            out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                  do_sample=False, **kw)
            total = now() - t
        row = {"run": label, "seconds": total, "new_tokens": out.shape[1] - ids.shape[1],
               "ms_per_call": {k: 1000 * v / calls[k] for k, v in spent.items()}, "calls": dict(calls),
               "other_seconds": total - sum(spent.values())}
        if kw:
            row["tau"] = drafter.last_candidate_generator.tau
        runs.append(row)
        print(json.dumps(row), flush=True)
    target.forward = forward

    ctx = torch.randint(100, 40000, (1, 200), device=dev)
    verify_ms = {}
    with torch.no_grad():
        for n in args.rows:
            def one(n=n):
                cache = DynamicCache()
                target(input_ids=ctx, past_key_values=cache, use_cache=True)
                x = torch.randint(100, 40000, (1, n), device=dev)
                t = now()
                target(input_ids=x, past_key_values=cache, use_cache=True, output_hidden_states=True)
                return now() - t
            verify_ms[n] = 1000 * sorted(one() for _ in range(7))[3]
        head = target.get_output_embeddings()
        head_ms = {n: _median_ms(lambda n=n: (head(torch.randn(n, head.weight.shape[1], device=dev, dtype=dtype)),
                                              now()), 15) for n in args.rows}
    summary = {"command": " ".join(["python"] + sys.argv), "torch": torch.__version__, "device": str(dev),
               "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
               "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
               "runs": runs, "target_forward_ms_by_new_rows": verify_ms, "lm_head_ms_by_rows": head_ms}
    print(json.dumps({"target_forward_ms_by_new_rows": verify_ms, "lm_head_ms_by_rows": head_ms}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
