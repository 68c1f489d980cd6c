"""Regenerate training responses with the target:  `python trainer/regenerate.py --prompts P.jsonl --out data/train`.

Input: `{"id", "input_ids"}` lines (chat template applied; `trainer/prepare_prompts.py` writes them). Output:
resumable response shards (`hf_carryover.training.data`). `--num_workers W --worker_index i` takes every W-th
prompt, so W processes can share one GPU (a 135M target decodes launch-bound) without overlapping.

More data from the same prompts: `--temperature 1 --seed S` samples one more response per prompt from the target's
own distribution (a new seed, a new set; give each set its own `--out`); `--start N` skips the first N prompts (e.g.
the ones a greedy set already covers, when the prompt file has grown).

`--engine vllm` generates with vLLM (0.26, the bundle of `shared/tools/make_vllm_bundle.sh`) instead of
transformers: one process fills the GPU with many sequences at once. On the H200 a set of 8592 responses took under
2 minutes, half of it vLLM's start (2026-12-01d), which leaves a 30-minute GPU session its time for training. Two
vLLM processes must not start together on one GPU (each sizes its KV cache from the memory free at its start);
`--sets 0:0 1:1 1:2` makes several sets from one engine instead. `--target` is then a plain HF folder, or
'reference' (its bf16 serving copy is made once under the cache). vLLM decodes in bf16 with its own
kernels, so its greedy responses can part from transformers' at near-ties; both are the target's own responses.
Pass a large `--batch_size` (e.g. 512: one generate() call per shard; vLLM schedules the sequences itself).
"""

import argparse
import json
import os
from pathlib import Path

import torch


def vllm_engine(folder, *, max_model_len, dtype="bfloat16", gpu_memory_utilization=0.5):
    """One vLLM engine for the target folder (its generation config ignored). Its start (compile, graph capture)
    took about 60 s on the H200, so several response sets share one engine (`--sets`)."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # the bundle has no flashinfer
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    from vllm import LLM

    return LLM(model=str(folder), dtype=dtype, seed=0, gpu_memory_utilization=gpu_memory_utilization,
               max_model_len=max_model_len, generation_config="vllm")


def vllm_respond(llm, eos, *, max_new_tokens, temperature):
    """`respond(prompts, seed)` for `regenerate_responses` through a vLLM engine: token ids in, token ids out (no
    re-tokenisation, no detokenisation). Greedy at temperature 0; otherwise the full distribution (top-p 1, no
    top-k), request j of a call seeded with seed + j. A response that stopped at EOS keeps it, as transformers'
    responses do."""
    from vllm import SamplingParams

    def respond(prompts, seed):
        params = [SamplingParams(temperature=temperature, top_p=1.0, max_tokens=max_new_tokens, detokenize=False,
                                 seed=seed + j if temperature > 0 else None) for j in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        responses = []
        for o in outs:
            c = o.outputs[0]
            toks = list(c.token_ids)
            if c.finish_reason == "stop" and eos and (not toks or toks[-1] not in eos):
                toks.append(eos[0])
            responses.append(toks)
        return responses

    return respond


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--target", default="reference")
    p.add_argument("--prompts", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--shard_size", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default=None, help="target dtype (default bfloat16)")
    p.add_argument("--num_workers", type=int, default=1)
    p.add_argument("--worker_index", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (T>0): one response set per seed")
    p.add_argument("--start", type=int, default=0, help="skip the first N prompts of the file")
    p.add_argument("--engine", default="transformers", choices=["transformers", "vllm"])
    p.add_argument("--gpu_memory_utilization", type=float, default=0.5, help="vLLM's share of the GPU")
    p.add_argument("--sets", nargs="+", default=None, metavar="T:SEED",
                   help="vLLM only: several response sets from one engine, set T:SEED into OUT/regen-T<T>-s<SEED> "
                        "(-<dtype> appended when --dtype is given), instead of --temperature/--seed into OUT")
    args = p.parse_args()
    suffix = f"-{args.dtype}" if args.dtype else ""  # as the pipeline names sets of REGEN_DTYPE
    args.dtype = args.dtype or "bfloat16"
    if args.start < 0 or args.seed < 0:
        p.error("--start and --seed must be >= 0")
    if args.engine == "vllm" and args.num_workers > 1:
        p.error("--engine vllm batches all sequences in one process: --num_workers does not apply")
    sets = [(args.temperature, args.seed, None)]  # (temperature, seed, subfolder name or None: OUT itself)
    if args.sets:
        if args.engine != "vllm":
            p.error("--sets shares one vLLM engine between sets: it needs --engine vllm")
        sets = []
        for spec in args.sets:
            t, _, seed = spec.partition(":")
            try:
                sets.append((float(t), int(seed), f"regen-T{t}-s{int(seed)}{suffix}"))
            except ValueError:
                p.error(f"--sets {spec!r}: expected T:SEED, e.g. 0:0 or 1:2")
            if sets[-1][0] < 0 or sets[-1][1] < 0:
                p.error(f"--sets {spec!r}: temperature and seed must be >= 0")
        if len({name for *_, name in sets}) < len(sets):
            p.error(f"--sets {args.sets}: two sets would write the same folder")

    from hf_carryover.training.data import regenerate_responses

    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines()]
    rows = rows[args.start :]
    rows = rows[: args.limit] if args.limit else rows
    rows = rows[args.worker_index :: args.num_workers]
    prompts = [(r["id"], r["input_ids"]) for r in rows]
    out = Path(args.out) / f"w{args.worker_index}" if args.num_workers > 1 else Path(args.out)
    if args.engine == "vllm":
        from transformers import GenerationConfig

        folder = Path(args.target)
        if args.target == "reference":  # vLLM cannot read the GGUF: a bf16 serving copy, made once
            from hf_carryover.reference import reference_dir, save_reference_for_serving

            folder = reference_dir().parent / "serve-target"
            if not (folder / "config.json").exists():
                save_reference_for_serving(folder)
        eos = GenerationConfig.from_pretrained(folder).eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        longest = max(len(p) for _, p in prompts)
        llm = vllm_engine(folder, max_model_len=longest + args.max_new_tokens + 8, dtype=args.dtype,
                          gpu_memory_utilization=args.gpu_memory_utilization)
        for temperature, seed, name in sets:  # one after another on the one engine (each resumable on its own)
            dest = out / name if name else out
            respond = vllm_respond(llm, eos, max_new_tokens=args.max_new_tokens, temperature=temperature)
            regenerate_responses(None, prompts, dest, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                 temperature=temperature, shard_size=args.shard_size, seed=seed,
                                 respond=respond, eos_token_id=eos)
            print(f"vllm: {len(prompts)} responses in {dest}", flush=True)
        return

    dtype = getattr(torch, args.dtype)
    if args.target == "reference":
        from hf_carryover.reference import reference_target

        target, tok = reference_target(dtype=dtype)
        pad = tok.pad_token_id
    else:
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype)
        pad = target.config.pad_token_id
    target = target.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    regenerate_responses(target, prompts, out, max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                         temperature=args.temperature, shard_size=args.shard_size, pad_token_id=pad,
                         seed=args.seed + 1000003 * args.worker_index)  # workers draw different streams
    print(f"worker {args.worker_index}: {len(prompts)} responses in {out}")


if __name__ == "__main__":
    main()
