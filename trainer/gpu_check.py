"""GPU preflight on a SmolLM2-shaped *random* target (no weights needed): exactness, flex==dense, step times.

    python trainer/gpu_check.py --out $OUT/gpu_check.json

Checks, each written to the JSON as soon as it is known:
  * fp32 greedy `generate(assistant_model=drafter)` == plain greedy on CUDA (dflash/markov, carryover on);
  * the drafter's FlexAttention path gives the same hidden states as the dense-mask SDPA path;
  * seconds per training step of stage 1 and stage 2 (bf16 autocast) at the reference config's batch.
"""

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hf_carryover import Drafter
from hf_carryover.training.objectives import draft_blocks, sample_anchors, stage1_loss, stage2_loss, target_pass


def smollm2_shaped(dtype, device="cuda", **overrides):
    """A random Llama with SmolLM2-135M's shapes (seeded: the same weights every call); `overrides` change config
    fields (trainer/gpu_engine_check.py shrinks it for a CPU smoke test)."""
    kw = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
              num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
              tie_word_embeddings=True, rope_theta=100000.0, eos_token_id=2, bos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**kw, **overrides})).to(device, dtype).eval()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    res = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}

    def dump():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)

    target = smollm2_shaped(torch.float32)
    ids = torch.randint(3, 49000, (1, 40), device="cuda")
    ref = target.generate(ids, max_new_tokens=64, do_sample=False)
    for typ in ("dflash", "markov"):
        d = Drafter.from_target(target, drafter_type=typ, carryover=True, num_hidden_layers=3, mask_token_id=16).cuda()
        out = target.generate(ids, assistant_model=d, max_new_tokens=64, do_sample=False)
        res[f"exact_fp32_{typ}"] = bool(torch.equal(out, ref))
    dump()

    target = smollm2_shaped(torch.bfloat16)
    L, b = 600, 8
    batch = {"input_ids": torch.randint(3, 49000, (b, L), device="cuda"),
             "prompt_len": torch.full((b,), 100, device="cuda"), "seq_len": torch.full((b,), L, device="cuda")}
    d = Drafter.from_target(target, drafter_type="dflash", carryover=True, num_hidden_layers=3, mask_token_id=16)
    d = d.float().cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        valid = torch.ones(b, L, dtype=torch.bool, device="cuda")
        feats, _ = target_pass(target, d, batch["input_ids"], valid, False)
        anchors, _ = sample_anchors(batch["prompt_len"], batch["seq_len"], 64)
        h_dense = draft_blocks(d, d, batch["input_ids"], feats, valid, anchors, backend="sdpa")
        try:
            h_flex = draft_blocks(d, d, batch["input_ids"], feats, valid, anchors, backend="flex")
            res["flex_vs_dense_max_abs_diff"] = float((h_flex.float() - h_dense.float()).abs().max())
            res["dense_max_abs"] = float(h_dense.float().abs().max())
        except Exception as e:  # report, do not die: dense SDPA is the fallback
            res["flex_error"] = repr(e)[:500]
    dump()

    opt = torch.optim.AdamW(d.parameters(), lr=1e-4)
    for name, fn, anchors_n in (("stage1", stage1_loss, 256), ("stage2", stage2_loss, 128)):
        for backend in ("sdpa", "flex"):
            if backend == "flex" and "flex_error" in res:
                continue
            times = []
            for step in range(args.steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss, m = fn(d, d, target, batch, num_anchors=anchors_n, backend=backend)
                loss.backward()
                opt.step()
                opt.zero_grad()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            res[f"{name}_{backend}_s_per_step"] = sorted(times)[len(times) // 2]
            res[f"{name}_{backend}_peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
            dump()
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
